"""Gated DeltaNet, the linear-attention mixer of 3 layers in 4 (docs/model.md §7).

Per value head h the state S_h [dk, dv] evolves as
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
Prefill uses the chunked (WY / UT-transform) form, which turns 64 sequential updates into a few matmuls;
decode and verify steps (up to UNROLL tokens) use the recurrence directly. Both run in float32 (float64 for a
float64 model). On a GPU decode steps run the recurrence in a kernel (jaxflash.kernels.gdn_decode) and prefill
chunks the chunked form in three (jaxflash.kernels.gdn_chunk); this module's code is the twin of both.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from ..config import ModelConfig
from ..kernels import gdn_chunk, gdn_decode
from .base import (Array, acc_dtype, linear, linear_rows, linear_split, pytree_dataclass, silu, stacked_part,
                   up)
from .norms import l2norm, rms_norm_gated

CHUNK = 64
UNROLL = 8  # up to this many tokens (a verify step's K+1) take the recurrence, unrolled: the chunked form would
# pad them to CHUNK
_HI = lax.Precision.HIGHEST


@pytree_dataclass
class GatedDeltaNet:
    """A GDN layer's weights. The four projections of its input (in_proj_qkv, _z, _b, _a) are stored stacked
    (base.stack_rows: one matmul reads x for all four); the properties below are the checkpoint's tensors."""

    in_proj: Array  # [conv_dim + value_dim + 2 Hv, H]: in_proj_qkv (q | k | v) | in_proj_z | in_proj_b | in_proj_a
    conv1d: Array  # [conv_dim, K] depthwise causal kernel (checkpoint [conv_dim, 1, K])
    dt_bias: Array  # [Hv]
    A_log: Array  # [Hv]
    norm: Array  # [dv]
    out_proj: Array  # [H, value_dim]

    def _edges(self) -> tuple[int, int, int]:
        """Where in_proj_qkv's, in_proj_z's and in_proj_b's rows of `in_proj` end."""
        c, v = self.conv1d.shape[0], self.out_proj.shape[-1]
        return c, c + v, c + v + self.dt_bias.shape[0]

    in_proj_qkv = stacked_part("in_proj", 0)  # [2*key_dim + value_dim, H]
    in_proj_z = stacked_part("in_proj", 1)  # [value_dim, H]
    in_proj_b = stacked_part("in_proj", 2)  # [Hv, H]
    in_proj_a = stacked_part("in_proj", 3)  # [Hv, H]


@pytree_dataclass
class GDNState:
    conv: Array  # [K-1, conv_dim]: the last K-1 raw (pre-conv) qkv rows
    recurrent: Array  # [Hv, dk, dv] float32


@pytree_dataclass
class GDNPending:
    """A GDN layer's state after a verify step (several draft tokens per sequence), before it is known how
    many of them are kept: what `commit` needs to make the state after any prefix of them, exactly."""

    hist: Array  # [K-1+T, conv_dim]: the conv state before the step, then the step's raw qkv rows
    k: Array  # [T, Hv, dk] float32: the delta rule's inputs per token
    v: Array  # [T, Hv, dv]
    g: Array  # [T, Hv]
    beta: Array  # [T, Hv]
    recurrent: Array  # [Hv, dk, dv]: the recurrent state before the step


@pytree_dataclass
class GDNPendingBatch:
    """gated_deltanet_batch's verify step: the B sequences' GDNPending (leading axis B) beside the whole state
    of N >= B rows before the step, into which commit_batch writes the kept rows."""

    rows: GDNPending
    whole: GDNState


def conv_window(hist: Array, n: Array | int, width: int) -> Array:
    """The conv state after the first n new rows of hist = [the conv state (width rows); the new rows]: its rows
    n .. n + width - 1. (For one new row the decode kernel writes the same, see _decode_kernel.)"""
    return lax.dynamic_slice_in_dim(hist, n, width, axis=0)


