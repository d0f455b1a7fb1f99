"""Pallas kernels (Triton backend on the GPU, interpret mode on the CPU), each beside the pure-jnp function it
computes, which is the CPU path and the tests' oracle."""

import jax

from ..model.base import precision_for


def on_gpu() -> bool:
    """Whether programs traced now compile for a GPU, where the kernels run compiled (elsewhere the jnp twin is
    the path; the kernels run there only in interpret mode, for tests)."""
    return jax.default_backend() == "gpu"


def compiler_params(interpret: bool, warps: int, stages: int = 1):
    """The Triton backend's compile parameters of a pallas_call (None in interpret mode, which takes none)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def dot(a, b, contract_b: int):
    """a [m, k] times b (contracting b's axis contract_b: 1 for b [n, k], i.e. a b^T; 0 for b [k, n]) with float32
    sums inside a kernel; float32 inputs in full precision (the tensor cores would take TF32)."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision_for(a.dtype),
                               preferred_element_type=jax.numpy.float32)


# Triton blocks have power-of-two sizes: the kernels pad or tile their shapes with these.
def pow2_ceil(n: int, least: int = 1) -> int:
    """The least power of two >= n, and >= least."""
    return max(least, 1 << max(0, (n - 1).bit_length()))


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


# Programmatic dependent launch (Hopper; XLA's command buffer launches Pallas kernels so, benchmarks/pdl_probe.py).
# A producer that calls `launch_dependents` lets the next kernel start while it still runs; that kernel issues the
# loads that need nothing from the producer (its weights), then `wait_for_producer` until the producer has ended
# and its writes are visible, and only then reads the producer's outputs. Both return an int32 zero that the
# caller adds to an index: the compiler treats the instructions as pure, so a data dependence is what keeps the
# trigger before the loads that use it and the producer's reads after the wait. In interpret mode (no GPU) both
# are plain zeros.
_TRIGGER_PTX = "griddepcontrol.launch_dependents;\nmov.b32 $0, $1;"
_WAIT_PTX = "griddepcontrol.wait;\nmov.b32 $0, $1;"


def _grid_dependency(ptx: str, interpret: bool, tie=None):
    import jax.numpy as jnp

    if interpret:
        return jnp.int32(0) if tie is None else tie
    from jax.experimental.pallas import triton as plgpu

    v = jnp.zeros((1,), jnp.int32) if tie is None else jnp.reshape(tie, (1,))
    [r] = plgpu.elementwise_inline_asm(ptx, args=[v], constraints="=r,r", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.sum(r)


def launch_dependents(interpret: bool):
    """Let the next kernel launch now (it must wait_for_producer before reading this kernel's outputs); an int32
    zero to add to the index of the kernel's first loads."""
    return _grid_dependency(_TRIGGER_PTX, interpret)


def wait_for_producer(interpret: bool, tie=None):
    """Block until the kernels this one depends on have ended; an int32 zero to add to the index of every load of
    their outputs. tie: a value (e.g. launch_dependents') the wait must come after."""
    return _grid_dependency(_WAIT_PTX, interpret, tie)
