"""A hyper-connection mix (jaxflash.model.hyper_connection.mix) for a few token rows, in two kernels (Pallas;
Triton backend on a GPU), where XLA spends six or seven.

For rows h [N, W] of the float32 residual (S streams of H side by side), norm weight n [W], the bottleneck
down [R, W] and up [W, R], and the injection weights inject [S, W]:
    xn = h * rstd_s * (1 + n)          rstd_s = rsqrt(mean over stream s of h^2 + eps)
    a = silu(down xn / S);   gates = sigmoid(up a);   x = mean over streams of gates * xn
    inj = 2 sigmoid(inject xn / S)
Since rstd_s is one number per stream, down xn = sum_s rstd_s down_s (h_s (1 + n_s)), where down_s holds
the columns of stream s. So:
  * the down kernel: program (i, s) computes P[:, s, rows i BR ...] = down_s (h_s (1 + n_s)) for BR rows of
    down, and program (0, s) also the sum of squares of h_s (the last row of programs does the same for
    inject). Each program reads its BR x H block of weights and one stream of h, independent of the others:
    R / BR x S programs keep the memory system busy, which one program per row block walking all streams
    (this kernel's first version) did not.
  * the up kernel: program j combines the partials (rstd, a, from L2), then computes x for columns
    [j BH, (j+1) BH) of a stream: for each stream s the gates of those columns (up's rows s H + j BH ...),
    times xn, summed over the streams; program 0 also writes inj.
Each weight byte is read once. Float32 throughout, as the model's own mix, which is the twin: the CPU path
and the tests' oracle (the tests run these kernels in interpret mode). Only the order of the float32 sums
differs from XLA's.
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


def takes(rows: int, width: int, streams: int, rank: int, block_r: int = 4, block_h: int = 8) -> bool:
    """Whether the kernels run a mix of `rows` float32 rows: few rows, power-of-two stream count, and
    blocks that tile the stream width and the rank (Triton blocks are powers of two)."""
    hidden = width // streams
    return (1 <= rows <= MAX_ROWS and streams & (streams - 1) == 0 and hidden * streams == width
            and rank % block_r == 0 and hidden % block_h == 0 and _pow2_divisor(hidden, _CHUNK) >= 16
            and _pow2_divisor(rank, _R_CHUNK) >= 8)


def _down_kernel(h_ref, norm_ref, down_ref, inject_ref, p_ref, ss_ref, pi_ref, *, rows: int, hidden: int,
                 block_r: int, chunk: int):
    f32 = jnp.float32
    i, s = pl.program_id(0), pl.program_id(1)
    n_down = pl.num_programs(0) - (1 if inject_ref is not None else 0)

    def partials(w_ref, r0, nr):
        """Per row: (w[r0:r0+nr] over stream s's columns . (h_s (1 + n_s)), sum of h_s^2)."""
        dots = [jnp.zeros((nr,), f32) for _ in range(rows)]
        ss = [jnp.zeros((), f32) for _ in range(rows)]
        for c in range(hidden // chunk):
            cols = pl.ds(s * hidden + c * chunk, chunk)
            w = w_ref[pl.ds(r0, nr), cols].astype(f32)  # [nr, chunk]
            g = 1.0 + norm_ref[cols].astype(f32)
            for n in range(rows):
                hv = h_ref[n, cols]
                ss[n] = ss[n] + jnp.sum(hv * hv)
                dots[n] = dots[n] + jnp.sum(w * (hv * g)[None, :], axis=1)
        return dots, ss

    @pl.when(i < n_down)
    def _():
        dots, ss = partials(down_ref, i * block_r, block_r)
        for n in range(rows):
            p_ref[n, s, pl.ds(i * block_r, block_r)] = dots[n]

        @pl.when(i == 0)
        def _():
            for n in range(rows):
                ss_ref[n, s] = ss[n]

    if inject_ref is not None:
        @pl.when(i == n_down)
        def _():
            dots, _ = partials(inject_ref, 0, inject_ref.shape[0])
            for n in range(rows):
                pi_ref[n, s, :] = dots[n]


def _up_kernel(h_ref, norm_ref, up_ref, p_ref, ss_ref, pi_ref, x_ref, inj_ref, *, rows: int, streams: int,
               hidden: int, rank: int, block_h: int, r_chunk: int, eps: float):
    f32 = jnp.float32
    j = pl.program_id(0)
    rstd = [[jax.lax.rsqrt(ss_ref[n, s] / hidden + eps) for s in range(streams)] for n in range(rows)]
    # a = silu(down xn / S) from the per-stream partials, one chunk of the rank at a time
    a = [[jax.nn.silu(sum(rstd[n][s] * p_ref[n, s, pl.ds(c * r_chunk, r_chunk)] for s in range(streams))
                      / streams) for c in range(rank // r_chunk)] for n in range(rows)]
    acc = [jnp.zeros((block_h,), f32) for _ in range(rows)]
    for s in range(streams):
        cols = pl.ds(s * hidden + j * block_h, block_h)
        logits = [jnp.zeros((block_h,), f32) for _ in range(rows)]
        for c in range(rank // r_chunk):
            w = up_ref[cols, pl.ds(c * r_chunk, r_chunk)].astype(f32)  # [block_h, r_chunk]
            for n in range(rows):
                logits[n] = logits[n] + jnp.sum(w * a[n][c][None, :], axis=1)
        g = 1.0 + norm_ref[cols].astype(f32)
        for n in range(rows):
            xn = h_ref[n, cols] * rstd[n][s] * g
            acc[n] = acc[n] + jax.nn.sigmoid(logits[n]) * xn
    for n in range(rows):
        x_ref[n, pl.ds(j * block_h, block_h)] = acc[n] / streams

    if inj_ref is not None:
        @pl.when(j == 0)
        def _():
            for n in range(rows):
                t = sum(rstd[n][s] * pi_ref[n, s, :] for s in range(streams))
                inj_ref[n, :] = 2.0 * jax.nn.sigmoid(t / streams)


def mix(h: Array, norm: Array, down: Array, up: Array, inject: Array | None, streams: int, eps: float, *,
        interpret: bool | None = None, block_r: int = 4, block_h: int = 8, warps: int = 4):
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
    down_kernel = partial(_down_kernel, rows=rows, hidden=hidden, block_r=block_r,
                          chunk=_pow2_divisor(hidden, _CHUNK))
    up_kernel = partial(_up_kernel, rows=rows, streams=streams, hidden=hidden, rank=rank, block_h=block_h,
                        r_chunk=_pow2_divisor(rank, _R_CHUNK), eps=eps)
    if not has_inject:  # the final mixer: no injection weights, no inj output
        def down_kernel(h_ref, norm_ref, down_ref, p_ref, ss_ref, _k=down_kernel):  # noqa: E306
            _k(h_ref, norm_ref, down_ref, None, p_ref, ss_ref, None)

        def up_kernel(h_ref, norm_ref, up_ref, p_ref, ss_ref, x_ref, _k=up_kernel):  # noqa: E306
            _k(h_ref, norm_ref, up_ref, p_ref, ss_ref, None, x_ref, None)
    # partials of down (per stream), sums of squares, partials of inject (input stream, output stream)
    outs = [jax.ShapeDtypeStruct((rows, streams, rank), f32), jax.ShapeDtypeStruct((rows, streams), f32)]
    outs += [jax.ShapeDtypeStruct((rows, streams, streams), f32)] if has_inject else []
    parts = pl.pallas_call(down_kernel, out_shape=tuple(outs), grid=(rank // block_r + has_inject, streams),
                           compiler_params=params, interpret=interpret, name="hc_mix_down")(
        h, norm, down, *([inject] if has_inject else []))
    outs = [jax.ShapeDtypeStruct((rows, hidden), f32)]
    outs += [jax.ShapeDtypeStruct((rows, streams), f32)] if has_inject else []
    got = pl.pallas_call(up_kernel, out_shape=tuple(outs), grid=(hidden // block_h,), compiler_params=params,
                         interpret=interpret, name="hc_mix_up")(h, norm, up, *parts)
    return got[0], (got[1] if has_inject else None)
