#!/usr/bin/env python3
"""Temporary memory of the prefill program, compile only: what XLA assigns the program of one prefill chunk
(Compiled.memory_analysis().temp_size_in_bytes) by residency, chunk tokens, decoder layers and XLA scheduling
options, beside what the planner reserves for it (planner.workspace_bytes).

Why: on the H200 the full-size prefill program of 2048-token chunks took 26.5 GiB of temporaries where the
planner reserves 3.8 GiB, and 8192-token chunks 60-62 GiB (benchmarks/RESULTS.md); XLA's memory report showed
one buffer per layer for values that live within one layer. Compiling the same program with fewer layers
(the full width, the first --layers decoder layers) tells a per-layer cost from a fixed one, and the option
sets tell which scheduling choice keeps the buffers apart:

  default   XLA's own options
  no-lhs    xla_gpu_enable_latency_hiding_scheduler=false (the memory-minimising schedule only)
  slopN     xla_gpu_memory_limit_slop_factor=N (the scheduler's memory limit: N% of 80% of the device's
            memory less the program's inputs and outputs)

Nothing runs: the model's weights are built (seeded random, as benchmarks/decode.py does) only because the
runner lowers its programs over them.

    python benchmarks/prefill_memory.py --layers 4,8 --modes host,device --chunks 2048,8192 \\
        --options default,no-lhs,slop10 [--reports] --out DIR                                # on the GPU
    python benchmarks/prefill_memory.py --preset small --layers 4,8 --chunks 64,256 --out DIR  # CPU smoke run
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import decode  # noqa: E402 -- benchmarks/decode.py: the model and device residency
from decode import log  # noqa: E402

GiB = 2**30


def option_set(name: str) -> dict:
    if name == "default":
        return {}
    if name == "no-lhs":
        return {"xla_gpu_enable_latency_hiding_scheduler": False}
    if name.startswith("slop") and name[4:].isdigit():
        return {"xla_gpu_memory_limit_slop_factor": int(name[4:])}
    raise ValueError(f"unknown option set {name!r} (default, no-lhs, slopN)")


def keep_reports(dump: str, out_dir: str, tag: str) -> list[str]:
    """Copy the prefill program's memory-usage report (and its buffer assignment, gzipped) out of an XLA dump."""
    kept = []
    for pattern, gz in (("*prefill*memory-usage-report.txt", False), ("*prefill*after_optimizations-buffer-assignment.txt", True)):
        for f in glob.glob(os.path.join(dump, pattern)):
            dst = os.path.join(out_dir, f"{tag}.{'buffer-assignment.txt.gz' if gz else 'memory-usage-report.txt'}")
            if gz:
                with open(f, "rb") as src, gzip.open(dst, "wb") as d:
                    shutil.copyfileobj(src, d)
            else:
                shutil.copy(f, dst)
            kept.append(os.path.basename(dst))
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--layers", default="4,8", help="comma-separated decoder layer counts (the first layers)")
    ap.add_argument("--modes", default="host,device", help="comma-separated: host (budgeted), device")
    ap.add_argument("--chunks", default="2048,8192", help="comma-separated prefill chunk sizes (tokens)")
    ap.add_argument("--options", default="default,no-lhs", help="comma-separated option sets (see above)")
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode (sets its cache slots)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reports", action=argparse.BooleanOptionalAction, default=False,
                    help="keep XLA's memory-usage report and buffer assignment (gzipped) of each compile in --out "
                         "(two files per compile)")
    ap.add_argument("--out", default=None, help="directory for results.json (and the reports)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxflash.engine import Engine, planner
    from jaxflash.engine.experts import HostExperts
    from jaxflash.engine.runner import Want
    from jaxflash.synthetic import make_config

    modes, chunks = args.modes.split(","), [int(c) for c in args.chunks.split(",")]
    layer_counts = [int(x) for x in args.layers.split(",")]
    options = {n: option_set(n) for n in args.options.split(",")}
    if not set(modes) <= {"host", "device"}:
        ap.error(f"--modes takes host and/or device, got {args.modes!r}")
    out_dir = args.out or tempfile.mkdtemp(prefix="jaxflash_prefill_memory_")
    os.makedirs(out_dir, exist_ok=True)
    dev = jax.devices()[0]
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "preset": args.preset, "dtype": args.dtype, "budget": args.budget, "options": options, "runs": []}
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}")
    for n_layers in layer_counts:
        cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale if args.preset == "full" else 1.0,
                          num_layers=n_layers).replace(mtp_num_hidden_layers=0)
        model = decode.build_model(cfg, args, max_tokens=max(chunks))
        for mode in modes:
            free, note = planner.device_free_bytes(dev)
            plan = planner.plan(cfg, model.mb, residency=mode, free=free, free_note=note, max_batch=1,
                                budget=planner.parse_bytes(args.budget) if mode == "host" else None,
                                max_seq_len=max(chunks), prefill_chunk=max(chunks),
                                dtype_bytes=jnp.dtype(args.dtype).itemsize)
            params = decode.device_resident(model) if mode == "device" else model.params
            host = HostExperts(model.pool, model.layout, plan.cache_slots) if mode == "host" else None
            runner = Engine(cfg, params, plan=plan, host_experts=host, ngram=model.ngram).scheduler.runner
            for chunk in chunks:
                lowered = runner.lower("prefill", Want(), chunk)
                planned = planner.workspace_bytes(cfg, chunk, plan.max_seq_len, 1)
                for oname, opts in options.items():
                    tag = f"L{n_layers}-{mode}-c{chunk}-{oname}"
                    dump = tempfile.mkdtemp(prefix="jaxflash_xla_dump_")
                    run = {"config": tag, "layers": n_layers, "mode": mode, "chunk": chunk, "options": oname,
                           "planned_workspace_bytes": planned, "max_seq_len": plan.max_seq_len}
                    t0 = time.perf_counter()
                    try:
                        extra = {"xla_dump_to": dump, "xla_dump_hlo_module_re": ".*prefill.*"} if args.reports else {}
                        compiled = lowered.compile(compiler_options={**opts, **extra})
                        run["compile_s"] = time.perf_counter() - t0
                        ma = compiled.memory_analysis()
                        run.update(temp_bytes=int(ma.temp_size_in_bytes), argument_bytes=int(ma.argument_size_in_bytes),
                                   output_bytes=int(ma.output_size_in_bytes))
                        if args.reports:
                            run["reports"] = keep_reports(dump, out_dir, tag)
                        del compiled
                        log(f"{tag}: temporaries {run['temp_bytes'] / GiB:.2f} GiB (planned {planned / GiB:.2f}), "
                            f"arguments {run['argument_bytes'] / GiB:.2f} GiB, compiled in {run['compile_s']:.0f} s")
                    except Exception as e:  # noqa: BLE001 -- an option set the backend refuses: say so, go on
                        run["error"] = f"{type(e).__name__}: {e}"[:2000]
                        log(f"{tag}: {run['error'][:300]}")
                    finally:
                        shutil.rmtree(dump, ignore_errors=True)
                    res["runs"].append(run)
                    with open(os.path.join(out_dir, "results.json"), "w") as f:
                        json.dump(res, f, indent=1)
            del runner, params
    # per-layer slope: temporaries at two layer counts
    by = {}
    for r in res["runs"]:
        if "temp_bytes" in r:
            by.setdefault((r["mode"], r["chunk"], r["options"]), []).append((r["layers"], r["temp_bytes"]))
    log("temporaries per decoder layer (the slope between the layer counts) and fixed part:")
    for (mode, chunk, oname), pts in sorted(by.items()):
        if len(pts) >= 2:
            (l0, t0), (l1, t1) = min(pts), max(pts)
            slope = (t1 - t0) / (l1 - l0)
            log(f"  {mode} c{chunk} {oname}: {slope / GiB:.3f} GiB/layer, fixed {(t0 - slope * l0) / GiB:.2f} GiB "
                f"(48 layers: {(t0 + slope * (48 - l0)) / GiB:.1f} GiB)")
    log(f"results in {out_dir}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
