"""The chunked form of the Gated DeltaNet recurrence (prefill) in three kernels per layer (Pallas; Triton
backend on a GPU).

jaxflash.model.gated_deltanet.chunk_gated_delta_rule cuts T tokens into chunks of C = 64. Within a chunk with
cumulative log-decay gam, Gam_ij = exp(gam_i - gam_j) (i >= j), A = strictly_lower((beta K) K^T * Gam):
    U = (I+A)^-1 (beta V),   Wd = (I+A)^-1 (beta K exp(gam)),
and over the chunks in order, with the state S [dk, dv]:
    v_new = U - Wd S;   O = (Q exp(gam)) S + ((Q K^T) * Gam) v_new;   S <- exp(gam_C) S + (K exp(gam_C - gam))^T v_new.
XLA runs that as batched float32 matmuls and a loop of about ten small kernels per chunk, each launched from
the host (a while loop is not captured in a CUDA graph): at 8192 tokens 128 loop steps per GDN layer. Here
only what must be sequential is:
  * prep, grid (value heads, chunks), every chunk at once: A, its inverse as the product
        (I + A)^-1 = (I - A)(I + A^2)(I + A^4) ... (I + A^(C/2))
    (A is strictly lower triangular, so A^C = 0 and the product is the whole series sum (-A)^j: log2(C) - 1
    squarings and as many products, all full-tile matmuls where a substitution would go row by row), U, Wd;
  * scan, grid (value heads, value column blocks), the chunks in order inside the kernel: the block S[:, cols]
    stays in registers; per chunk it stores S (the state before the chunk) and v_new, two matmuls. Columns
    of S, U and v_new are independent, so column blocks split a head over programs;
  * out, grid (value heads, chunks), every chunk at once: O from the stored states and v_new.
Matmuls take float32 inputs. On a GPU they run on the tensor cores in the precision of PRECISIONS that the
caller names: a bfloat16 model takes TF32 (measured 7e-4 of the largest value against float64 at full size,
below one bfloat16 rounding of the output, 3.9e-3), a float32 model TF32x3 (three TF32 products, float32's
accuracy). In interpret mode they compute in full float32. The pure-jnp twin is chunk_gated_delta_rule: the
CPU path and the tests' oracle.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import ModelConfig
from . import compiler_params, on_gpu

Array = jax.Array
CHUNK = 64  # jaxflash.model.gated_deltanet.CHUNK
DTYPES = (jnp.bfloat16, jnp.float32)  # model dtypes the kernels serve (they compute in float32 for both)
# Triton's input precisions of a float32 matmul: three TF32 products (about float32), one, or float32 FMAs
PRECISIONS = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
              "ieee": lax.DotAlgorithmPreset.F32_F32_F32}


def precision_for(dtype) -> str:
    """The matmul precision for a model of this dtype (see the module docstring)."""
    return "tf32" if jnp.dtype(dtype).itemsize < 4 else "tf32x3"


def takes(cfg: ModelConfig, dtype) -> bool:
    """Whether the kernels can run this model: a supported dtype, head sizes that are powers of two of at least
    16 (Triton's blocks and its smallest matmul tile)."""
    dims = (cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return jnp.dtype(dtype) in DTYPES and all(n >= 16 and n & (n - 1) == 0 for n in dims)


def _dot(a, b, contract: tuple[int, int], algo):
    """a times b over a's axis contract[0] and b's contract[1], float32 out."""
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())), precision=algo,
                           preferred_element_type=jnp.float32)


