"""What a MoE block does with the rows of its stacked input product before the experts run, in one kernel
(Pallas; Triton backend on a GPU) where XLA spends three to four: the router's choice and the shared expert's
activation.

The block's four input projections are one product (moe.MoE.inputs): a row holds the router logits [E], the
shared expert's gate [Is] and up [Is] projections, and its gate logit [1]. The kernel reads them where the
product wrote them and, per token row n:
  * program (n, 0) routes: softmax of the logits in float32, the k largest probabilities by k rounds of a max
    and the lowest index holding it (equal values in index order, as moe.route's top_k), renormalised when
    the model says so; and the shared expert's gate value sigmoid(gate logit);
  * programs (n, 1...) each write PIECE columns of the shared expert's activation silu(gate) * up, rounded
    where the model rounds.
XLA ranks the 512 probabilities by a compare-and-count over all pairs, then sums the picks: two kernels, plus
one for the activation. On the H100 the kernel takes 4.0 us per layer at 1 to 32 rows against XLA's 7.5 (1 row)
to 16.4 (32 rows) for the same work (benchmarks/RESULTS.md, "The MoE block's inputs in one kernel"); its 2k
serial reductions in one warp set its time. The pure-jnp twin is the model's own
code (moe.route, the shared expert's activation in moe.moe): the CPU path and the tests' oracle (the tests run
this kernel in interpret mode).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from . import compiler_params, on_gpu, pow2_ceil

Array = jax.Array
MAX_ROWS = 64  # token rows the kernel takes (a program per row and part); more rows (prefill) take XLA's route
PIECE = 128  # columns of the shared expert's activation per program
WARPS = 1  # a warp holds a row's logits (16 per thread at E = 512): the k rounds' reductions need no barrier


def takes(rows: int, dtype) -> bool:
    """Whether the kernel runs a step of `rows` token rows whose product is in `dtype`."""
    return 1 <= rows <= MAX_ROWS and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _kernel(proj_ref, ids_ref, w_ref, gate_ref, act_ref, *, experts: int, shared: int, k: int, norm: bool,
            piece: int):
    f32 = jnp.float32
    n, part = pl.program_id(0), pl.program_id(1)
    width = experts + 2 * shared + 1
    row = n * width

    @pl.when(part == 0)
    def _route():
        lane = jnp.arange(pow2_ceil(experts), dtype=jnp.int32)
        z = proj_ref[row + jnp.minimum(lane, experts - 1)].astype(f32)
        z = jnp.where(lane < experts, z, -jnp.inf)
        e = jnp.exp(z - jnp.max(z))
        probs = e / jnp.sum(e)
        left = jnp.where(lane < experts, probs, -1.0)  # taken entries become -1, below every probability
        vals, ids = [], []
        for _ in range(k):
            best = jnp.max(left)
            at = jnp.min(jnp.where(left == best, lane, lane.shape[0]))
            vals.append(best)
            ids.append(at)
            left = jnp.where(lane == at, -1.0, left)
        picked = sum(vals[1:], vals[0])
        for j in range(k):
            ids_ref[n * k + j] = ids[j]
            w_ref[n * k + j] = (vals[j] / picked if norm else vals[j]).astype(w_ref.dtype)
        gate_ref[n] = jax.nn.sigmoid(proj_ref[row + width - 1].astype(f32))

    @pl.when(part > 0)
    def _activation():
        cols = (part - 1) * piece + jnp.arange(piece, dtype=jnp.int32)
        at = row + experts + jnp.minimum(cols, shared - 1)
        g, u = proj_ref[at].astype(f32), proj_ref[at + shared].astype(f32)
        act = jax.nn.silu(g).astype(act_ref.dtype).astype(f32) * u  # moe.moe's rounding
        plt.store(act_ref.at[n * shared + cols], act.astype(act_ref.dtype), mask=cols < shared)


def moe_inputs(proj: Array, experts: int, shared: int, k: int, norm_topk_prob: bool, *,
               interpret: bool | None = None, piece: int = PIECE, warps: int = WARPS):
    """proj [N, E + 2 Is + 1]: rows of the stacked input product (moe.MoE.inputs) -> (expert ids [N, k] int32,
    their weights [N, k] in proj's dtype, the shared expert's gate sigmoid(.) [N, 1] float32, its activation
    silu(gate) * up [N, Is] in proj's dtype). interpret: Pallas interpret mode (default: off a GPU)."""
    rows, width = proj.shape
    if width != experts + 2 * shared + 1:
        raise ValueError(f"a product row of {width} columns; {experts} experts and a shared expert of {shared} "
                         f"give {experts + 2 * shared + 1}")
    if not takes(rows, proj.dtype) or not 0 < k <= experts:
        raise ValueError(f"moe_inputs takes 1 to {MAX_ROWS} bfloat16/float32 rows and 0 < k <= experts; got "
                         f"{proj.dtype}{list(proj.shape)}, k={k}")
    interpret = not on_gpu() if interpret is None else interpret
    return _moe_inputs(proj, experts=experts, shared=shared, k=k, norm=bool(norm_topk_prob), interpret=interpret,
                       piece=min(piece, pow2_ceil(shared)), warps=warps)


@partial(jax.jit, static_argnames=("experts", "shared", "k", "norm", "interpret", "piece", "warps"))
def _moe_inputs(proj, *, experts: int, shared: int, k: int, norm: bool, interpret: bool, piece: int, warps: int):
    rows, dt = proj.shape[0], proj.dtype
    flat = proj.reshape(-1)
    whole = pl.BlockSpec(flat.shape, lambda i, j: (0,))
    outs = (jax.ShapeDtypeStruct((rows * k,), jnp.int32), jax.ShapeDtypeStruct((rows * k,), dt),
            jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows * shared,), dt))
    kernel = partial(_kernel, experts=experts, shared=shared, k=k, norm=norm, piece=piece)
    ids, w, gate, act = pl.pallas_call(
        kernel, out_shape=outs, grid=(rows, 1 + -(-shared // piece)), in_specs=[whole],
        out_specs=tuple(pl.BlockSpec(o.shape, lambda i, j: (0,)) for o in outs),
        compiler_params=compiler_params(interpret, warps), interpret=interpret, name="moe_inputs",
    )(flat)
    return ids.reshape(rows, k), w.reshape(rows, k), gate.reshape(rows, 1), act.reshape(rows, shared)
