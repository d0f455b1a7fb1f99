#!/usr/bin/env python3
"""Where a hyper-connection mix's GPU time goes (jaxflash/kernels/hc_mix.py, issue 14): its two kernels against
versions of themselves that leave one stage out, and against two rearrangements of the same work.

  * kernels: hc_mix.mix as the decode step runs it (the previous combine inside the down kernel);
  * down-no-weights / up-no-weights: the kernel reads no weights (a constant stands for every weight load): the
    time its other loads, its arithmetic and its launch take;
  * up-no-partials: the up kernel reads constants for the down kernel's partials (no L2 loads of them, no
    per-program sum over the streams): what combining them costs;
  * mid: a third kernel (one program per row) combines the partials into a [N, R] and rstd [N, S] once; the up
    kernel then reads a row of a instead of S x splits rows of partials;
  * prefetch: the down kernel's grid gains programs that read the up weights (summing them into a value nobody
    uses), so that the up kernel finds them in L2.

Each runs M mixes with their combines chained in one jitted program, each mix its own weights, over N rows;
GPU kernel time per mix and per kernel from a profiler trace; the numerics of mid and prefetch against
hc_mix.mix (the ablations compute something else and print no error).

    python3 benchmarks/hc_probe.py --out $OUT                         # on the GPU
    python3 benchmarks/hc_probe.py --preset tiny --mixes 2 --reps 1   # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hc_kernel import random_mixes  # noqa: E402
from kernel_timing import COPY_CEILING, log, rel_err, trace_kernels_by_name, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


class Const:
    """Stands for a ref inside a kernel: indexing it gives a constant of the indexed shape and loads nothing."""

    def __init__(self, ref, value=0.5):
        self.shape, self.dtype, self.value = ref.shape, ref.dtype, value

    def __getitem__(self, idx):
        import jax.numpy as jnp
        from jax.experimental import pallas as pl

        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (len(self.shape) - len(idx))
        shape = [ix.size if isinstance(ix, pl.Slice) else d for d, ix in zip(self.shape, idx)
                 if isinstance(ix, (pl.Slice, slice))]
        return jnp.full(shape, self.value, self.dtype)


def probe_mix(h, pending, norm, down, up, inject, *, streams, eps, x_dtype, form, block_r, block_h, warps,
              prefetch_programs=80):
    """hc_mix._mix with the probe's forms (see the module docstring); splits = 1."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from jaxflash.kernels import compiler_params, hc_mix, on_gpu

    interpret = not on_gpu()
    rows, width = h.shape
    rank, hidden, f32 = down.shape[0], width // streams, jnp.float32
    r_chunk = min(64, rank)  # the up kernel's loads of the rank (hc_mix.R_PIECE when this probe ran on the H200)
    if rank % r_chunk:
        raise ValueError(f"the probe reads the rank in pieces of {r_chunk}: rank {rank} is not a multiple")
    params = compiler_params(interpret, warps)
    down_kernel = partial(hc_mix._down_kernel, rows=rows, hidden=hidden, block_r=block_r,
                          chunk=hc_mix._chunk(hidden, rows, block_r, warps), splits=1)
    up_kernel = partial(hc_mix._up_kernel, rows=rows, streams=streams, hidden=hidden, block_h=block_h,
                        pieces=hc_mix._pieces(rank, r_chunk), splits=1, eps=eps)
    n_main = rank // block_r + 1
    pf = min(prefetch_programs, width // streams) if form == "prefetch" else 0  # at least one row per slab
    slab = width // (pf * streams) if pf else 0

    def down_call(*refs):  # inputs, then outputs: h, inj0, y, norm, down, inject, [up], p, ss, pi, h, [sink]
        h_ref, inj0, y, norm_ref, down_ref, inject_ref = refs[:6]
        up_ref = refs[6] if pf else None
        p, ss, pi, hout = refs[6 + bool(pf):10 + bool(pf)]
        sink_ref = refs[-1] if pf else None
        if form == "down-no-weights":
            down_ref, inject_ref = Const(down_ref), Const(inject_ref)
        down_kernel(h_ref, inj0, y, norm_ref, down_ref, inject_ref, p, ss, pi, hout)  # nothing where i >= n_main
        if not pf:
            return
        i, c = pl.program_id(0), pl.program_id(1)

        @pl.when(i >= n_main)
        def _():  # read a slab of up's rows (all loads first), keep one number of it
            r0 = ((i - n_main) * streams + c) * slab
            ws = [up_ref[pl.ds(r0, slab), pl.ds(k * r_chunk, r_chunk)] for k in range(rank // r_chunk)]
            sink_ref[i - n_main, c] = sum((jnp.sum(w.astype(f32)) for w in ws), jnp.zeros((), f32))

    outs = [jax.ShapeDtypeStruct((rows, streams, rank), f32), jax.ShapeDtypeStruct((rows, streams), f32),
            jax.ShapeDtypeStruct((rows, streams, streams), f32), jax.ShapeDtypeStruct((rows, width), f32)]
    outs += [jax.ShapeDtypeStruct((pf, streams), f32)] if pf else []
    got = pl.pallas_call(down_call, out_shape=tuple(outs), grid=(n_main + pf, streams), compiler_params=params,
                         interpret=interpret, name="hc_mix_down")(h, *pending, norm, down, inject,
                                                                  *([up] if pf else []))
    p_out, ss_out, pi_out, h = got[:4]

    if form == "mid":
        def mid_call(p_ref, ss_ref, pi_ref, a_ref, rstd_ref, inj_ref):
            n = pl.program_id(0)
            rstd = [jax.lax.rsqrt(ss_ref[n, s] / hidden + eps) for s in range(streams)]
            for s in range(streams):
                rstd_ref[n, s] = rstd[s]
            for k in range(rank // r_chunk):
                cols = pl.ds(k * r_chunk, r_chunk)
                a_ref[n, cols] = jax.nn.silu(sum(rstd[s] * p_ref[n, s, cols] for s in range(streams)) / streams)
            t = sum(rstd[s] * pi_ref[n, s, :] for s in range(streams))
            inj_ref[n, :] = 2.0 * jax.nn.sigmoid(t / streams)

        a, rstd, inj = pl.pallas_call(
            mid_call, grid=(rows,), compiler_params=compiler_params(interpret, 1), interpret=interpret,
            name="hc_mix_mid", out_shape=(jax.ShapeDtypeStruct((rows, rank), f32),
                                          jax.ShapeDtypeStruct((rows, streams), f32),
                                          jax.ShapeDtypeStruct((rows, streams), f32)))(p_out, ss_out, pi_out)

        def up_mid(h_ref, norm_ref, up_ref, a_ref, rstd_ref, x_ref):
            j = pl.program_id(0)
            cols = [pl.ds(s * hidden + j * block_h, block_h) for s in range(streams)]
            ws = [[up_ref[cols[s], pl.ds(k * r_chunk, r_chunk)] for k in range(rank // r_chunk)]
                  for s in range(streams)]
            gs = [norm_ref[c] for c in cols]
            hs = [[h_ref[n, c] for c in cols] for n in range(rows)]
            a = [[a_ref[n, pl.ds(k * r_chunk, r_chunk)] for k in range(rank // r_chunk)] for n in range(rows)]
            out = [jnp.zeros((block_h,), f32) for _ in range(rows)]
            for s in range(streams):
                acc = [jnp.zeros((block_h, r_chunk), f32) for _ in range(rows)]
                for k in range(rank // r_chunk):
                    w = ws[s][k].astype(f32)
                    for n in range(rows):
                        acc[n] = acc[n] + w * a[n][k][None, :]
                g = 1.0 + gs[s].astype(f32)
                for n in range(rows):
                    out[n] = out[n] + jax.nn.sigmoid(jnp.sum(acc[n], axis=1)) * (hs[n][s] * rstd_ref[n, s] * g)
            for n in range(rows):
                x_ref[n, pl.ds(j * block_h, block_h)] = (out[n] / streams).astype(x_ref.dtype)

        x = pl.pallas_call(up_mid, out_shape=jax.ShapeDtypeStruct((rows, hidden), x_dtype),
                           grid=(hidden // block_h,), compiler_params=params, interpret=interpret,
                           name="hc_mix_up")(h, norm, up, a, rstd)
        return x, inj, h

    def up_call(h_ref, norm_ref, up_ref, p, ss, pi, x_ref, inj_ref):
        if form == "up-no-weights":
            up_ref = Const(up_ref)
        if form == "up-no-partials":
            p, ss, pi = Const(p), Const(ss, 1.0), Const(pi)
        up_kernel(h_ref, norm_ref, up_ref, p, ss, pi, x_ref, inj_ref)

    x, inj = pl.pallas_call(up_call, grid=(hidden // block_h,), compiler_params=params, interpret=interpret,
                            name="hc_mix_up", out_shape=(jax.ShapeDtypeStruct((rows, hidden), x_dtype),
                                                         jax.ShapeDtypeStruct((rows, streams), f32)))(
        h, norm, up, p_out, ss_out, pi_out)
    return x, inj, h


FORMS = ("kernels", "down-no-weights", "up-no-weights", "up-no-partials", "mid", "prefetch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--mixes", type=int, default=24)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--tiles", default="4:8:4", help="comma-separated block_r:block_h:warps, each run per form")
    ap.add_argument("--prefetch-programs", type=int, default=80, help="rows of prefetching programs (x streams)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxflash.kernels import hc_mix, on_gpu
    from jaxflash.model import hyper_connection as hc

    cfg, mixes, h_key, weight_bytes = random_mixes(args.preset, args.mixes, "bf16 x")
    s, r, eps = cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps
    w = cfg.hidden_size * s

    def program(form, tiles):
        br, bh, warps = tiles

        def run(ms, h):
            rows = h.shape[0]
            pending = (jnp.ones((rows, s), jnp.float32), jnp.zeros((rows, cfg.hidden_size), jnp.bfloat16))
            for m in ms:
                if form == "reference":
                    x, inj, h = hc_mix.mix(h, m.norm, m.down, m.up, m.inject, s, eps, pending=pending,
                                           x_dtype=jnp.bfloat16)
                else:
                    x, inj, h = probe_mix(h, pending, m.norm, m.down, m.up, m.inject, streams=s, eps=eps,
                                          x_dtype=jnp.dtype(jnp.bfloat16), form=form, block_r=br, block_h=bh,
                                          warps=warps, prefetch_programs=args.prefetch_programs)
                pending = (inj, x)
            return hc.combine(h, *pending)
        return jax.jit(run)

    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "mixes": args.mixes, "weight_bytes_per_mix": weight_bytes, "runs": []}
    tiles_list = [tuple(int(n) for n in t.split(":")) for t in args.tiles.split(",")]
    for rows in [int(n) for n in args.rows.split(",")]:
        h = jax.random.normal(h_key, (rows, w), jnp.float32)
        for tiles in tiles_list:
            ref = program("reference", tiles)(mixes, h)
            for form in args.forms.split(","):
                if not hc_mix.takes(rows, w, s, r, tiles[0], tiles[1], 1, tiles[2]):
                    continue
                fn = program(form, tiles)
                out = fn(mixes, h)
                err = rel_err(out, ref) if form in ("kernels", "mid", "prefetch") else None
                wall = wall_us(fn, (mixes, h), args.reps) / args.mixes
                run = {"rows": rows, "form": form, "tiles": list(tiles), "err_vs_kernels": err,
                       "wall_us_per_mix": wall, "floor_us": weight_bytes / COPY_CEILING * 1e6}
                line = f"  {rows} row(s) {form:16s} {tiles}: " + (f"err {err:.1e}, " if err is not None else "")
                line += f"wall {wall:7.2f} us/mix"
                if on_gpu():
                    kus, n, top = trace_kernels_by_name(fn, (mixes, h), max(2, args.reps // 2), top=5)
                    run.update(kernel_us_per_mix=kus / args.mixes, kernels_per_mix=n / args.mixes,
                               by_kernel_us_per_mix={k: t / args.mixes for k, t in top})
                    line += (f", GPU {kus / args.mixes:6.2f} us/mix in {n / args.mixes:.1f} kernels ("
                             + "; ".join(f"{k[:24]} {t / args.mixes:.2f}" for k, t in top) + ")")
                log(line)
                res["runs"].append(run)
    write_json(args.out, "hc_probe.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
