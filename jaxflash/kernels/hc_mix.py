"""A hyper-connection mix (jaxflash.model.hyper_connection.mix) for a few token rows in two kernels (Pallas;
Triton backend on a GPU; three from GATES_FROM_ROWS rows), where XLA spends six or seven; optionally with the
combine that precedes it (hyper_connection.combine_mix), which XLA runs as one more kernel.

For rows h [N, W] of the float32 residual (S streams of H side by side), norm weight n [W], the bottleneck
down [R, W] and up [W, R], and the injection weights inject [S, W]:
    xn = h * rstd_s * (1 + n)          rstd_s = rsqrt(mean over stream s of h^2 + eps)
    a = silu(down xn / S);   gates = sigmoid(up a);   x = mean over streams of gates * xn
    inj = 2 sigmoid(inject xn / S)
With a pending combine (inj0 [N, S], y [N, H]), h is first h + inj0[:, s] * y on stream s, and is returned; y
may come as a MoE block's parts (routed [N, H] float32, shared [N, H], gate [N, 1]: y = routed + gate * shared
rounded to shared's dtype, moe.MoEOutput), summed where they are read.
Since rstd_s is one number per stream, down xn = sum_s rstd_s down_s (h_s (1 + n_s)), where down_s holds
the columns of stream s. So:
  * the down kernel: program (i, c) computes the partial product of rows i BR ... of down with split c of
    the columns (split c lies in stream c // splits): P[:, c, rows] = down[rows, cols] (h (1 + n))[cols], and
    the sums of squares of h over those columns; the last row of programs does the same for inject, and with
    a pending combine the first row writes the combined h. Every program reads its own block of weights.
  * the up kernel: program j combines the partials (rstd, a, from L2), then computes x for columns
    [j BH, (j+1) BH) of a stream: for each stream s the gates of those columns (up's rows s H + j BH ...),
    times xn, summed over the streams; program 0 also writes inj.
  * from GATES_FROM_ROWS rows on, a third kernel between them (hc_mix_gates, a program per row) combines the
    partials into rstd, a and inj once, and the up programs (GATED_UP_WARPS warps) read those. Up programs that
    each combined rows x parts x R partials themselves (12,800 floats at 8 rows of 5 splits) beside their
    weights spilled to local memory: 6,606 local loads and stores per program at 8 rows, 30 at 4 (offline
    compile, benchmarks/kernel_sass.py --kernels hc); now none.
A program's weight loads do not depend on each other: it accumulates elementwise products in registers and
reduces them once at the end (a reduction per load, as the first versions did, serialises the loads behind
barriers: 0.66 TB/s). Each weight byte is read once. Float32 throughout, as the model's own mix, which is the
twin: the CPU path and the tests' oracle (the tests run these kernels in interpret mode). Only the order of
the float32 sums differs from XLA's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import compiler_params, on_gpu, pow2_divisor

Array = jax.Array
MAX_ROWS = 8  # token rows the kernels take (the rows are unrolled in the program); more rows take XLA's mix
_CHUNK = 512  # weight columns (of a stream) per load of the down kernel, at most
_ACC_PER_THREAD = 32  # float32 accumulators per thread in the down kernel (its chunks shrink with more rows)
# Token rows up to which the kernels beat XLA's mix (benchmarks/RESULTS.md; one mix with its combine inside the
# kernels: 1 row 9.2 us against XLA's 13.6 on the H200; 2 rows 12.6 against 20.9 on an H100, where 4 rows took
# 24.2 against 21.7). The engine runs them for steps of at most this many rows: decode at batch 2, and the verify
# step of one sequence with one draft.
FASTER_ROWS = 2
# Tiles measured best on the H200 at one row (benchmarks/hc_kernel.py, 15 variants): rows of down per program,
# columns per program of the up kernel, warps of the down kernel, splits of a stream's columns in the down
# kernel, warps of the up kernel (2 rather than the down kernel's 4: 9.2 us per mix against 10.9).
# R_PIECE: bottleneck columns per load of the up kernel, at most (the rank is read in power-of-two pieces).
BLOCK_R, BLOCK_H, WARPS, SPLITS, UP_WARPS, R_PIECE = 4, 8, 4, 1, 2, 64
# A down program holds its residual rows [rows, its columns] in registers. From SPLIT_FROM_ROWS rows on, a
# stream's columns are split over up to ROWS_SPLITS programs, so that 8 rows of 512 columns take 32 registers a
# thread. On an H100 at 4 rows: 24.2 us per mix against 32.4 for whole streams; at 2 rows 13.1 against 12.6.
SPLIT_FROM_ROWS, ROWS_SPLITS = 3, 5
GATES_FROM_ROWS = 3  # from this many rows, hc_mix_gates combines the partials once (see the module docstring)
# Warps of the up kernel from GATES_FROM_ROWS rows: its weights and rows of a then span 128 threads, so that 4 and
# 8 rows compile without local memory (2 warps spill at 4 rows and 8; kernel_sass.py --kernels hc, offline).
GATED_UP_WARPS = 4


def up_warps_for(rows: int) -> int:
    """The default warps of the up kernel for a mix of `rows` rows."""
    return GATED_UP_WARPS if rows >= GATES_FROM_ROWS else UP_WARPS


def row_splits(rows: int, hidden: int, block_r: int = BLOCK_R, warps: int = WARPS) -> int:
    """The default column splits per stream for a mix of `rows` rows of streams `hidden` wide: SPLITS below
    SPLIT_FROM_ROWS rows; from there, the most up to ROWS_SPLITS that divide the stream's chunks."""
    if rows < SPLIT_FROM_ROWS:
        return SPLITS
    chunks = hidden // _chunk(hidden, rows, block_r, warps)
    return max(d for d in range(1, ROWS_SPLITS + 1) if chunks % d == 0)