def commit(p: GDNPending, n: Array | int) -> GDNState:
    """The state after the first n tokens of a verify step: the delta rule again over them alone (the
    projections, the conv and the gates are not recomputed; tokens from n on get beta = g = 0, which leaves
    the state as it was), and the conv history cut to end at token n."""
    t = p.k.shape[0]
    live = (jnp.arange(t) < n)[:, None]
    g, beta = jnp.where(live, p.g, 0.0), jnp.where(live, p.beta, 0.0)
    s = p.recurrent
    for i in range(t):  # T is a few tokens: unrolled (a GPU while loop would leave the command buffer)
        s = _delta_update(s, p.k[i], p.v[i], g[i], beta[i])
    return GDNState(conv=conv_window(p.hist, n, p.hist.shape[0] - t), recurrent=s)


def init_state(cfg: ModelConfig, dtype) -> GDNState:
    return GDNState(
        conv=jnp.zeros((cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype),
        recurrent=jnp.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                            acc_dtype(dtype)),
    )


def causal_conv(x: Array, history: Array, w: Array) -> tuple[Array, Array, Array]:
    """Depthwise causal conv: out[t] = sum_j w[:, j] * x[t - K + 1 + j], with `history` as the K-1 rows before x.

    Returns (out, hist) where hist = [history; x] (float32 accumulation, x's dtype out).
    """
    k = w.shape[-1]
    hist = jnp.concatenate([history.astype(x.dtype), x], axis=0)
    t = x.shape[0]
    acc = sum(up(hist[j : j + t]) * w[:, j].astype(acc_dtype(x.dtype)) for j in range(k))
    return acc.astype(x.dtype), hist


