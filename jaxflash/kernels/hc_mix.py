"""A hyper-connection mix (jaxflash.model.hyper_connection.mix) for a few token rows, in two kernels (Pallas;
Triton backend on a GPU), where XLA spends five or six.

For rows h [N, W] of the float32 residual (S streams of H side by side), norm weight n [W], the bottleneck
down [R, W] and up [W, R], and the injection weights inject [S, W]:
    xn = h * rstd_s * (1 + n)          rstd_s = rsqrt(mean over stream s of h^2 + eps)
    a = silu(down xn / S);   gates = sigmoid(up a);   x = mean over streams of gates * xn
    inj = 2 sigmoid(inject xn / S)
  * the down kernel: program i < R / BR computes a for rows [i BR, (i+1) BR) of down (the last program, inj).
    Since rstd_s is one number per stream, down xn = sum_s rstd_s (down_s (h (1 + n)))_s: one pass over
    h and the weights accumulates the per-stream partial products and sums of squares together. Every program
    also has the rows' rstd, which program 0 writes out for the next kernel.
  * the up kernel: program j computes x for columns [j BH, (j+1) BH) of a stream: for each stream s the
    gates of those columns (up's rows s H + j BH ...), times xn, summed over the streams.
Each weight byte is read once; h (a few KB a row) is read by every program, from L2. Float32 throughout, as
the model's own mix, which is the twin: the CPU path and the tests' oracle (the tests run these kernels in
interpret mode). Only the order of the float32 sums differs from XLA's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import compiler_params, on_gpu

Array = jax.Array
MAX_ROWS = 8  # token rows the kernels take (the rows are unrolled in the program); more rows take XLA's mix
_CHUNK = 512  # weight columns (of a stream) per step of the down kernel, at most
_R_CHUNK = 64  # bottleneck columns per step of the up kernel, at most


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def takes(rows: int, width: int, streams: int, rank: int, block_r: int = 4, block_h: int = 32) -> bool:
    """Whether the kernels run a mix of `rows` float32 rows: few rows, power-of-two stream count, and
    blocks that tile the stream width and the rank (Triton blocks are powers of two)."""
    hidden = width // streams
    return (1 <= rows <= MAX_ROWS and streams & (streams - 1) == 0 and hidden * streams == width
            and rank % block_r == 0 and hidden % block_h == 0 and _pow2_divisor(hidden, _CHUNK) >= 16
            and _pow2_divisor(rank, _R_CHUNK) >= 8)


def _down_kernel(h_ref, norm_ref, down_ref, inject_ref, a_ref, rstd_ref, inj_ref, *, rows: int, streams: int,
                 hidden: int, block_r: int, chunk: int, eps: float):
    f32 = jnp.float32
    i = pl.program_id(0)
    n_down = pl.num_programs(0) - (1 if inject_ref is not None else 0)

    def partials(w_ref, r0, nr):
        """Per row and stream: (sum of h^2, w[r0:r0+nr] . (h (1 + n)) over the stream's columns)."""
        ss = [[jnp.zeros((), f32) for _ in range(streams)] for _ in range(rows)]
        dots = [[jnp.zeros((nr,), f32) for _ in range(streams)] for _ in range(rows)]
        for s in range(streams):
            for c in range(hidden // chunk):
                cols = pl.ds(s * hidden + c * chunk, chunk)
                w = w_ref[pl.ds(r0, nr), cols].astype(f32)  # [nr, chunk]
                g = 1.0 + norm_ref[cols].astype(f32)
                for n in range(rows):
                    hv = h_ref[n, cols]
                    ss[n][s] = ss[n][s] + jnp.sum(hv * hv)
                    dots[n][s] = dots[n][s] + jnp.sum(w * (hv * g)[None, :], axis=1)
        rstd = [[jax.lax.rsqrt(ss[n][s] / hidden + eps) for s in range(streams)] for n in range(rows)]
        out = [sum(rstd[n][s] * dots[n][s] for s in range(streams)) / streams for n in range(rows)]
        return rstd, out

    @pl.when(i < n_down)
    def _():
        rstd, out = partials(down_ref, i * block_r, block_r)
        for n in range(rows):
            a_ref[n, pl.ds(i * block_r, block_r)] = jax.nn.silu(out[n])

        @pl.when(i == 0)
        def _():
            for n in range(rows):
                for s in range(streams):
                    rstd_ref[n, s] = rstd[n][s]

    if inject_ref is not None:
        @pl.when(i == n_down)
        def _():
            _, out = partials(inject_ref, 0, streams)
            for n in range(rows):
                inj_ref[n, :] = 2.0 * jax.nn.sigmoid(out[n])


def _up_kernel(h_ref, norm_ref, up_ref, a_ref, rstd_ref, x_ref, *, rows: int, streams: int, hidden: int,
               rank: int, block_h: int, r_chunk: int):
    f32 = jnp.float32
    j = pl.program_id(0)
    acc = [jnp.zeros((block_h,), f32) for _ in range(rows)]
    for s in range(streams):
        cols = pl.ds(s * hidden + j * block_h, block_h)
        logits = [jnp.zeros((block_h,), f32) for _ in range(rows)]
        for c in range(rank // r_chunk):
            w = up_ref[cols, pl.ds(c * r_chunk, r_chunk)].astype(f32)  # [block_h, r_chunk]
            for n in range(rows):
                logits[n] = logits[n] + jnp.sum(w * a_ref[n, pl.ds(c * r_chunk, r_chunk)][None, :], axis=1)
        g = 1.0 + norm_ref[cols].astype(f32)
        for n in range(rows):
            xn = h_ref[n, cols] * rstd_ref[n, s] * g
            acc[n] = acc[n] + jax.nn.sigmoid(logits[n]) * xn
    for n in range(rows):
        x_ref[n, pl.ds(j * block_h, block_h)] = acc[n] / streams


def mix(h: Array, norm: Array, down: Array, up: Array, inject: Array | None, streams: int, eps: float, *,
        interpret: bool | None = None, block_r: int = 4, block_h: int = 32, warps: int = 4):
    """hyper_connection.mix for h [N, W] float32 (N <= MAX_ROWS; see `takes`) -> (x [N, W / streams] float32,
    inj [N, streams] float32 or None without injection weights). interpret: run in Pallas interpret mode
    (default: on anything but a GPU)."""
    return _mix(h, norm, down, up, inject, streams=streams, eps=eps,
                interpret=not on_gpu() if interpret is None else interpret, block_r=block_r, block_h=block_h,
                warps=warps)


@partial(jax.jit, static_argnames=("streams", "eps", "interpret", "block_r", "block_h", "warps"))
def _mix(h, norm, down, up, inject, *, streams: int, eps: float, interpret: bool, block_r: int, block_h: int,
         warps: int):
    rows, width = h.shape
    rank = down.shape[0]
    hidden = width // streams
    if h.dtype != jnp.float32 or not takes(rows, width, streams, rank, block_r, block_h):
        raise ValueError(f"hc_mix takes float32 rows [<= {MAX_ROWS}, S*H] with power-of-two tiles; got "
                         f"{h.dtype}{list(h.shape)}, {streams} streams, rank {rank}")
    params = compiler_params(interpret, warps)
    f32 = jnp.float32
    has_inject = inject is not None
    down_kernel = partial(_down_kernel, rows=rows, streams=streams, hidden=hidden, block_r=block_r,
                          chunk=_pow2_divisor(hidden, _CHUNK), eps=eps)
    if not has_inject:  # the final mixer: no injection weights, no inj output
        def down_kernel(h_ref, norm_ref, down_ref, a_ref, rstd_ref, _k=down_kernel):  # noqa: E306
            _k(h_ref, norm_ref, down_ref, None, a_ref, rstd_ref, None)
    outs = [jax.ShapeDtypeStruct((rows, rank), f32), jax.ShapeDtypeStruct((rows, streams), f32)]
    outs += [jax.ShapeDtypeStruct((rows, streams), f32)] if has_inject else []
    got = pl.pallas_call(down_kernel, out_shape=tuple(outs), grid=(rank // block_r + has_inject,),
                         compiler_params=params, interpret=interpret, name="hc_mix_down")(
        h, norm, down, *([inject] if has_inject else []))
    a, rstd = got[0], got[1]
    x = pl.pallas_call(
        partial(_up_kernel, rows=rows, streams=streams, hidden=hidden, rank=rank, block_h=block_h,
                r_chunk=_pow2_divisor(rank, _R_CHUNK)),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), f32), grid=(hidden // block_h,),
        compiler_params=params, interpret=interpret, name="hc_mix_up")(h, norm, up, a, rstd)
    return x, (got[2] if has_inject else None)
