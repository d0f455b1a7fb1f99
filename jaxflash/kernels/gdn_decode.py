"""The recurrent part of a Gated DeltaNet decode step in one kernel per layer (Pallas; Triton backend on a GPU).

After the input projection (one XLA matrix-vector product of the stacked in_proj, qkv | z | b | a, whose row
the kernel reads in place: slices of it handed to a custom call would each cost XLA a copy), program (i, h, c)
of a grid of sequences x value heads x column blocks does, for sequence i, value head h and its value columns
[c BV, (c+1) BV), what jaxflash.model.gated_deltanet does for one new token, where XLA spends about a dozen
small kernels:
  * the causal depthwise conv over [conv state; the new row] of the columns it reads (all of q and k of key
    head h // (Hv/Hk), its block of v) and SiLU;
  * beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias), both 0 for a padding token, whose
    state then stays as it was;
  * the l2norm of q (times dk^-1/2) and of k, and the delta rule on its [dk, BV] block of the float32 state
    S [dk, dv], updated in place (the state buffer is aliased in and out; blocks are disjoint):
        S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q.
The column blocks keep a program's share of the state small (dk x BV floats: registers, not spills) and give
the GPU Hv dv / BV programs. The gated RMSNorm over all dv columns of o stays in XLA after the kernel.
The kernel also writes the conv state shifted by one row (the new raw row last; a padding token's rows as they
were) into a fresh output: each column by one program, the one that owns it (a block of v by its program, the q
and k columns of a key head by the group's first program), since several programs read the q and k columns and
an in-place shift would race with their reads. This replaces XLA's own shift, a select kernel of 2.4 us per
GDN layer on the H100; XLA still copies the fresh output into the donated state (one small copy kernel per
layer, as it copied the state before its select; RESULTS.md). The states may hold more rows than the step
has sequences (a decode bucket runs the first B of the engine's slots): the kernel reads rows [0, B) of the
whole buffers and updates the recurrent rows in place, where cutting the rows out would cost a device copy per
layer and state (3 MB per row for the recurrent one at full size) and the write-back another, outside the CUDA
graph.
It rounds where the model rounds (the conv output and SiLU to the compute dtype, o at the end). Its pure-jnp
twin is the model's own code, gated_deltanet on one token: the CPU path and the tests' oracle (the tests run
this kernel in interpret mode).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..config import ModelConfig
from . import compiler_params, on_gpu

Array = jax.Array
DTYPES = (jnp.bfloat16, jnp.float32)  # compute dtypes the kernel takes (the state is float32 for both)
_L2_EPS = 1e-6  # jaxflash.model.norms.l2norm's


def takes(cfg: ModelConfig, dtype) -> bool:
    """Whether the kernel can run this model: a supported dtype, power-of-two head sizes (Triton blocks)."""
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in (cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    return jnp.dtype(dtype) in DTYPES and pow2


def _kernel(proj_ref, live_ref, w_ref, dt_bias_ref, a_log_ref, conv_ref, rec_ref,
            o_ref, conv_out_ref, rec_out_ref, *, hk: int, hv: int, dk: int, bv: int, width: int, b_at: int):
    f32 = jnp.float32
    dt = o_ref.dtype
    h, c = pl.program_id(1), pl.program_id(2)  # axis 0: the sequence
    group = hv // hk
    j = h // group  # the key head this value head reads
    live = live_ref[0] > 0
    kd = hk * dk

    def conv(start, n, owner):
        """SiLU(conv) of columns [start, start + n), rounded as the model rounds; the program that owns the
        columns writes their shifted state."""
        cols = pl.ds(start, n)
        rows = [conv_ref[r, cols] for r in range(width - 1)] + [proj_ref[0, cols]]
        acc = rows[0].astype(f32) * w_ref[cols, 0].astype(f32)
        for r in range(1, width):
            acc = acc + rows[r].astype(f32) * w_ref[cols, r].astype(f32)

        @pl.when(owner)
        def _():
            for r in range(width - 1):
                conv_out_ref[r, cols] = jnp.where(live, rows[r + 1].astype(conv_out_ref.dtype), rows[r])

        y = acc.astype(dt).astype(f32)
        return (y * jax.nn.sigmoid(y)).astype(dt)

    v_start = 2 * kd + h * (bv * pl.num_programs(2)) + c * bv
    first = (h % group == 0) & (c == 0)  # the program that writes the key head's q and k columns
    q = conv(j * dk, dk, first)
    k = conv(kd + j * dk, dk, first)
    v = conv(v_start, bv, True)

    qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
    qf = qf * jax.lax.rsqrt(jnp.sum(qf * qf) + _L2_EPS) * (dk ** -0.5)
    kf = kf * jax.lax.rsqrt(jnp.sum(kf * kf) + _L2_EPS)
    beta = jax.nn.sigmoid(proj_ref[0, b_at + h].astype(f32))
    a = proj_ref[0, b_at + hv + h].astype(f32)
    g = -jnp.exp(a_log_ref[h].astype(f32)) * jax.nn.softplus(a + dt_bias_ref[h].astype(f32))
    beta = jnp.where(live, beta, 0.0)
    g = jnp.where(live, g, 0.0)

    cols = pl.ds(c * bv, bv)
    s = rec_ref[h, :, cols] * jnp.exp(g)  # [dk, BV]
    kv = jnp.sum(s * kf[:, None], axis=0)  # (S^T k) of these columns
    s = s + kf[:, None] * ((vf - kv) * beta)[None, :]
    rec_out_ref[h, :, cols] = s
    o_ref[h, cols] = jnp.sum(s * qf[:, None], axis=0).astype(dt)  # (S^T q)


def recurrent_step(cfg: ModelConfig, proj: Array, live: Array, conv_w: Array,
                   dt_bias: Array, a_log: Array, conv_state: Array, recurrent: Array, *,
                   interpret: bool | None = None, warps: int = 4, block_v: int = 32):
    """One token of each of B sequences: proj [B, C + Hv dv + 2 Hv] the stacked input projection (the raw qkv
    row, z, b, a; z is not read), live [B] int32 (0: a padding token),
    the layer's conv1d [C, K], dt_bias and A_log [Hv], conv_state [N, K-1, C], recurrent [N, Hv, dk, dv]
    float32 with N >= B -> (o [B, Hv, dv] before the gated norm, the conv state after the token [B, K-1, C]
    (a fresh buffer), the new recurrent state [N, ...]). Sequence i owns row i of both states; rows B..N-1 (the
    slots outside a decode bucket) are not read, and the recurrent ones stay as they are: that buffer is
    updated in place. interpret: run in Pallas interpret mode (default: on anything but a GPU); block_v: value
    columns per program (clipped to dv)."""
    return _recurrent_step(cfg, proj, live, conv_w, dt_bias, a_log, conv_state, recurrent,
                           interpret=not on_gpu() if interpret is None else interpret, warps=warps,
                           block_v=min(block_v, cfg.linear_value_head_dim))


@partial(jax.jit, static_argnames=("cfg", "interpret", "warps", "block_v"))
def _recurrent_step(cfg: ModelConfig, proj, live, conv_w, dt_bias, a_log, conv_state, recurrent,
                    *, interpret: bool, warps: int, block_v: int):
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if dv % block_v:
        raise ValueError(f"block_v {block_v} does not divide the value head dim {dv}")
    rows, width = proj.shape
    b_at = cfg.linear_conv_dim + hv * dv  # where b's columns start (then a's)
    if width != b_at + 2 * hv:
        raise ValueError(f"a projection row of {width} columns; the stacked in_proj gives {b_at + 2 * hv}")
    if min(conv_state.shape[0], recurrent.shape[0]) < rows:
        raise ValueError(f"states of {conv_state.shape[0]} and {recurrent.shape[0]} rows for {rows} sequences")
    kernel = partial(_kernel, hk=hk, hv=hv, dk=dk, bv=block_v, width=cfg.linear_conv_kernel_dim, b_at=b_at)

    def seq(shape):  # sequence i's block of a per-sequence array, its leading axis squeezed
        return pl.BlockSpec((None,) + shape, lambda i, h, c: (i,) + (0,) * len(shape))

    def whole(shape):  # a weight every program reads whole
        return pl.BlockSpec(shape, lambda i, h, c: (0,) * len(shape))

    conv_spec, rec_spec = seq(conv_state.shape[1:]), seq(recurrent.shape[1:])
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, hv, dv), proj.dtype),
                   jax.ShapeDtypeStruct((rows,) + conv_state.shape[1:], conv_state.dtype),
                   jax.ShapeDtypeStruct(recurrent.shape, recurrent.dtype)),
        grid=(rows, hv, dv // block_v),
        in_specs=[seq((1, width)), seq((1,)), whole(conv_w.shape), whole(dt_bias.shape), whole(a_log.shape),
                  conv_spec, rec_spec],
        out_specs=(seq((hv, dv)), conv_spec, rec_spec),
        input_output_aliases={6: 2},
        compiler_params=compiler_params(interpret, warps),
        interpret=interpret, name="gdn_decode",
    )(proj[:, None], live[:, None], conv_w, dt_bias, a_log, conv_state, recurrent)
