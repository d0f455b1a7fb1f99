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
