"""The recurrent part of a Gated DeltaNet decode step in one kernel per layer (Pallas; Triton backend on a GPU).

After the input projections (qkv, z, b, a: XLA matrix-vector products), one program per value head h does
what jaxflash.model.gated_deltanet does for one new token, where XLA spends about a dozen small kernels:
  * the causal depthwise conv over [conv state; the new row] of the head's columns (q and k of key head
    h // (Hv/Hk), v of head h), SiLU, and the conv state's shift by one row (a key head's columns are written
    by the first value head of its group only);
  * beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias), both 0 for a padding token, whose
    state then stays as it was;
  * the l2norm of q (times dk^-1/2) and of k, and the delta rule on the float32 state S [dk, dv], updated in
    place (the state buffers are aliased in and out):
        S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q;
  * the gated RMSNorm of o with z.
It rounds where the model rounds (the conv output and SiLU to the compute dtype, o before the norm). Its
pure-jnp twin is the model's own code, gated_deltanet on one token: the CPU path and the tests' oracle (the
tests run this kernel in interpret mode).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..config import ModelConfig
from . import on_gpu

Array = jax.Array
DTYPES = (jnp.bfloat16, jnp.float32)  # compute dtypes the kernel takes (the state is float32 for both)
_L2_EPS = 1e-6  # jaxflash.model.norms.l2norm's


def takes(cfg: ModelConfig, dtype) -> bool:
    """Whether the kernel can run this model: a supported dtype, power-of-two head sizes (Triton blocks)."""
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in (cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    return jnp.dtype(dtype) in DTYPES and pow2


def _kernel(qkv_ref, z_ref, b_ref, a_ref, live_ref, w_ref, dt_bias_ref, a_log_ref, norm_ref, conv_ref, rec_ref,
            o_ref, conv_out_ref, rec_out_ref, *, hk: int, hv: int, dk: int, dv: int, width: int, eps: float,
            gate: str):
    f32 = jnp.float32
    dt = o_ref.dtype
    h = pl.program_id(0)
    group = hv // hk
    j = h // group  # the key head this value head reads
    live = live_ref[0] > 0
    kd = hk * dk

    def conv(cols):
        """SiLU(conv) of columns `cols`, rounded as the model rounds, and the rows [state; new] it read."""
        rows = [conv_ref[r, cols] for r in range(width - 1)] + [qkv_ref[0, cols]]
        acc = rows[0].astype(f32) * w_ref[cols, 0].astype(f32)
        for r in range(1, width):
            acc = acc + rows[r].astype(f32) * w_ref[cols, r].astype(f32)
        c = acc.astype(dt).astype(f32)
        return (c * jax.nn.sigmoid(c)).astype(dt), rows

    def shift(cols, rows):  # the new conv state: the last width-1 rows (a padding token keeps the old ones)
        for r in range(width - 1):
            conv_out_ref[r, cols] = jnp.where(live, rows[r + 1], rows[r])

    q_cols = j * dk + jnp.arange(dk, dtype=jnp.int32)
    k_cols = kd + q_cols
    v_cols = 2 * kd + h * dv + jnp.arange(dv, dtype=jnp.int32)
    q, q_rows = conv(q_cols)
    k, k_rows = conv(k_cols)
    v, v_rows = conv(v_cols)
    shift(v_cols, v_rows)

    @pl.when(h % group == 0)
    def _():
        shift(q_cols, q_rows)
        shift(k_cols, k_rows)

    qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
    qf = qf * jax.lax.rsqrt(jnp.sum(qf * qf) + _L2_EPS) * (dk ** -0.5)
    kf = kf * jax.lax.rsqrt(jnp.sum(kf * kf) + _L2_EPS)
    beta = jax.nn.sigmoid(b_ref[h].astype(f32))
    g = -jnp.exp(a_log_ref[h].astype(f32)) * jax.nn.softplus(a_ref[h].astype(f32) + dt_bias_ref[h].astype(f32))
    beta = jnp.where(live, beta, 0.0)
    g = jnp.where(live, g, 0.0)

    s = rec_ref[h] * jnp.exp(g)  # [dk, dv]
    kv = jnp.sum(s * kf[:, None], axis=0)  # S^T k
    s = s + kf[:, None] * ((vf - kv) * beta)[None, :]
    o = jnp.sum(s * qf[:, None], axis=0)  # S^T q
    rec_out_ref[h] = s

    of = o.astype(dt).astype(f32)  # the gated RMSNorm (jaxflash.model.norms.rms_norm_gated)
    y = (of * jax.lax.rsqrt(jnp.mean(of * of) + eps)).astype(dt)
    y = (norm_ref[...].astype(dt) * y).astype(f32)
    zf = z_ref[h].astype(f32)
    act = jax.nn.sigmoid(zf) if gate == "sigmoid" else zf * jax.nn.sigmoid(zf)
    o_ref[h] = (y * act).astype(dt)


def _compiler_params(warps: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=warps, num_stages=1)


def recurrent_step(cfg: ModelConfig, qkv_raw: Array, z: Array, b: Array, a: Array, live: Array, conv_w: Array,
                   dt_bias: Array, a_log: Array, norm: Array, conv_state: Array, recurrent: Array, *,
                   interpret: bool | None = None, warps: int = 4):
    """One token of one sequence: qkv_raw [1, C], z [Hv, dv], b and a [Hv], live [1] int32 (0: a padding token),
    the layer's conv1d [C, K], dt_bias and A_log [Hv], norm [dv], conv_state [K-1, C], recurrent [Hv, dk, dv]
    float32 -> (o [Hv, dv] normed and gated, the new conv state, the new recurrent state). Batches: jax.vmap.
    interpret: run in Pallas interpret mode (default: on anything but a GPU)."""
    return _recurrent_step(cfg, qkv_raw, z, b, a, live, conv_w, dt_bias, a_log, norm, conv_state, recurrent,
                           interpret=not on_gpu() if interpret is None else interpret, warps=warps)


@partial(jax.jit, static_argnames=("cfg", "interpret", "warps"))
def _recurrent_step(cfg: ModelConfig, qkv_raw, z, b, a, live, conv_w, dt_bias, a_log, norm, conv_state, recurrent,
                    *, interpret: bool, warps: int):
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dt = qkv_raw.dtype
    kernel = partial(_kernel, hk=hk, hv=hv, dk=dk, dv=dv, width=cfg.linear_conv_kernel_dim,
                     eps=cfg.rms_norm_eps, gate=cfg.output_gate_type)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((hv, dv), dt), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(recurrent.shape, recurrent.dtype)),
        grid=(hv,),
        input_output_aliases={9: 1, 10: 2},
        compiler_params=None if interpret else _compiler_params(warps),
        interpret=interpret, name="gdn_decode",
    )(qkv_raw, z, b, a, live, conv_w, dt_bias, a_log, norm, conv_state, recurrent)
