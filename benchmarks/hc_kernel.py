#!/usr/bin/env python3
"""The hyper-connection mix kernels (jaxflash/kernels/hc_mix.py) against XLA's forms of the same mix,
full-size shapes: "xla" is the model's mix (hyper_connection.mix: from SPLIT_ROWS rows its bf16 weights
multiply the three bf16 parts of the float32 input in one dot), "xla-f32" the same mix with the weights
widened to float32 first (the model's form at 1 row). Each kernel variant runs twice: with XLA's combine
after each mix, and "-fused" with each combine inside the next mix's first kernel (combine_mix).

M mixes with their combines chained in one jitted program (h <- combine(h, inj, x) after mix m, as the decode
step alternates them), each mix with its own weights (the decode step has 97: two per layer and the final
mixer), over N rows (1: batch 1; 8: batch 8 or 2 verify steps of 4). Per mix it reports the summed GPU kernel
time from a profiler trace, the kernels per mix, the weight bytes a mix must read (norm, down, up and inject,
bf16) and the fraction of 4.2 TB/s; first the numerics of every variant against the model's mix.

    python3 benchmarks/hc_kernel.py --out $OUT                  # on the H200
    python3 benchmarks/hc_kernel.py --preset tiny --mixes 2     # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import COPY_CEILING, log, rel_err, trace_kernels_by_name, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


VARIANT_FIELDS = ("block_r", "block_h", "warps", "splits", "up_warps", "r_piece")  # hc_mix.mix's tile arguments


def parse_variant(v: str) -> tuple:
    """A variant block_r:block_h:warps[:splits[:up_warps[:r_piece]]] as the tuple of VARIANT_FIELDS; the fields
    left out are the engine's (None: hc_mix.mix's default for the rows)."""
    from jaxflash.kernels import hc_mix

    given = tuple(int(n) for n in v.split(":"))
    if not 3 <= len(given) <= len(VARIANT_FIELDS):
        raise ValueError(f"{v!r} is not block_r:block_h:warps[:splits[:up_warps[:r_piece]]]")
    return given + (None, None, None, None, None, hc_mix.R_PIECE)[len(given):]


def random_mixes(preset, count, note=""):
    """The preset's config, count hyper-connection mixes of its shapes, each with its own random bf16 weights
    (separate buffers, as the engine holds them), a key for the residual rows and a mix's weight bytes; logs
    the conditions."""
    import jax
    import jax.numpy as jnp

    from jaxflash import presets
    from jaxflash.model import hyper_connection as hc

    cfg = presets.preset(preset)
    s, r, w = cfg.hc_count, cfg.hc_lowrank, cfg.hidden_size * cfg.hc_count
    log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {preset}: {count} mixes, {s} streams x "
        f"{cfg.hidden_size}, rank {r}, bf16 weights, float32 residual" + (f", {note}" if note else ""))

    def one(key):
        k = jax.random.split(key, 4)
        rnd = lambda kk, shape, sc: (jax.random.normal(kk, shape, jnp.float32) * sc).astype(jnp.bfloat16)  # noqa
        return hc.HyperConnection(norm=rnd(k[0], (w,), 0.3), down=rnd(k[1], (r, w), 0.02),
                                  up=rnd(k[2], (w, r), 0.1), inject=rnd(k[3], (s, w), 0.02))

    keys = jax.random.split(jax.random.PRNGKey(0), count + 1)
    mixes = [one(keys[i]) for i in range(count)]
    return cfg, mixes, keys[-1], sum(a.nbytes for a in jax.tree.leaves(mixes[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--mixes", type=int, default=96, help="mixes (and combines) chained in one program")
    ap.add_argument("--rows", default="1,2,4,8", help="comma-separated token row counts")
    ap.add_argument("--variants", default="4:8:4,4:8:4:1:2:64,4:8:4:1:4:64,2:8:2:1:2:64,8:8:8:1:2:256,4:16:4:1:2:256",
                    help="comma-separated kernel variants block_r:block_h:warps[:splits[:up_warps[:r_piece]]] "
                         "(splits default to the engine's hc_mix.row_splits, which depends on the rows; the up "
                         "kernel's warps and its loads of the rank default to the engine's hc_mix.up_warps_for, "
                         "which depends on the rows, and R_PIECE), each run with its combine separate and fused "
                         "into the next mix")
    ap.add_argument("--baselines", default="xla,xla-f32", help="XLA's forms to run: xla (the model's mix), xla-f32 "
                    "(weights widened to float32); the model's mix is the numerics' reference either way")
    ap.add_argument("--fused-only", action="store_true", help="run each kernel variant with its combine fused only")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxflash.kernels import hc_mix, on_gpu
    from jaxflash.model import hyper_connection as hc

    cfg, mixes, h_key, weight_bytes = random_mixes(args.preset, args.mixes)
    s, r, eps = cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps
    w = cfg.hidden_size * s
    try:
        variants = [parse_variant(v) for v in args.variants.split(",")]
    except ValueError as e:
        ap.error(f"--variants: {e}")

    def program(variant, fused=False):
        """The chain of mixes and combines; fused: each combine runs inside the next mix's kernels
        (hyper_connection.combine_mix), as the decode step does within a layer."""
        def mix(m, h, pending):
            if variant is None or variant == "f32":  # XLA's mix; its cases run unfused (pending is None)
                m = m if variant is None else jax.tree.map(lambda a: a.astype(jnp.float32), m)
                return (*hc.mix(m, h, s, eps), h)
            br, bh, warps, splits, up_warps, r_piece = variant
            return hc_mix.mix(h, m.norm, m.down, m.up, m.inject, s, eps, pending=pending, block_r=br,
                              block_h=bh, warps=warps, splits=splits, up_warps=up_warps, r_piece=r_piece)

        def run(ms, h):
            pending = None
            for m in ms:
                x, inj, h = mix(m, h, pending)
                pending = (inj, x)
                if not fused:
                    h, pending = hc.combine(h, *pending), None
            return h if pending is None else hc.combine(h, *pending)
        return jax.jit(run)

    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "mixes": args.mixes, "weight_bytes_per_mix": weight_bytes, "runs": []}
    for rows in [int(n) for n in args.rows.split(",")]:
        h = jax.random.normal(h_key, (rows, w), jnp.float32)
        ref = program(None)(mixes, h)
        cases = [(b, {"xla": None, "xla-f32": "f32"}[b], False) for b in args.baselines.split(",") if b]
        for v in variants:
            name = f"kernel-r{v[0]}-h{v[1]}-w{v[2]}-s{v[3] or 'auto'}-u{v[4] or 'auto'}-p{v[5]}"
            cases += ([] if args.fused_only else [(name, v, False)]) + [(name + "-fused", v, True)]
        for name, variant, fused in cases:
            fn = program(variant, fused)
            try:
                fn.lower(mixes, h)
            except ValueError as e:  # tiles that this row count's shapes do not take
                log(f"  {rows} row(s) {name:30s}: not taken ({e})")
                continue
            err = rel_err(fn(mixes, h), ref) if variant is not None else 0.0
            wall = wall_us(fn, (mixes, h), args.reps) / args.mixes
            run = {"rows": rows, "variant": name, "err_vs_model": err, "wall_us_per_mix": wall,
                   "floor_us": weight_bytes / COPY_CEILING * 1e6}
            line = f"  {rows} row(s) {name:30s}: error vs the model's mix {err:.1e}, wall {wall:7.2f} us/mix"
            if on_gpu():
                kus, n, top = trace_kernels_by_name(fn, (mixes, h), max(2, args.reps // 4), top=4)
                run.update(kernel_us_per_mix=kus / args.mixes, kernels_per_mix=n / args.mixes,
                           fraction_of_hbm=weight_bytes / (kus / args.mixes * 1e-6) / COPY_CEILING,
                           top_kernels_us_per_mix=[(k, t / args.mixes) for k, t in top])
                line += (f", GPU {kus / args.mixes:6.2f} us/mix (with its combine) in {n / args.mixes:.1f} "
                         f"kernels; {weight_bytes / 1e6:.2f} MB -> floor {run['floor_us']:.2f} us, "
                         f"{run['fraction_of_hbm']:.1%} of 4.2 TB/s")
            log(line)
            if on_gpu():
                log("      " + "; ".join(f"{k[:40]} {t:.2f}" for k, t in run["top_kernels_us_per_mix"]))
            res["runs"].append(run)
    write_json(args.out, "hc_kernel.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