def unit_lower_inverse(m: Array) -> Array:
    """Inverse of unit lower-triangular matrices m [..., n, n] (n a power of two; only the strictly lower part
    of m is read), by block doubling: with the diagonal blocks of size s already inverted,
        [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]
    gives the inverses of the blocks of size 2s. log2(n) levels of batched matmuls: no LAPACK call (whose
    batched CPU kernel can deadlock XLA's thread pool) and no sequential substitution on the GPU."""
    n = m.shape[-1]
    lead = m.shape[:-2]
    inv = jnp.ones((*lead, n, 1, 1), m.dtype)  # the 1x1 diagonal blocks of a unit triangle
    s = 1
    while s < n:
        nb = n // (2 * s)
        blocks = m.reshape(*lead, nb, 2 * s, nb, 2 * s)
        diag = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, 2s, 2s]
        c = diag[..., s:, :s]
        a, b = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -jnp.einsum("...ij,...jk,...kl->...il", b, c, a, precision=_HI)
        top = jnp.concatenate([a, jnp.zeros_like(a)], axis=-1)
        bottom = jnp.concatenate([lower, b], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv[..., 0, :, :]


def chunk_gated_delta_rule(q, k, v, g, beta, state):
    """Chunked form. q, k [T, Hv, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [Hv, dk, dv]. All float32.

    Within a chunk with cumulative log-decay gam, Gam_ij = exp(gam_i - gam_j) (i >= j). With
    A = strictly_lower((beta K) K^T * Gam):  U = (I+A)^-1 (beta V),  Wd = (I+A)^-1 (beta K * exp(gam)),
    and per chunk  v_new = U - Wd S,  O = (Q exp(gam)) S + ((Q K^T) * Gam) v_new,
    S <- exp(gam_C) S + (K exp(gam_C - gam))^T v_new.
    """
    t, hv, dk = k.shape
    pad = (-t) % CHUNK
    if pad:  # zero g, beta, k, v: padded steps leave the state untouched
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    n = (t + pad) // CHUNK

    def chunks(a):  # [T, Hv, ...] -> [Hv, N, C, ...]
        a = a.reshape(n, CHUNK, hv, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gam = jnp.cumsum(g, axis=-1)  # [Hv, N, C]
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    diff = gam[..., :, None] - gam[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)  # Gam, zero above the diagonal

    kb = k * beta[..., None]
    vb = v * beta[..., None]
    a_mat = jnp.einsum("hncd,hned->hnce", kb, k, precision=_HI) * decay
    inv = unit_lower_inverse(jnp.tril(a_mat, -1))  # (I + A)^-1
    u = jnp.einsum("hnij,hnjd->hnid", inv, vb, precision=_HI)
    wd = jnp.einsum("hnij,hnjd->hnid", inv, kb * jnp.exp(gam)[..., None], precision=_HI)
    qd = q * jnp.exp(gam)[..., None]
    kd = k * jnp.exp(gam[..., -1:] - gam)[..., None]
    intra = jnp.einsum("hncd,hned->hnce", q, k, precision=_HI) * decay
    chunk_decay = jnp.exp(gam[..., -1])  # [Hv, N]

    def step(i, carry):
        s, uo = carry
        wd_i, qd_i, kd_i, intra_i, dec_i = (a[i] for a in xs)
        v_new = uo[i] - jnp.einsum("hcd,hde->hce", wd_i, s, precision=_HI)
        o = jnp.einsum("hcd,hde->hce", qd_i, s, precision=_HI) + jnp.einsum("hce,hed->hcd", intra_i, v_new,
                                                                              precision=_HI)
        s = s * dec_i[:, None, None] + jnp.einsum("hcd,hce->hde", kd_i, v_new, precision=_HI)
        return s, uo.at[i].set(o)

    # Over the N chunks in order. Chunk i's output overwrites its u (read just before): no zero-filled output
    # buffer as lax.scan's would be, which depends on nothing, so XLA builds those of all GDN layers at once
    # at the start of the program, where they stay.
    u, *xs = (jnp.moveaxis(a, 1, 0) for a in (u, wd, qd, kd, intra, chunk_decay))
    state, o = lax.fori_loop(0, n, step, (state, u))  # o [N, Hv, C, dv]
    o = jnp.moveaxis(o, 1, 2).reshape(n * CHUNK, hv, -1)
    return o[:t], state


def _delta_update(s, k_t, v_t, g_t, b_t):
    """One token's update of the state s [Hv, dk, dv]: decay, then the delta rule."""
    s = s * jnp.exp(g_t)[:, None, None]
    kv = jnp.einsum("hkv,hk->hv", s, k_t, precision=_HI)
    return s + k_t[:, :, None] * ((v_t - kv) * b_t[:, None])[:, None, :]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token form (decode). Same shapes as chunk_gated_delta_rule."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = _delta_update(s, k_t, v_t, g_t, b_t)
        return s, jnp.einsum("hkv,hk->hv", s, q_t, precision=_HI)

    if q.shape[0] <= UNROLL:  # decode and verify steps: no loop (a GPU while loop leaves the CUDA graph)
        outs = []
        for t in range(q.shape[0]):
            state, o = step(state, (q[t], k[t], v[t], g[t], beta[t]))
            outs.append(o)
        return jnp.stack(outs), state
    state, o = lax.scan(step, state, (q, k, v, g, beta))
    return o, state


def gated_deltanet(p: GatedDeltaNet, cfg: ModelConfig, x: Array, state: GDNState,
                   n_valid: Array | int | None = None, pending: bool = False,
                   kernel: bool = False) -> tuple[Array, GDNState | GDNPending]:
    """One sequence: x [T, H] -> ([T, H], new state). Rows at or past `n_valid` are padding: they leave the
    state as it was. pending: return a GDNPending instead of the new state (a verify step: `commit` then keeps
    the accepted tokens). kernel: the chunked form (T > UNROLL, not pending) runs in jaxflash.kernels.gdn_chunk.
    This code is also the twin of the decode kernel (see gated_deltanet_batch)."""
    t = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd = cfg.linear_key_dim

    qkv_raw, z, b, a = linear_split(x, p.in_proj, p._edges())
    z = z.reshape(t, hv, dv)

    conv_out, hist = causal_conv(qkv_raw, state.conv, p.conv1d)
    qkv = silu(up(conv_out)).astype(x.dtype)
    q = qkv[:, :kd].reshape(t, hk, dk)
    k = qkv[:, kd : 2 * kd].reshape(t, hk, dk)
    v = up(qkv[:, 2 * kd :].reshape(t, hv, dv))

    beta = jax.nn.sigmoid(up(b))
    g = -jnp.exp(up(p.A_log)) * jax.nn.softplus(up(a) + p.dt_bias)
    if n_valid is not None:
        live = jnp.arange(t) < n_valid
        beta = jnp.where(live[:, None], beta, 0.0)
        g = jnp.where(live[:, None], g, 0.0)

    q = l2norm(q) * (dk ** -0.5)
    k = l2norm(k)
    if kernel and t > UNROLL and not pending:  # the kernels read each key head where its value heads need it
        o, recurrent = gdn_chunk.chunk_rule(q, k, v, g, beta, state.recurrent,
                                            precision=gdn_chunk.precision_for(x.dtype))
    else:  # each key head serves hv/hk consecutive value heads
        q, k = (jnp.repeat(a, hv // hk, axis=1) for a in (q, k))
        rule = recurrent_gated_delta_rule if t <= UNROLL else chunk_gated_delta_rule
        o, recurrent = rule(q, k, v, g, beta, state.recurrent)

    o = rms_norm_gated(o.astype(x.dtype), z, p.norm, cfg.rms_norm_eps, cfg.output_gate_type)
    y = linear(o.reshape(t, hv * dv), p.out_proj)
    if pending:
        return y, GDNPending(hist=hist, k=k, v=v, g=g, beta=beta, recurrent=state.recurrent)
    conv = conv_window(hist, t if n_valid is None else n_valid, cfg.linear_conv_kernel_dim - 1)
    return y, GDNState(conv=conv, recurrent=recurrent)


def gated_deltanet_batch(p: GatedDeltaNet, cfg: ModelConfig, x: Array, state: GDNState, n_valid: Array,
                         kernel: bool = False, pending: bool = False) -> tuple[Array, GDNState | GDNPendingBatch]:
    """gated_deltanet over B sequences: x [B, T, H], n_valid [B], a state of N >= B rows (conv [N, K-1, C],
    recurrent [N, Hv, dk, dv]). Sequence i owns row i; rows B..N-1 (the engine's slots outside a decode
    bucket) come back as they were, so a bucket never cuts its rows out of the whole state (see the decode
    kernel). kernel: a decode step (T = 1) runs its recurrent part in jaxflash.kernels.gdn_decode, a prefill
    chunk (T > UNROLL) its chunked form in jaxflash.kernels.gdn_chunk (compiled on a GPU, interpreted
    elsewhere). pending: a GDNPendingBatch (commit_batch then writes the kept rows)."""
    b, t = x.shape[:2]
    if kernel and t == 1 and not pending:
        return _decode_kernel(p, cfg, x[:, 0], state, n_valid)
    rows = GDNState(conv=state.conv[:b], recurrent=state.recurrent[:b])
    y, new = jax.vmap(lambda xx, st, n: gated_deltanet(p, cfg, xx, st, n, pending, kernel))(x, rows, n_valid)
    if pending:
        return y, GDNPendingBatch(rows=new, whole=state)
    return y, _put_rows(state, new)


def commit_batch(p: GDNPendingBatch, keep: Array) -> GDNState:
    """`commit` for the B sequences of a gated_deltanet_batch verify step: keep [B] tokens each."""
    return _put_rows(p.whole, jax.vmap(commit)(p.rows, keep))


def _put_rows(whole: GDNState, rows: GDNState) -> GDNState:
    """whole with its first rows replaced by `rows` (in place in a program that donates it)."""
    def put(w, r):
        return r.astype(w.dtype) if r.shape == w.shape else w.at[: r.shape[0]].set(r.astype(w.dtype))

    return GDNState(conv=put(whole.conv, rows.conv), recurrent=put(whole.recurrent, rows.recurrent))


def _decode_kernel(p: GatedDeltaNet, cfg: ModelConfig, x: Array, state: GDNState, n_valid: Array):
    """One token per sequence, x [B, H], through the decode kernel between the projections."""
    b = x.shape[0]
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    live = (n_valid > 0).astype(jnp.int32)
    proj = linear_rows(x, p.in_proj)  # the kernel reads qkv, b and a in place
    _, z, _, _ = jnp.split(proj, list(p._edges()), axis=-1)
    # the kernel returns conv_window of [old rows; the new row] at n = live (a padding token keeps its rows)
    o, conv, recurrent = gdn_decode.recurrent_step(cfg, proj, live, p.conv1d, p.dt_bias, p.A_log, state.conv,
                                                   state.recurrent)
    z = z.reshape(b, hv, dv)
    o = rms_norm_gated(o, z, p.norm, cfg.rms_norm_eps, cfg.output_gate_type)
    y = linear_rows(o.reshape(b, hv * dv), p.out_proj)[:, None]
    return y, _put_rows(state, GDNState(conv=conv, recurrent=recurrent))
