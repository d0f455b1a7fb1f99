"""Pallas kernels (Triton backend on the GPU, interpret mode on the CPU), each beside the pure-jnp function it
computes, which is the CPU path and the tests' oracle."""
