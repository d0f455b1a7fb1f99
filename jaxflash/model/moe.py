"""Sparse MoE with a shared expert (docs/model.md §10).

Routed experts are stored dense ([E, out, in], BF16/F32 checkpoints), as NVFP4 (`NVFP4` below, dequantised
inside the matmul: Hopper has no FP4 tensor cores, so this is W4A16) or as FP8 in 128x128 blocks (`FP8Block`:
the MTP head's experts in the NVFP4 checkpoint, dequantised when gathered). Ways to run them:
  * kernel: NVFP4 experts on a GPU at decode sizes: the Pallas kernels of jaxflash.kernels.nvfp4_experts read
    the 4-bit weights where they are; `experts_gather` is their twin.
  * gather: per (token, k) take that expert's weights. Cheap when tokens*top_k is small (decode).
  * grouped: NVFP4 experts on a GPU at prefill sizes: the (token, k) pairs sorted by expert into tiles of one
    expert each, and the Pallas kernels of jaxflash.kernels.nvfp4_grouped multiply the tiles by the 4-bit
    weights where they are; `expert_tiles` is their twin.
  * tiled: the same tiles with the weights gathered (and dequantised) per tile; batched matmuls over tiles
    (prefill elsewhere; memory bounded at any length).
  * ragged: lax.ragged_dot over all experts (fine on the CPU; XLA:GPU makes it a dense matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from ..kernels import moe_inputs, nvfp4_experts, nvfp4_grouped, on_gpu
from .base import (Array, acc_dtype, linear, linear_rows, precision_for, pytree_dataclass, silu, stacked_part,
                   static, top_k, up)

# E2M1 magnitudes indexed by the low three bits of a code; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GROUP = 16


@pytree_dataclass
class NVFP4:
    """A stack of NVFP4 matrices W[e] [N, K] in NVIDIA ModelOpt's layout."""

    packed: Array  # [E, N, K/2] uint8, two E2M1 codes per byte, low nibble first
    scale: Array  # [E, N, K/16] float8_e4m3fn, one per 16 inputs
    scale2: Array  # [E] float32 per-tensor scale (weight_scale_2)


@pytree_dataclass
class FP8Block:
    """A stack of FP8 matrices W[e] [N, K] with a float32 scale per 128x128 tile (ModelOpt's FP8_PB_WO), kept
    as stored: half the memory of bf16, a quarter of float32."""

    q: Array  # [E, N, K] float8_e4m3fn
    scale: Array  # [E, ceil(N/128), ceil(K/128)] float32, the multiplier of each tile


def dequantize_fp8(w: FP8Block, dtype) -> Array:
    """W[..., n, k] = q * scale[..., n // 128, k // 128], the float32 product rounded once to `dtype` (as
    jaxflash.quant.dequantize_fp8_block; any leading axes)."""
    from ..quant import FP8_BLOCK

    n, k = w.q.shape[-2:]
    full = jnp.repeat(jnp.repeat(w.scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)[..., :n, :k]
    return (w.q.astype(jnp.float32) * full.astype(jnp.float32)).astype(dtype)


def dequantize(w: NVFP4, dtype) -> Array:
    """W[..., n, k] = E2M1(code) * scale[..., n, k // 16] * scale2[...], computed in float32 (any leading
    axes: the expert axis, or the (token, k) axes of gathered experts)."""
    lo = w.packed & 0xF
    hi = w.packed >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(*w.packed.shape[:-1], -1)
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[codes & 7]
    vals = jnp.where(codes & 8, -mag, mag)
    scale = jnp.repeat(w.scale.astype(jnp.float32), NVFP4_GROUP, axis=-1)
    return (vals * scale * w.scale2[..., None, None]).astype(dtype)


def e2m1(codes: Array, dtype=jnp.float32) -> Array:
    """E2M1 values of 4-bit codes (any integer array; bit 3 is the sign), by arithmetic rather than a table
    lookup so that XLA fuses it into whatever consumes it: 2^(e-1) * (1 + m/2), or m/2 when e = 0."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, (c & 1).astype(dtype)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * jnp.exp2((e - 1).astype(dtype)))
    return jnp.where((c & 8) != 0, -mag, mag)


def nvfp4_matvec(w: NVFP4, x: Array) -> Array:
    """W x for NVFP4 matrices w [..., N, K/2] and vectors x [..., K] (broadcasting) without materialising W:
    one elementwise-multiply-and-reduce over the packed bytes, which XLA fuses into a single pass over the
    weights -- the decode step reads each expert's 4-bit weights once. Accumulates in float32 (float64 for a
    float64 x); returns [..., N]."""
    f = acc_dtype(x.dtype)
    xf = x.astype(f)
    xe, xo = xf[..., None, 0::2], xf[..., None, 1::2]  # the inputs of each byte's low and high nibble
    prod = e2m1(w.packed & 0xF, f) * xe + e2m1(w.packed >> 4, f) * xo  # [..., N, K/2]
    groups = prod.reshape(*prod.shape[:-1], -1, NVFP4_GROUP // 2).sum(axis=-1)  # [..., N, K/16]
    return jnp.sum(groups * w.scale.astype(f), axis=-1) * w.scale2[..., None].astype(f)


def take_experts(w: Array | NVFP4 | FP8Block, idx: Array) -> Array | NVFP4 | FP8Block:
    """The experts idx (any shape) of a stacked weight: leading axis E becomes idx's shape."""
    return jax.tree.map(lambda a: a[idx], w)


