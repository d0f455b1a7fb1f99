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


# ----- work items of one launch that depend on each other ------------------------------------------------------
# A kernel that would otherwise be two launches (the second reading what the first wrote) runs as one: a few
# programs per SM walk a fixed list of items, every producing item before any consuming one. A producing item
# adds 1 to a count when its writes are done; a consuming item first loads what does not depend on them (its
# weights), then waits for the count. Every program is resident at once, and a program reaches its consuming
# items only after its own producing ones, so every wait ends. Counts live in an int32 buffer that the caller
# zeroes for each launch.
SPIN_LIMIT = 1 << 16  # polls of a count (tens of ms; a wait takes a few µs) before a wait gives up and flags it


def sm_count() -> int:
    """Streaming multiprocessors of the GPU programs compile for (132 if the runtime does not say)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def item_loop(n_items: int, n_prog: int, body):
    """body(item) for items pid, pid + n_prog, ... below n_items (item an int32 scalar; body guards the
    range)."""
    from jax.experimental import pallas as pl

    pid = pl.program_id(0)  # read here: interpret mode resolves program ids only outside loops

    def step(i, carry):
        body(pid + i * n_prog)
        return carry

    jax.lax.fori_loop(0, -(-n_items // n_prog), step, 0)


def count_done(ref, idx, interpret: bool):
    """Add 1 to ref[idx] once every thread of the program has written its results (the atomic add releases at
    GPU scope, so those writes are visible to whoever sees the new count)."""
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as plgpu

    if not interpret:
        plgpu.debug_barrier()
    plgpu.atomic_add(ref, idx, jnp.asarray(1, jnp.int32))


def count_wait(ref, idx, target: int, flag: int):
    """Poll ref[idx] (volatile loads: never a stale copy) until it reaches `target`; after SPIN_LIMIT polls give
    up and add 1 to ref[flag], which the caller checks (its results are then wrong, where waiting on would hang
    the GPU). Returns an int32 zero computed from the count: added to the index of every load of the producers'
    results, it keeps those loads after the wait."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def poll():
        return plgpu.load(ref.at[idx], volatile=True)

    count, _ = jax.lax.while_loop(lambda c: (c[0] < target) & (c[1] < SPIN_LIMIT),
                                  lambda c: (poll(), c[1] + 1), (poll(), jnp.asarray(0, jnp.int32)))

    @pl.when(count < target)
    def _():
        plgpu.atomic_add(ref, jnp.asarray(flag, jnp.int32), jnp.asarray(1, jnp.int32))

    return jax.lax.shift_right_logical(count, jnp.asarray(30, jnp.int32))  # the counts stay far below 2^30: zero
