"""Pallas kernels (Triton backend on the GPU, interpret mode on the CPU), each beside the pure-jnp function it
computes, which is the CPU path and the tests' oracle."""

import jax


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