def as_dense(w: Array | NVFP4 | FP8Block, dtype) -> Array:
    if isinstance(w, NVFP4):
        return dequantize(w, dtype)
    if isinstance(w, FP8Block):
        return dequantize_fp8(w, dtype)
    return w.astype(dtype)


@pytree_dataclass
class Experts:
    gate: Array | NVFP4 | FP8Block  # [E, I, H]
    up: Array | NVFP4 | FP8Block  # [E, I, H]
    down: Array | NVFP4 | FP8Block  # [E, H, I]


@pytree_dataclass
class MoE:
    """A MoE block's weights. The four projections of its input x (the router and the shared expert's gate, up
    and sigmoid gate) are stored stacked, so that one matmul reads x for all of them: at decode that is one
    GEMV of the four weights' bytes instead of four small ones. The properties below are the checkpoint's
    tensors."""

    inputs: Array  # [E + 2 Is + 1, H]: gate.weight, shared_expert.gate_proj, .up_proj, shared_expert_gate.weight
    experts: Experts | None  # None: routed experts held outside the parameters (the engine's host pool)
    shared_down_proj: Array  # [H, Is]

    def _edges(self) -> tuple[int, int, int]:
        """Where the router's, the shared gate's and the shared up's rows of `inputs` end."""
        i = self.shared_down_proj.shape[-1]
        e = self.inputs.shape[0] - 2 * i - 1
        return e, e + i, e + 2 * i

    router = stacked_part("inputs", 0)  # gate.weight [E, H]
    shared_gate_proj = stacked_part("inputs", 1)  # [Is, H]
    shared_up_proj = stacked_part("inputs", 2)  # [Is, H]
    shared_expert_gate = stacked_part("inputs", 3)  # [1, H]


def router_probs(p: MoE, x: Array) -> Array:
    """Softmax over the experts [N, E] (float32)."""
    return jax.nn.softmax(up(linear(x, p.router)), axis=-1)


def route(p: MoE, cfg: ModelConfig, x: Array, probs: Array | None = None) -> tuple[Array, Array]:
    """Top-k expert ids [N, k] (int32) and their weights [N, k] (x's dtype): softmax in float32, top-k,
    renormalised when norm_topk_prob."""
    probs = router_probs(p, x) if probs is None else probs
    w, idx = top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype), idx.astype(jnp.int32)


