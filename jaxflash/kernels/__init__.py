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