def _pieces(n: int, cap: int) -> tuple[tuple[int, int], ...]:
    """[0, n) as (start, size) runs whose sizes are powers of two <= cap, largest first."""
    out, at = [], 0
    while at < n:
        size = min(cap, 1 << ((n - at).bit_length() - 1))
        out.append((at, size))
        at += size
    return tuple(out)


def _chunk(hidden: int, rows: int, block_r: int, warps: int) -> int:
    """Columns per load of the down kernel: a power of two dividing the stream width, at most _CHUNK, and small
    enough that the rows' accumulators [block_r, chunk] stay in registers."""
    cap = _ACC_PER_THREAD * 32 * warps // (rows * block_r)
    return pow2_divisor(hidden, max(16, min(_CHUNK, cap)))


def takes(rows: int, width: int, streams: int, rank: int, block_r: int = BLOCK_R, block_h: int = BLOCK_H,
          splits: int | None = None, warps: int = WARPS) -> bool:
    """Whether the kernels run a mix of `rows` float32 rows: few rows, power-of-two stream count, and
    blocks that tile the stream width and the rank (Triton blocks are powers of two). splits: default
    row_splits."""
    hidden = width // streams
    chunk = _chunk(hidden, max(rows, 1), block_r, warps)
    splits = row_splits(rows, hidden, block_r, warps) if splits is None else splits
    return (1 <= rows <= MAX_ROWS and streams & (streams - 1) == 0 and hidden * streams == width
            and rank % block_r == 0 and hidden % block_h == 0 and chunk >= 16 and (hidden // chunk) % splits == 0
            and rank % 8 == 0)


def _down_kernel(h_ref, inj0_ref, y_refs, norm_ref, down_ref, inject_ref, p_ref, ss_ref, pi_ref, hout_ref, *,
                 rows: int, hidden: int, block_r: int, chunk: int, splits: int):
    f32 = jnp.float32
    i, c = pl.program_id(0), pl.program_id(1)
    s = c // splits
    n_down = down_ref.shape[0] // block_r  # programs of down's rows; the next one (if any) takes inject's
    loads = hidden // chunk // splits
    first = s * hidden + (c % splits) * (loads * chunk)  # this split's first column

    def residual(n, k):
        """Row n of h over the split's k-th chunk of columns, after the pending combine (written out once)."""
        hv = h_ref[n, pl.ds(first + k * chunk, chunk)]
        if y_refs is None:
            return hv
        at = pl.ds(first - s * hidden + k * chunk, chunk)
        if len(y_refs) == 1:
            y = y_refs[0][n, at].astype(f32)
        else:  # a MoE block's output by parts: moe.MoEOutput.total
            routed, shared, gate = y_refs
            y = (routed[n, at] + gate[n, 0] * shared[n, at].astype(f32)).astype(shared.dtype).astype(f32)
        hv = hv + inj0_ref[n, s] * y

        @pl.when(i == 0)
        def _():
            hout_ref[n, pl.ds(first + k * chunk, chunk)] = hv
        return hv

    def partials(w_ref, r0, nr):
        """Per row: (w[r0:r0+nr] over the split's columns . (h (1 + n)), sum of h^2 over them). Every load is
        issued before the arithmetic, so that their latencies overlap."""
        cols = [pl.ds(first + k * chunk, chunk) for k in range(loads)]
        ws = [w_ref[pl.ds(r0, nr), c] for c in cols]  # [nr, chunk] each
        gs = [norm_ref[c] for c in cols]
        hs = [[residual(n, k) for k in range(loads)] for n in range(rows)]
        acc = [jnp.zeros((nr, chunk), f32) for _ in range(rows)]
        sq = [jnp.zeros((chunk,), f32) for _ in range(rows)]
        for k in range(loads):
            w, g = ws[k].astype(f32), 1.0 + gs[k].astype(f32)
            for n in range(rows):
                hv = hs[n][k]
                sq[n] = sq[n] + hv * hv
                acc[n] = acc[n] + w * (hv * g)[None, :]
        return [jnp.sum(a, axis=1) for a in acc], [jnp.sum(q) for q in sq]

    @pl.when(i < n_down)
    def _():
        dots, ss = partials(down_ref, i * block_r, block_r)
        for n in range(rows):
            p_ref[n, c, pl.ds(i * block_r, block_r)] = dots[n]

        @pl.when(i == 0)
        def _():
            for n in range(rows):
                ss_ref[n, c] = ss[n]

    if inject_ref is not None:
        @pl.when(i == n_down)
        def _():
            dots, _ = partials(inject_ref, 0, inject_ref.shape[0])
            for n in range(rows):
                pi_ref[n, c, :] = dots[n]


def _over_splits(ref, n, s, splits: int, idx=()):
    """Stream s's partials of row n, summed over the stream's splits."""
    return sum(ref[(n, s * splits + k) + idx] for k in range(splits))


def _rstd_a(p_ref, ss_ref, n, *, streams: int, hidden: int, pieces, splits: int, eps: float):
    """Row n's per-stream rstd and a = silu(down xn / S) (one piece of the rank at a time) from the partials."""
    rstd = [jax.lax.rsqrt(_over_splits(ss_ref, n, s, splits) / hidden + eps) for s in range(streams)]
    a = [jax.nn.silu(sum(rstd[s] * _over_splits(p_ref, n, s, splits, (pl.ds(r0, size),))
                         for s in range(streams)) / streams) for r0, size in pieces]
    return rstd, a


def _injection(pi_ref, rstd, n, *, streams: int, splits: int):
    """Row n's injection weights 2 sigmoid(inject xn / S) [S] from the partials."""
    t = sum(rstd[s] * _over_splits(pi_ref, n, s, splits, (slice(None),)) for s in range(streams))
    return 2.0 * jax.nn.sigmoid(t / streams)


def _gates_kernel(p_ref, ss_ref, pi_ref, a_ref, rstd_ref, inj_ref, *, streams: int, hidden: int,
                  pieces: tuple[tuple[int, int], ...], splits: int, eps: float):
    """Program n: row n's rstd [S], a [R] and inj [S], for the up programs to read."""
    n = pl.program_id(0)
    rstd, a = _rstd_a(p_ref, ss_ref, n, streams=streams, hidden=hidden, pieces=pieces, splits=splits, eps=eps)
    for (r0, size), v in zip(pieces, a):
        a_ref[n, pl.ds(r0, size)] = v
    for s in range(streams):
        rstd_ref[n, s] = rstd[s]
    if inj_ref is not None:
        inj_ref[n, :] = _injection(pi_ref, rstd, n, streams=streams, splits=splits)


def _up_kernel(h_ref, norm_ref, up_ref, p_ref, ss_ref, pi_ref, x_ref, inj_ref, *, rows: int, streams: int,
               hidden: int, block_h: int, pieces: tuple[tuple[int, int], ...], splits: int, eps: float,
               gated: bool = False):
    """gated: p_ref and ss_ref hold hc_mix_gates' a [N, R] and rstd [N, S] (pi_ref, inj_ref unused)."""
    f32 = jnp.float32
    j = pl.program_id(0)

    # The weights first (they do not depend on the partials, whose loads and arithmetic then overlap theirs).
    cols = [pl.ds(s * hidden + j * block_h, block_h) for s in range(streams)]
    ws = [[up_ref[cols[s], pl.ds(r0, size)] for r0, size in pieces] for s in range(streams)]
    gs = [norm_ref[c] for c in cols]
    hs = [[h_ref[n, c] for c in cols] for n in range(rows)]

    if gated:
        rstd = [[ss_ref[n, s] for s in range(streams)] for n in range(rows)]
        a = [[p_ref[n, pl.ds(r0, size)] for r0, size in pieces] for n in range(rows)]
    else:
        rstd, a = zip(*(_rstd_a(p_ref, ss_ref, n, streams=streams, hidden=hidden, pieces=pieces, splits=splits,
                                eps=eps) for n in range(rows)))
    out = [jnp.zeros((block_h,), f32) for _ in range(rows)]
    for s in range(streams):
        acc = [{} for _ in range(rows)]  # per row, an accumulator per piece size
        for k, (_, size) in enumerate(pieces):
            w = ws[s][k].astype(f32)  # [block_h, size]
            for n in range(rows):
                acc[n][size] = acc[n].get(size, jnp.zeros((block_h, size), f32)) + w * a[n][k][None, :]
        g = 1.0 + gs[s].astype(f32)
        for n in range(rows):
            xn = hs[n][s] * rstd[n][s] * g
            dot = sum(jnp.sum(t, axis=1) for t in acc[n].values())
            out[n] = out[n] + jax.nn.sigmoid(dot) * xn
    for n in range(rows):
        x_ref[n, pl.ds(j * block_h, block_h)] = (out[n] / streams).astype(x_ref.dtype)

    if inj_ref is not None:  # (None when gated: hc_mix_gates wrote inj)
        @pl.when(j == 0)
        def _():
            for n in range(rows):
                inj_ref[n, :] = _injection(pi_ref, rstd[n], n, streams=streams, splits=splits)


def mix(h: Array, norm: Array, down: Array, up: Array, inject: Array | None, streams: int, eps: float, *,
        pending: tuple[Array, Array] | None = None, x_dtype=jnp.float32, interpret: bool | None = None,
        block_r: int = BLOCK_R, block_h: int = BLOCK_H, warps: int = WARPS, splits: int | None = None,
        up_warps: int | None = None, r_piece: int = R_PIECE):
    """hyper_connection.mix for h [N, W] float32 (N <= MAX_ROWS; see `takes`) -> (x [N, W / streams] in x_dtype
    (computed in float32, rounded once as it is written: the block's input dtype saves XLA a conversion kernel),
    inj [N, streams] float32 or None without injection weights, h). pending: (inj0 [N, S], y [N, H]) or
    (inj0, routed, shared, gate) (y by its parts, see the module docstring), a combine to apply to h first
    (hyper_connection.combine); the returned h is then the combined one, else h itself. splits: default
    row_splits; up_warps: default up_warps_for. interpret: run in Pallas interpret mode (default: on anything
    but a GPU)."""
    splits = row_splits(h.shape[0], h.shape[1] // streams, block_r, warps) if splits is None else splits
    up_warps = up_warps_for(h.shape[0]) if up_warps is None else up_warps
    return _mix(h, pending, norm, down, up, inject, streams=streams, eps=eps, x_dtype=jnp.dtype(x_dtype),
                interpret=not on_gpu() if interpret is None else interpret, block_r=block_r, block_h=block_h,
                warps=warps, splits=splits, up_warps=up_warps, r_piece=r_piece)


@partial(jax.jit, static_argnames=("streams", "eps", "x_dtype", "interpret", "block_r", "block_h", "warps",
                                   "splits", "up_warps", "r_piece"))
def _mix(h, pending, norm, down, up, inject, *, streams: int, eps: float, x_dtype, interpret: bool, block_r: int,
         block_h: int, warps: int, splits: int, up_warps: int, r_piece: int):
    rows, width = h.shape
    rank = down.shape[0]
    hidden = width // streams
    if h.dtype != jnp.float32 or not takes(rows, width, streams, rank, block_r, block_h, splits, warps):
        raise ValueError(f"hc_mix takes float32 rows [<= {MAX_ROWS}, S*H] with power-of-two tiles; got "
                         f"{h.dtype}{list(h.shape)}, {streams} streams, rank {rank}")
    if r_piece < 1 or r_piece & (r_piece - 1):  # the up kernel's loads are blocks of power-of-two width
        raise ValueError(f"hc_mix: r_piece must be a power of two, got {r_piece}")
    f32 = jnp.float32
    has_inject, fused = inject is not None, pending is not None
    n_y = len(pending) - 1 if fused else 0  # y, or a MoE output's three parts
    if fused and n_y not in (1, 3):
        raise ValueError(f"hc_mix: pending is (inj0, y) or (inj0, routed, shared, gate), got {len(pending)} arrays")
    down_kernel = partial(_down_kernel, rows=rows, hidden=hidden, block_r=block_r,
                          chunk=_chunk(hidden, rows, block_r, warps), splits=splits)
    gated = rows >= GATES_FROM_ROWS
    up_injects = has_inject and not gated  # the up kernel takes the injection's partials and writes inj
    pieces = _pieces(rank, r_piece)
    up_kernel = partial(_up_kernel, rows=rows, streams=streams, hidden=hidden, block_h=block_h, pieces=pieces,
                        splits=splits, eps=eps, gated=gated)

    # Pallas passes refs positionally: inputs, then outputs. Absent ones (no pending combine, no injection
    # weights: the final mixer) are None in the kernels.
    def down_call(*refs):
        it = iter(refs)
        take = lambda present: next(it) if present else None  # noqa: E731
        h_ref, inj0 = next(it), take(fused)
        y = tuple(next(it) for _ in range(n_y)) if fused else None
        norm_ref, down_ref, inject_ref = next(it), next(it), take(has_inject)
        p, ss, pi, hout = next(it), next(it), take(has_inject), take(fused)
        down_kernel(h_ref, inj0, y, norm_ref, down_ref, inject_ref, p, ss, pi, hout)

    def up_call(*refs):
        it = iter(refs)
        take = lambda present: next(it) if present else None  # noqa: E731
        h_ref, norm_ref, up_ref, p, ss, pi = next(it), next(it), next(it), next(it), next(it), take(up_injects)
        up_kernel(h_ref, norm_ref, up_ref, p, ss, pi, next(it), take(up_injects))

    parts = streams * splits
    # partials of down (per split), sums of squares, partials of inject (split, output stream), combined h
    outs = [jax.ShapeDtypeStruct((rows, parts, rank), f32), jax.ShapeDtypeStruct((rows, parts), f32)]
    outs += [jax.ShapeDtypeStruct((rows, parts, streams), f32)] if has_inject else []
    outs += [jax.ShapeDtypeStruct((rows, width), f32)] if fused else []
    got = pl.pallas_call(down_call, out_shape=tuple(outs), grid=(rank // block_r + has_inject, parts),
                         compiler_params=compiler_params(interpret, warps), interpret=interpret, name="hc_mix_down")(
        h, *(pending if fused else ()), norm, down, *([inject] if has_inject else []))
    h = got[-1] if fused else h
    parts_out = got[:3] if has_inject else (*got[:2], None)
    inj = None
    if gated:  # a, rstd and inj once per row; the up programs read a and rstd in place of the partials
        def gates_call(p_ref, ss_ref, *refs):
            pi_ref, (a_ref, rstd_ref, inj_ref) = (refs[0], refs[1:]) if has_inject else (None, (*refs, None))
            _gates_kernel(p_ref, ss_ref, pi_ref, a_ref, rstd_ref, inj_ref, streams=streams, hidden=hidden,
                          pieces=pieces, splits=splits, eps=eps)

        outs = [jax.ShapeDtypeStruct((rows, rank), f32), jax.ShapeDtypeStruct((rows, streams), f32)]
        outs += [jax.ShapeDtypeStruct((rows, streams), f32)] if has_inject else []
        whole = lambda shape: pl.BlockSpec(shape, lambda n: (0,) * len(shape))  # noqa: E731
        gates = pl.pallas_call(
            gates_call, out_shape=tuple(outs), grid=(rows,),
            in_specs=[whole(p.shape) for p in parts_out if p is not None],
            out_specs=tuple(whole(o.shape) for o in outs),
            compiler_params=compiler_params(interpret, warps), interpret=interpret, name="hc_mix_gates",
        )(*(p for p in parts_out if p is not None))
        inj = gates[2] if has_inject else None
        parts_out = (gates[0], gates[1], None)
    outs = [jax.ShapeDtypeStruct((rows, hidden), x_dtype)]
    outs += [jax.ShapeDtypeStruct((rows, streams), f32)] if up_injects else []
    res = pl.pallas_call(up_call, out_shape=tuple(outs), grid=(hidden // block_h,),
                         compiler_params=compiler_params(interpret, up_warps), interpret=interpret, name="hc_mix_up")(
        h, norm, up, *(p for p in parts_out if p is not None))
    return res[0], (res[1] if up_injects else inj), h