def experts_gather(e: Experts, x: Array, idx: Array, w: Array) -> Array:
    """sum_j w[n, j] * expert_{idx[n, j]}(x[n]) by gathering each (token, k)'s weights. Output float32 [N, H]."""
    dt, prec, f32 = x.dtype, precision_for(x.dtype), acc_dtype(x.dtype)
    if isinstance(e.gate, NVFP4):  # stream the 4-bit weights instead of dequantising them to memory
        g = nvfp4_matvec(take_experts(e.gate, idx), x[:, None, :])  # [N, k, I]
        u = nvfp4_matvec(take_experts(e.up, idx), x[:, None, :])
        a = (silu(g.astype(dt).astype(f32)) * u.astype(dt)).astype(dt)
        y = nvfp4_matvec(take_experts(e.down, idx), a).astype(dt)  # [N, k, H]
        return jnp.einsum("nkh,nk->nh", y.astype(f32), w.astype(f32))
    gate = as_dense(take_experts(e.gate, idx), dt)  # [N, k, I, H]
    up = as_dense(take_experts(e.up, idx), dt)
    down = as_dense(take_experts(e.down, idx), dt)  # [N, k, H, I]
    g = jnp.einsum("nh,nkih->nki", x, gate, precision=prec, preferred_element_type=f32)
    u = jnp.einsum("nh,nkih->nki", x, up, precision=prec, preferred_element_type=f32)
    a = (silu(g.astype(dt).astype(f32)) * u.astype(dt)).astype(dt)
    y = jnp.einsum("nki,nkhi->nkh", a, down, precision=prec, preferred_element_type=f32).astype(dt)
    return jnp.einsum("nkh,nk->nh", y.astype(f32), w.astype(f32))


def experts_ragged(e: Experts, x: Array, idx: Array, w: Array) -> Array:
    """The same sum, with (token, k) pairs sorted by expert and one grouped matmul per projection."""
    dt, prec, f32 = x.dtype, precision_for(x.dtype), acc_dtype(x.dtype)
    n, k = idx.shape
    num_experts = jax.tree.leaves(e.gate)[0].shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[token]

    def grouped(lhs, weight):  # weight [E, out, in]; lhs rows grouped by expert
        return lax.ragged_dot(lhs, jnp.swapaxes(as_dense(weight, dt), 1, 2), sizes, precision=prec,
                              preferred_element_type=f32)

    g = grouped(xs, e.gate)
    u = grouped(xs, e.up)
    a = (silu(g.astype(dt).astype(f32)) * u.astype(dt)).astype(dt)
    y = grouped(a, e.down).astype(dt).astype(f32) * w.reshape(-1)[order].astype(f32)[:, None]
    return jnp.zeros((n, x.shape[-1]), f32).at[token].add(y)


@pytree_dataclass
class TilePlan:
    """A chunk's (token, choice) pairs sorted by expert, each expert's rows padded to whole tiles of `tile` rows,
    so every tile belongs to one expert. a = N * k pairs; the tile count is the static bound
    ceil(a / tile) + min(E, a), of which the first `live` hold pairs."""

    order: Array  # [a] the flat pair index of each sorted position
    token: Array  # [a] its token
    row: Array  # [a] its row among the tiles' rows
    tile_expert: Array  # [n_tiles] int32, the expert of each tile (-1 past the live tiles)
    counts: Array  # [E] pairs per expert
    live: Array  # int32 scalar: tiles holding pairs
    tile: int = static()

    @property
    def rows(self) -> int:
        return self.tile_expert.shape[0] * self.tile

    def sort_rows(self, x: Array) -> Array:
        """The tiles' rows [n_tiles * tile, H]: each pair's token row, zeros in the padding. A gather from x,
        not a scatter into zeros: a zero-filled buffer depends on nothing, and XLA builds those of all layers
        at once at the start of the program, where they stay (most of a prefill chunk's temporaries)."""
        n = x.shape[0]
        source = jnp.full((self.rows,), n, jnp.int32).at[self.row].set(self.token.astype(jnp.int32))
        return x.at[source].get(mode="fill", fill_value=0)  # padding rows name token n: out of range, zeros

    def combine(self, ys: Array, w: Array, n: int) -> Array:
        """sum_j w[n, j] * y of pair (n, j), float32 [n, H], from the tiles' output rows ys: each token gathers
        its k rows (no scatter-add into zeros, see sort_rows)."""
        f32 = acc_dtype(ys.dtype)
        k = w.shape[-1]
        row_of_pair = jnp.zeros(n * k, jnp.int32).at[self.order].set(self.row.astype(jnp.int32))
        y = ys[row_of_pair].reshape(n, k, -1).astype(f32) * w.reshape(n, k, 1).astype(f32)
        return jnp.sum(y, axis=1)