def _decay(gam, mask):
    """Gam_ij = exp(gam_i - gam_j) where mask, else 0 (masked before exp: above the diagonal it would overflow)."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, gam[:, None] - gam[None, :], 0.0)), 0.0)


def _prep_kernel(k_ref, v_ref, gam_ref, beta_ref, u_ref, w_ref, *, algo):
    k, v, gam, beta = k_ref[...], v_ref[...], gam_ref[...], beta_ref[...]
    c = k.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(row == col, 1.0, 0.0)
    kb = k * beta[:, None]
    a = _dot(kb, k, (1, 1), algo) * _decay(gam, row > col)
    inv, power, span = eye - a, a, 2  # inv = sum of (-A)^j for j < span
    while span < c:
        power = _dot(power, power, (1, 0), algo)  # A^span
        inv = _dot(inv, eye + power, (1, 0), algo)
        span *= 2
    u_ref[...] = _dot(inv, v * beta[:, None], (1, 0), algo)
    w_ref[...] = _dot(inv, kb * jnp.exp(gam)[:, None], (1, 0), algo)


def _scan_kernel(k_ref, u_ref, w_ref, gam_ref, s_ref, h_ref, vn_ref, s_out_ref, *, chunk: int, algo):
    c = chunk
    dk = k_ref.shape[1]
    last = lax.broadcasted_iota(jnp.int32, (c,), 0) == c - 1

    def step(i, s):
        t = pl.ds(pl.multiple_of(i * c, c), c)
        h_ref[pl.ds(pl.multiple_of(i * dk, dk), dk), :] = s  # the state before chunk i, for the output kernel
        k, u, w, gam = k_ref[t, :], u_ref[t, :], w_ref[t, :], gam_ref[t]
        g_end = jnp.sum(jnp.where(last, gam, 0.0))  # gam_C
        v_new = u - _dot(w, s, (1, 0), algo)
        vn_ref[t, :] = v_new
        kd = k * jnp.exp(g_end - gam)[:, None]
        return s * jnp.exp(g_end) + _dot(kd, v_new, (0, 0), algo)

    s_out_ref[...] = lax.fori_loop(0, k_ref.shape[0] // c, step, s_ref[...])


def _out_kernel(q_ref, k_ref, gam_ref, h_ref, vn_ref, o_ref, *, algo):
    q, k, gam = q_ref[...], k_ref[...], gam_ref[...]
    c = q.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    intra = _dot(q, k, (1, 1), algo) * _decay(gam, row >= col)
    o_ref[...] = _dot(q * jnp.exp(gam)[:, None], h_ref[...], (1, 0), algo) + _dot(intra, vn_ref[...], (1, 0), algo)


def chunk_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array, *,
               interpret: bool | None = None, precision: str = "tf32x3", block_v: int = 64,
               warps: tuple[int, int, int] = (4, 4, 4), stages: int = 2) -> tuple[Array, Array]:
    """The chunked recurrence of one sequence: q, k [T, Hk, dk] (l2-normed, q scaled; value head h reads key head
    h // (Hv/Hk)), v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv], all float32 -> (o [T, Hv, dv], the new
    state). What chunk_gated_delta_rule computes from q and k repeated over the value heads. interpret: Pallas
    interpret mode (default: on anything but a GPU; it computes in full float32 whatever `precision`);
    precision: a key of PRECISIONS (precision_for gives the model's); block_v: value columns per scan program
    (clipped to dv); warps: (prep, scan, out) warps per program."""
    return _chunk_rule(q, k, v, g, beta, state, interpret=not on_gpu() if interpret is None else interpret,
                       precision=precision, block_v=min(block_v, v.shape[-1]), warps=warps, stages=stages)


@partial(jax.jit, static_argnames=("interpret", "precision", "block_v", "warps", "stages"))
def _chunk_rule(q, k, v, g, beta, state, *, interpret: bool, precision: str, block_v: int,
                warps: tuple[int, int, int], stages: int):
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if dv % block_v or hv % hk:
        raise ValueError(f"block_v {block_v} must divide dv {dv}, and Hk {hk} must divide Hv {hv}")
    group = hv // hk
    algo = lax.Precision.HIGHEST if interpret else PRECISIONS[precision]
    c = CHUNK
    pad = (-t) % c
    if pad:  # zero g, beta, k, v: padded steps leave the state untouched
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    n = (t + pad) // c
    gam = jnp.cumsum(g.reshape(n, c, hv), axis=1).reshape(n * c, hv).T  # [Hv, T], per chunk
    beta = beta.T
    f32 = jnp.float32

    u, w = pl.pallas_call(
        partial(_prep_kernel, algo=algo),
        out_shape=(jax.ShapeDtypeStruct((hv, n * c, dv), f32), jax.ShapeDtypeStruct((hv, n * c, dk), f32)),
        grid=(hv, n),
        in_specs=[pl.BlockSpec((c, None, dk), lambda h, i: (i, h // group, 0)),
                  pl.BlockSpec((c, None, dv), lambda h, i: (i, h, 0)),
                  pl.BlockSpec((None, c), lambda h, i: (h, i)),
                  pl.BlockSpec((None, c), lambda h, i: (h, i))],
        out_specs=(pl.BlockSpec((None, c, dv), lambda h, i: (h, i, 0)),
                   pl.BlockSpec((None, c, dk), lambda h, i: (h, i, 0))),
        compiler_params=compiler_params(interpret, warps[0]),
        interpret=interpret, name="gdn_chunk_prep",
    )(k, v, gam, beta)

    whole = n * c
    state_spec = pl.BlockSpec((None, dk, block_v), lambda h, j: (h, 0, j))
    h_states, v_new, state = pl.pallas_call(
        partial(_scan_kernel, chunk=c, algo=algo),
        out_shape=(jax.ShapeDtypeStruct((hv, n * dk, dv), f32), jax.ShapeDtypeStruct((hv, whole, dv), f32),
                   jax.ShapeDtypeStruct(state.shape, f32)),
        grid=(hv, dv // block_v),
        in_specs=[pl.BlockSpec((whole, None, dk), lambda h, j: (0, h // group, 0)),
                  pl.BlockSpec((None, whole, block_v), lambda h, j: (h, 0, j)),
                  pl.BlockSpec((None, whole, dk), lambda h, j: (h, 0, 0)),
                  pl.BlockSpec((None, whole), lambda h, j: (h, 0)),
                  state_spec],
        out_specs=(pl.BlockSpec((None, n * dk, block_v), lambda h, j: (h, 0, j)),
                   pl.BlockSpec((None, whole, block_v), lambda h, j: (h, 0, j)), state_spec),
        input_output_aliases={4: 2},
        compiler_params=compiler_params(interpret, warps[1], stages),
        interpret=interpret, name="gdn_chunk_scan",
    )(k, u, w, gam, state.astype(f32))

    o = pl.pallas_call(
        partial(_out_kernel, algo=algo),
        out_shape=jax.ShapeDtypeStruct((whole, hv, dv), f32),
        grid=(hv, n),
        in_specs=[pl.BlockSpec((c, None, dk), lambda h, i: (i, h // group, 0)),
                  pl.BlockSpec((c, None, dk), lambda h, i: (i, h // group, 0)),
                  pl.BlockSpec((None, c), lambda h, i: (h, i)),
                  pl.BlockSpec((None, dk, dv), lambda h, i: (h, i, 0)),
                  pl.BlockSpec((None, c, dv), lambda h, i: (h, i, 0))],
        out_specs=pl.BlockSpec((c, None, dv), lambda h, i: (i, h, 0)),
        compiler_params=compiler_params(interpret, warps[2]),
        interpret=interpret, name="gdn_chunk_out",
    )(q, k, gam, h_states, v_new)
    return o[:t], state