def plan_tiles(idx: Array, num_experts: int, tile: int, pad_tiles_to: int = 1) -> TilePlan:
    """Sort the pairs of idx [N, k] into tiles (see TilePlan); the tile count is rounded up to a multiple of
    pad_tiles_to."""
    n, k = idx.shape
    a = n * k
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.bincount(flat, length=num_experts)
    tiles_of = (counts + tile - 1) // tile
    tile_start = jnp.cumsum(tiles_of) - tiles_of  # first tile of each expert
    group_start = jnp.cumsum(counts) - counts
    row = tile_start[expert] * tile + jnp.arange(a) - group_start[expert]
    bound = -(-a // tile) + min(num_experts, a)  # full tiles, plus a partial last tile per expert
    n_tiles = -(-bound // pad_tiles_to) * pad_tiles_to
    live = jnp.sum(tiles_of).astype(jnp.int32)
    t = jnp.arange(n_tiles)
    tile_expert = jnp.clip(jnp.searchsorted(tile_start, t, side="right") - 1, 0, num_experts - 1)
    tile_expert = jnp.where(t < live, tile_expert, -1).astype(jnp.int32)
    return TilePlan(order, order // k, row, tile_expert, counts, live, tile)


def expert_tiles(we: Experts, xt: Array) -> Array:
    """Rows xt [S, tile, H] of S tiles through their experts we (leading axis S): [S, tile, H] in xt's dtype,
    rounding where the model does (g, u, the activation, y). The jnp twin of the grouped NVFP4 kernels."""
    dt, prec, f32 = xt.dtype, precision_for(xt.dtype), acc_dtype(xt.dtype)
    gate, up, down = (as_dense(m, dt) for m in (we.gate, we.up, we.down))  # [S, I, H], [S, H, I]
    g = jnp.einsum("sth,sih->sti", xt, gate, precision=prec, preferred_element_type=f32)
    u = jnp.einsum("sth,sih->sti", xt, up, precision=prec, preferred_element_type=f32)
    act = (silu(g.astype(dt).astype(f32)) * u.astype(dt)).astype(dt)
    return jnp.einsum("sti,shi->sth", act, down, precision=prec, preferred_element_type=f32).astype(dt)


def experts_tiled(e: Experts, x: Array, idx: Array, w: Array, tile: int = 64, tiles_per_step: int = 32) -> Array:
    """The same sum as a grouped matmul over plan_tiles' tiles, with memory bounded by a few tiles' weights:
    `tiles_per_step` tiles at a time, gather (and dequantise) those tiles' experts, one batched matmul per
    projection (expert_tiles). Each expert's weights are read once per tile it fills. (XLA lowers
    lax.ragged_dot on the GPU to a dense matmul over all experts' weights, which does not fit at full size for
    long inputs; this path does.)"""
    num_experts = jax.tree.leaves(e.gate)[0].shape[0]
    plan = plan_tiles(idx, num_experts, tile, tiles_per_step)
    steps = plan.tile_expert.shape[0] // tiles_per_step
    xs = plan.sort_rows(x).reshape(steps, tiles_per_step, tile, -1)
    tile_expert = jnp.maximum(plan.tile_expert, 0).reshape(steps, tiles_per_step)  # past the live ones: any

    def step(i, rows):  # each step's output overwrites its input rows (as in gated_deltanet's chunk loop)
        return rows.at[i].set(expert_tiles(take_experts(e, tile_expert[i]), rows[i]))

    ys = lax.fori_loop(0, steps, step, xs)
    return plan.combine(ys.reshape(plan.rows, -1), w, x.shape[0])


# Rows per tile of the grouped NVFP4 kernels (a tensor-core dimension; a chunk of C tokens pads each expert's
# C * k / E rows on average to whole tiles).
GROUP_TILE = 64


def experts_grouped(e: Experts, x: Array, idx: Array, w: Array, interpret: bool | None = None,
                    tile: int = GROUP_TILE, tiles: nvfp4_grouped.GroupTiles = nvfp4_grouped.GroupTiles()) -> Array:
    """experts_gather's sum by the grouped NVFP4 kernels (jaxflash.kernels.nvfp4_grouped) over tiles of one
    expert each: the prefill path for resident NVFP4 experts on a GPU (interpret mode elsewhere)."""
    num_experts = e.gate.packed.shape[0]
    plan = plan_tiles(idx, num_experts, tile)
    place, operands = nvfp4_experts.resident_operands(e)
    ys = nvfp4_grouped.grouped_experts(place, operands, plan.sort_rows(x), plan.tile_expert, tile, tiles=tiles,
                                       interpret=interpret)
    return plan.combine(ys, w, x.shape[0])


def experts_kernel(e: Experts, x: Array, idx: Array, w: Array, route: str = "auto") -> Array:
    """experts_gather's sum by the NVFP4 expert kernels of `route` (jaxflash.kernels.nvfp4_experts.ROUTES;
    compiled on a GPU, interpret mode or the CPU handler elsewhere)."""
    place, operands = nvfp4_experts.resident_operands(e)
    return nvfp4_experts.routed_experts(place, operands, x, idx, w, route=route)


def kernel_applies(e: Experts, x: Array, route: str = "auto") -> bool:
    """Whether "auto" takes the kernel where it would gather: NVFP4 experts, bf16/f32 decode-sized tokens,
    compiling for a GPU."""
    return nvfp4_experts.is_nvfp4(e.gate) and nvfp4_experts.takes(x, route)


EXPERT_PATHS = {"gather": experts_gather, "ragged": experts_ragged, "tiled": experts_tiled, "kernel": experts_kernel,
                "grouped": experts_grouped}


@pytree_dataclass
class Routing:
    """What the router chose for N tokens (returned for training losses and routing statistics)."""

    probs: Array  # [N, E] float32 softmax over the experts
    ids: Array  # [N, k] int32 chosen experts
    weights: Array  # [N, k] their (renormalised) weights, x's dtype


# An expert source is where a layer's routed experts come from. It is a pytree value passed into the layer and
# returned updated (its state, such as a VRAM cache, changes explicitly): a source has
#     routed(layer, p, x, ids, w, valid) -> (sum_j w[n, j] * expert_{ids[n, j]}(x[n])  [N, H] float32, source)
# for decoder layer `layer` (a Python int), the layer's MoE parameters p, tokens x [N, H], routed ids/weights
# [N, k] and valid [N] (padding tokens may be routed anywhere; a source that moves experts ignores them).
# ResidentExperts is the one for experts held in the parameters; jaxflash.engine.experts has the host-pool ones.
@pytree_dataclass
class ResidentExperts:
    """Routed experts held in the parameters (every expert in device memory). impl: "kernel", "gather",
    "grouped", "tiled", "ragged", or "auto": while the tokens' expert uses are fewer than the experts, the kernel
    for NVFP4 experts on a GPU and gather otherwise; beyond (prefill chunks), the grouped kernels for NVFP4
    experts and bfloat16 tokens on a GPU and tiled otherwise. route: the decode kernel's
    (nvfp4_experts.ROUTES)."""

    impl: str = static("auto")
    route: str = static("auto")

    def routed(self, layer: int, p: MoE, x: Array, ids: Array, w: Array, valid: Array):
        if p.experts is None:
            raise ValueError("this layer's routed experts are not in the parameters (they live in a host pool): "
                             "pass the engine's expert source")
        impl = self.impl
        if impl == "auto":
            gathers = ids.size <= jax.tree.leaves(p.experts.gate)[0].shape[0]
            if gathers:
                impl = "kernel" if kernel_applies(p.experts, x, self.route) else "gather"
            else:
                impl = "grouped" if nvfp4_experts.is_nvfp4(p.experts.gate) and nvfp4_grouped.takes(x) else "tiled"
        if impl not in EXPERT_PATHS:
            raise ValueError(f"moe_impl must be one of {sorted(EXPERT_PATHS)} or 'auto', got {impl!r}")
        if impl == "kernel":
            return experts_kernel(p.experts, x, ids, w, self.route), self
        return EXPERT_PATHS[impl](p.experts, x, ids, w), self


def given_route(cfg: ModelConfig, probs: Array, ids: Array, dtype) -> tuple[Array, Array]:
    """Weights [N, k] for experts chosen elsewhere (ids [N, k]): the router's probabilities of those experts,
    renormalised like its own top-k."""
    w = jnp.take_along_axis(probs, ids, axis=-1)
    if cfg.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(dtype), ids.astype(jnp.int32)


@pytree_dataclass
class MoEOutput:
    """A MoE block's output y = routed + gate * shared, rounded to shared's dtype, kept as its parts until it is
    added to the residual: the next layer's hyper-connection kernel adds them where it reads y (see
    hyper_connection.combine), so no kernel of its own sums them."""

    routed: Array  # [..., H] float32 (float64 for a float64 model): sum_j w_j expert_j(x)
    shared: Array  # [..., H] the shared expert's output, x's dtype
    gate: Array  # [..., 1] float32: sigmoid of its gate logit

    def total(self) -> Array:
        return (self.routed + self.gate * up(self.shared)).astype(self.shared.dtype)


def moe_parts(p: MoE, cfg: ModelConfig, x: Array, experts, layer: int = 0, valid: Array | None = None,
              ids: Array | None = None, router_kernel: bool | None = None):
    """moe's block with its output as MoEOutput (parts not yet summed). router_kernel: the router's choice and
    the shared expert's activation in jaxflash.kernels.moe_inputs (interpret mode off a GPU); None: on a GPU
    for the few rows it takes (decode and verify steps)."""
    dt, n_experts, shared = x.dtype, p._edges()[0], p.shared_down_proj.shape[-1]
    if router_kernel is None:
        router_kernel = on_gpu() and moe_inputs.takes(x.shape[0], dt)
    with jax.named_scope("router"):  # with the shared expert's input projections (one read of x)
        proj = linear_rows(x, p.inputs)
        logits, shared_gate, shared_up, shared_expert_gate = jnp.split(proj, list(p._edges()), axis=-1)
        probs = jax.nn.softmax(up(logits), axis=-1)  # Routing's; unused (and not computed) in the engine's steps
        if router_kernel:
            kernel_ids, kernel_w, gate, act = moe_inputs.moe_inputs(proj, n_experts, shared, cfg.num_experts_per_tok,
                                                                    cfg.norm_topk_prob)
            w, idx = (kernel_w, kernel_ids) if ids is None else given_route(cfg, probs, ids, dt)
        else:
            w, idx = route(p, cfg, x, probs) if ids is None else given_route(cfg, probs, ids, dt)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid
    with jax.named_scope("routed_experts"):
        routed_out, experts = experts.routed(layer, p, x, idx, w, valid)
    with jax.named_scope("shared_expert"):
        if not router_kernel:
            act = silu(up(shared_gate)).astype(dt) * shared_up
            gate = jax.nn.sigmoid(up(shared_expert_gate))
        shared_out = linear(act, p.shared_down_proj)
    return MoEOutput(routed_out, shared_out, gate), experts, Routing(probs, idx, w)


def moe(p: MoE, cfg: ModelConfig, x: Array, experts, layer: int = 0, valid: Array | None = None,
        ids: Array | None = None, router_kernel: bool | None = None):
    """MoE block over tokens x [N, H]: router top-k, the routed experts from the expert source `experts`,
    plus the gated shared expert. Returns (y [N, H] in x's dtype, the updated source, Routing).
    ids [N, k]: route to these experts instead of the router's top-k (fixed routing for studies and
    benchmarks); the router still runs and gives their weights. router_kernel: see moe_parts."""
    out, experts, routing = moe_parts(p, cfg, x, experts, layer, valid, ids, router_kernel)
    return out.total(), experts, routing
