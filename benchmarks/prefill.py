#!/usr/bin/env python3
"""Prefill speed of the engine on the full-size model (docs/model.md, "Dimensions"): how fast one long prompt is
prefilled, at several prefill chunk sizes, with the experts on the host under a VRAM budget and all on the
device, with the routers' own routing or a routing calibrated to real text; each chunk's GPU time split by part
from a profiler trace.

The model is the one benchmarks/decode.py builds (seeded random, jaxflash.synthetic.SyntheticSource; routed
experts generated for `--distinct-layers` layers and copied to the others; the n-gram table shrunk by
--ngram-rows-scale). Routing (--routing): `model` (the random routers' top-k: close to uniform) or `calibrated`
(benchmarks/routing.py's model of the real routing on real text, fed through decode.StreamRouting: one stream,
each prefill chunk takes its next rows; the routers still weight those experts).

The runner is driven directly (no scheduler, so nothing else runs): admit slot 0, dispatch the prompt's chunks
as Scheduler._prefill does, wait for the last chunk's first token. Each configuration (residency x chunk x
routing) gets its own plan (max_batch 1, max_seq_len the prompt rounded up to whole pages, at least one chunk,
unless --max-seq-len) and engine; its state is freed after it. Per configuration:
  * one untimed warm-up prefill of a different prompt (first execution, allocation, a warm expert cache), and
    one of a short prompt (the first execution of its smaller bucket's program);
  * --reps timed prefills of fresh random prompts, chunks dispatched back to back ("pipelined": what the
    scheduler does): prompt tok/s and time to first token (the whole prompt, from the first chunk's dispatch
    to the last chunk's token on the host; the admit before it is not counted), and each chunk's share (the
    interval between consecutive chunks' results, read by a helper thread as they land);
  * with --per-chunk (default), --reps more prefills that read each chunk's result before dispatching the
    next ("serial"): each chunk's own wall time, dispatch included;
  * host experts: each chunk's expert records copied over PCIe (StepOutput.expert_misses) and distinct experts
    looked up (expert_lookups), summed over the layers; the bytes staged (misses x record bytes), the PCIe floor
    (those bytes / the zero-copy gather's bandwidth, measured alone by decode.gather_bandwidth, or an assumed
    51 GB/s where it cannot be measured) and each chunk's time over its floor;
  * --trace (default on a GPU): one more prefill inside the JAX profiler; its GPU time split by part per chunk
    (trace_parts, with the prefill program's optimized HLO);
  * the time to first token of a short prompt (--short-prompt): warm (right after the long prompts) and cold
    (a freshly allocated state: empty expert caches; its buffers are new, so the first chunk may also re-record
    the program's CUDA graph: the device mode's cold figure shows that part alone).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/prefill.py --modes host,device --chunks 256,1024,2048 \\
        --prompt 2048 --routing model,calibrated --out DIR                                    # on the GPU
    python benchmarks/prefill.py --preset small --modes host,device --chunks 16,64 --prompt 200 \\
        --short-prompt 20 --reps 1 --out OUT_DIR                                            # CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import gzip
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import decode  # noqa: E402 -- benchmarks/decode.py: the model, device residency, routing streams, gather bandwidth
from decode import log  # noqa: E402

ASSUMED_GBPS = 51.0  # the zero-copy gather's bandwidth on the H200 (benchmarks/RESULTS.md) when not measured


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _count(x):
    """A count, or the median of an even number of counts."""
    return "-" if x is None else format(x, ".0f" if x == int(x) else ".1f")


class Prefiller:
    """Prefills whole prompts in slot 0 of one runner, the way Scheduler._admit and Scheduler._prefill do (a
    greedy request, all tokens allowed)."""

    def __init__(self, engine):
        import numpy as np

        from jaxflash.engine.sampling import SamplingParams

        self.sched = engine.scheduler  # only for its chunking (_chunks) and its all-allowed mask: it runs nothing
        self.runner = self.sched.runner
        self.plan = engine.plan
        self.sampling = SamplingParams(0.0, 0, 1.0, 0.0, 0)
        self.np = np
        self.waiter = concurrent.futures.ThreadPoolExecutor(1)  # reads chunk results in order, as they land

    def admit(self, n_tokens: int) -> None:
        """Slot 0 with the KV pages of n_tokens (pages 0.. as a fresh scheduler hands them out)."""
        import jax

        np, s = self.np, self.runner.setup
        n = min(math.ceil(n_tokens / self.plan.page_size), s.max_pages)
        row = np.full(s.max_pages, self.plan.num_pages, np.int32)
        row[:n] = np.arange(n)
        self.runner.admit(0, row, self.sampling)
        jax.block_until_ready(self.runner.state)

    def prefill(self, tokens: list[int], serial: bool = False, admit: bool = True, release: bool = True) -> dict:
        """Admit (unless the caller did), prefill, release (unless the caller will). Returns the wall time from
        the first dispatch to the first token, each chunk's result time (relative to the first dispatch), each
        dispatch's host time, and the outputs."""
        from jaxflash.engine.runner import Want

        if admit:
            self.admit(len(tokens))
        want, mask, runner = Want(), self.sched._all_allowed, self.runner
        outs, done, dispatch, futures = [], [], [], []

        def read(p):
            out = p.result()
            return out, time.perf_counter()

        t0 = time.perf_counter()
        try:
            for _, piece, buf, last, follow in self.sched._chunks(tokens, buckets=self.sched.prefill_buckets):
                a = time.perf_counter()
                p = runner.prefill(0, buf, len(piece), last, mask, follow, want)
                dispatch.append(time.perf_counter() - a)
                if serial:
                    out, t = read(p)
                    outs.append(out)
                    done.append(t - t0)
                else:
                    futures.append(self.waiter.submit(read, p))
            for f in futures:
                out, t = f.result()
                outs.append(out)
                done.append(t - t0)
        finally:
            for f in futures:  # a failure: let every read finish before the slot is released
                f.exception()
            if release:
                runner.release(0)
        return {"total_s": done[-1], "done_s": done, "dispatch_s": dispatch, "outs": outs}


def chunk_counts(outs, field):
    """A per-chunk int from the prefill StepOutputs, None where the program does not return it."""
    return [None if getattr(o, field, None) is None else int(getattr(o, field)) for o in outs]


def per_chunk_ms(run: dict) -> list[float]:
    """Each chunk's time: the interval between its result and the previous one's (the first: from the first
    dispatch). Pipelined, its share of the prefill; serial, its own wall time, dispatch included."""
    done = [0.0] + run["done_s"]
    return [(b - a) * 1e3 for a, b in zip(done, done[1:])]


def summarise_trace(trace_dir: str, chunks: int, hlo: str, on_gpu: bool):
    import trace_parts

    # the CPU backend's traces hold no device kernels: there, its thunks of the prefill program (a test of
    # the attribution, not a timing of anything that runs on a GPU)
    events = trace_parts.gpu_kernels(trace_dir, None if on_gpu else "jit_prefill")
    return trace_parts.summarise(events, chunks, hlo)


def format_trace(tr: dict, on_gpu: bool) -> list[str]:
    what = "GPU kernels" if on_gpu else "XLA:CPU thunks (no GPU: attribution only)"
    lines = [f"trace ({what}), one prefill of {tr['steps']} chunks: {tr['kernels_per_step']:.0f} kernels/chunk "
             f"({tr['in_cuda_graph']:.0%} in CUDA graphs), busy {tr['busy_ms_per_step']:.2f} ms/chunk, span "
             f"{tr['span_ms_per_step']:.2f} ms/chunk, median kernel {tr['median_kernel_us']:.1f} us"]
    for part, ms in tr["parts_ms_per_step"].items():
        lines.append(f"  {ms:9.3f} ms/chunk {tr['kernels_per_step_by_part'][part]:8.1f} kernels/chunk  {part}")
    for name, ms in tr["unattributed_top"]:
        lines.append(f"      unattributed {ms:.3f} ms/chunk: {name}")
    return lines


def run_config(c: dict, args, rng, traces: str, gbps: float | None, gbps_how: str) -> dict:
    """Warm-up, timed prefills, trace, short prompts: the figures of one configuration; its state is freed
    afterwards."""
    pf = Prefiller(c["engine"])
    try:
        return _measure(pf, c, args, rng, traces, gbps, gbps_how)
    finally:
        pf.waiter.shutdown()
        pf.runner.free()  # its KV and expert caches: the next configuration needs the memory


def _measure(pf: Prefiller, c: dict, args, rng, traces: str, gbps: float | None, gbps_how: str) -> dict:
    import jax

    from jaxflash.engine.runner import Want

    eng, name, cfg = c["engine"], c["name"], c["cfg"]
    runner = pf.runner
    record_bytes = c["record_bytes"]
    on_gpu = jax.devices()[0].platform == "gpu"

    def prompt(n):
        return [int(x) for x in rng.integers(0, cfg.vocab_size, n)]

    run = {"config": name, "mode": c["mode"], "routing": c["routing"], "chunk": c["chunk"], "overlap": c["overlap"],
           "gdn_kernel": c["gdn_kernel"],
           "prompt_tokens": args.prompt, "short_prompt_tokens": args.short_prompt, "reps": args.reps,
           "plan": eng.plan.summary(), "notes": list(eng.plan.notes), "cache_slots": eng.plan.cache_slots,
           "max_seq_len": eng.plan.max_seq_len, "chunks": -(-args.prompt // c["chunk"])}
    host = c["mode"] == "host"
    t0 = time.perf_counter()
    runner.allocate()
    warm = pf.prefill(prompt(args.prompt))  # first execution, allocation, a warm expert cache
    run["warmup_s"] = time.perf_counter() - t0
    # the short prompt's bucket is its own program: its first execution (about 150 ms on the H200) must not
    # land in the warm figure below
    pf.prefill(prompt(args.short_prompt))
    log(f"  warm-up prefill {warm['total_s']:.2f} s (allocation {run['warmup_s'] - warm['total_s']:.2f} s)")
    temp = runner.temp_bytes("prefill", Want())
    run.update(prefill_temp_bytes=temp, planned_workspace_bytes=eng.plan.reserved.get("workspace"))
    if temp is not None:
        log(f"  prefill program's temporaries (XLA's buffer assignment): {temp / 2**30:.2f} GiB; the planner's "
            f"workspace: {eng.plan.reserved.get('workspace', 0) / 2**30:.2f} GiB")

    pipe = [pf.prefill(prompt(args.prompt)) for _ in range(args.reps)]
    serial = [pf.prefill(prompt(args.prompt), serial=True) for _ in range(args.reps)] if args.per_chunk else []
    n = run["chunks"]
    ttft = [r["total_s"] for r in pipe]
    run.update(ttft_s=ttft, ttft_s_median=statistics.median(ttft),
               prompt_tok_s=args.prompt / statistics.median(ttft),
               dispatch_ms_median=statistics.median(d * 1e3 for r in pipe for d in r["dispatch_s"]),
               dispatch_ms_max=max(d * 1e3 for r in pipe for d in r["dispatch_s"]),
               chunk_ms_pipelined=[per_chunk_ms(r) for r in pipe])
    if serial:
        run.update(serial_total_s=[r["total_s"] for r in serial], chunk_ms_serial=[per_chunk_ms(r) for r in serial])
    every = pipe + serial  # expert counts of every timed prefill
    run["expert_misses"] = [chunk_counts(r["outs"], "expert_misses") for r in every]
    run["expert_lookups"] = [chunk_counts(r["outs"], "expert_lookups") for r in every]

    # per chunk: medians over the reps
    rows = []
    for i in range(n):
        misses = _median([m[i] for m in run["expert_misses"]])
        lookups = _median([m[i] for m in run["expert_lookups"]])
        pipe_ms = statistics.median(p[i] for p in run["chunk_ms_pipelined"])
        ser_ms = statistics.median(p[i] for p in run["chunk_ms_serial"]) if serial else None
        row = {"chunk": i, "tokens": min(c["chunk"], args.prompt - i * c["chunk"]), "pipelined_ms": pipe_ms,
               "serial_ms": ser_ms, "misses": misses, "lookups": lookups}
        if host and misses is not None:
            gb = misses * record_bytes / 1e9
            floor_ms = gb / (gbps or ASSUMED_GBPS) * 1e3
            row.update(staged_gb=gb, floor_ms=floor_ms,
                       pipelined_over_floor=pipe_ms / floor_ms if floor_ms else None,
                       serial_over_floor=ser_ms / floor_ms if floor_ms and ser_ms is not None else None)
        rows.append(row)
    run["per_chunk"] = rows
    if host:
        run["gather_gbps"], run["gather_gbps_how"] = gbps or ASSUMED_GBPS, gbps_how
        if all(r["misses"] is not None for r in rows):
            floor = sum(r["floor_ms"] for r in rows)
            run.update(staged_gb=sum(r["staged_gb"] for r in rows), pcie_floor_ms=floor,
                       ttft_over_floor=run["ttft_s_median"] * 1e3 / floor if floor else None)

    # the profiler trace of one more prefill
    if args.trace:
        trace_dir = os.path.join(traces, name)
        pf.admit(args.prompt)  # admit and release outside the trace: it holds the prefill chunks alone
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            traced = pf.prefill(prompt(args.prompt), admit=False, release=False)
            jax.block_until_ready(runner.state)
        runner.release(0)
        run["traced_ttft_s"] = traced["total_s"]
        hlo = runner.program_text("prefill", Want())
        if args.keep_trace:  # the raw material, for a second look at the split
            newest = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                         key=os.path.getmtime)
            shutil.copy(newest, os.path.join(args.out, f"trace_{name}.json.gz"))
            with gzip.open(os.path.join(args.out, f"prefill_hlo_{name}.txt.gz"), "wt") as f:
                f.write(hlo)
        try:
            tr = summarise_trace(trace_dir, n, hlo, on_gpu)
            run["trace"] = tr
            run["trace_on"] = "gpu" if on_gpu else "cpu thunks"
            run["traced_ttft_over_busy"] = traced["total_s"] * 1e3 / (tr["busy_ms_per_step"] * n)
        except Exception as e:  # noqa: BLE001 -- keep the timings even if the trace cannot be read
            log(f"  trace not summarised: {type(e).__name__}: {e}")

    # the short prompt: warm (after the long ones), then cold (a fresh state: empty expert caches)
    warm_short = [pf.prefill(prompt(args.short_prompt)) for _ in range(args.reps)]
    cold_short = []
    for _ in range(args.reps):
        runner.free()  # the old state goes first: two full-size states need not fit at once
        runner.allocate()
        cold_short.append(pf.prefill(prompt(args.short_prompt)))
    for tag, runs in (("warm", warm_short), ("cold", cold_short)):
        misses = [chunk_counts(r["outs"], "expert_misses") for r in runs]
        run[f"short_{tag}_ttft_s"] = [r["total_s"] for r in runs]
        run[f"short_{tag}_misses"] = [None if None in m else sum(m) for m in misses]
    return run


def report(run: dict, res: dict) -> list[str]:
    host = run["mode"] == "host"
    lines = [f"  prefill of {run['prompt_tokens']} tokens in {run['chunks']} chunk(s) of {run['chunk']}: "
             f"**{run['prompt_tok_s']:.1f} tok/s**, time to first token {run['ttft_s_median'] * 1e3:.1f} ms "
             f"(median of {len(run['ttft_s'])}: " + ", ".join(f"{t * 1e3:.1f}" for t in run["ttft_s"]) + " ms; "
             f"chunks dispatched back to back), dispatch {run['dispatch_ms_median']:.2f} ms/chunk "
             f"(median; max {run['dispatch_ms_max']:.2f})"]
    if "serial_total_s" in run:
        tot = statistics.median(run["serial_total_s"])
        lines.append(f"  serial (each chunk's result read before the next is dispatched): {tot * 1e3:.1f} ms "
                     f"= {run['prompt_tokens'] / tot:.1f} tok/s")
    if host:
        lines.append(f"  PCIe floor at {run['gather_gbps']:.1f} GB/s ({run['gather_gbps_how']}); "
                     f"record {res['record_bytes']:,} bytes")
    head = f"    {'chunk':>5} {'tokens':>6} {'pipelined ms':>12} {'serial ms':>10}"
    if host:
        head += (f" {'misses':>7} {'lookups':>7} {'staged GB':>9} {'floor ms':>9} {'pipe/floor':>10}"
                 f" {'serial/floor':>12}")
    lines.append(head)
    for r in run["per_chunk"]:
        s = f"    {r['chunk']:>5} {r['tokens']:>6} {r['pipelined_ms']:>12.1f} {_fmt(r['serial_ms']):>10}"
        if host:
            s += (f" {_count(r['misses']):>7} {_count(r['lookups']):>7} {_fmt(r.get('staged_gb'), '.2f'):>9}"
                  f" {_fmt(r.get('floor_ms')):>9} {_fmt(r.get('pipelined_over_floor'), '.2f'):>10}"
                  f" {_fmt(r.get('serial_over_floor'), '.2f'):>12}")
        lines.append(s)
    if host:
        if "pcie_floor_ms" in run:
            lines.append(f"  whole prompt: {run['staged_gb']:.2f} GB staged, PCIe floor {run['pcie_floor_ms']:.1f} ms, "
                         f"time to first token = {_fmt(run['ttft_over_floor'], '.2f')} x floor")
        else:
            lines.append("  expert misses/lookups: - (the prefill program does not return them)")
    if "trace" in run:
        lines += ["  " + l for l in format_trace(run["trace"], run["trace_on"] == "gpu")]
        lines.append(f"  traced prefill {run['traced_ttft_s'] * 1e3:.1f} ms / busy of its chunks = "
                     f"{run['traced_ttft_over_busy']:.3f}")
    for tag, what in (("cold", "fresh state, empty expert cache" if host else "fresh state"),
                      ("warm", "right after the long prompts")):
        t, m = run[f"short_{tag}_ttft_s"], run[f"short_{tag}_misses"]
        s = (f"  short prompt ({run['short_prompt_tokens']} tokens), {tag} ({what}): time to first token "
             + ", ".join(f"{x * 1e3:.1f}" for x in t) + " ms")
        if host:
            s += "; expert misses " + ", ".join(_count(x) for x in m)
        lines.append(s)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--modes", default="host,device", help="comma-separated: host (budgeted), device")
    ap.add_argument("--chunks", default="256,1024,2048", help="comma-separated prefill chunk sizes (tokens)")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens of the long prompt")
    ap.add_argument("--short-prompt", type=int, default=67, help="tokens of the short prompt (cold and warm TTFT)")
    ap.add_argument("--routing", default="model", help="comma-separated: model, calibrated")
    ap.add_argument("--overlap", default="on",
                    help="comma-separated, host mode: on (each block's PCIe copy beside the previous block's "
                         "kernels, by the copy engines: the engine's default; configurations named ...-overlap), "
                         "off (copy, then compute), zero_copy (beside, by the zero-copy gather kernel: ...-overlap-zc)")
    ap.add_argument("--gdn-kernel", default="auto",
                    help="comma-separated: auto (the engine's default: the GDN kernels on a GPU), on, off (XLA's "
                         "chunked form; the configuration's name ends in -xla-gdn)")
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode")
    ap.add_argument("--max-seq-len", type=int, default=0,
                    help="the context the engine plans for (default: the prompt rounded up to whole pages, at "
                         "least one chunk); a prefill chunk's attention spans the whole planned context")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=2, help="timed prefills of the long prompt (each mode)")
    ap.add_argument("--per-chunk", action=argparse.BooleanOptionalAction, default=True,
                    help="also time --reps serial prefills (each chunk's result read before the next dispatch)")
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json")
    ap.add_argument("--trace", action=argparse.BooleanOptionalAction, default=None,
                    help="trace one more prefill and split its GPU time by part (default: on a GPU)")
    ap.add_argument("--keep-trace", action="store_true",
                    help="also copy each configuration's trace and prefill HLO into --out")
    ap.add_argument("--compile-threads", type=int, default=3, help="configurations compiled at once")
    ap.add_argument("--only", default=None, help="comma-separated configurations to run, e.g. host-c256-model")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.engine import Engine, planner
    from jaxflash.engine.experts import HostExperts
    from jaxflash.engine.runner import Want
    from jaxflash.synthetic import make_config

    modes = args.modes.split(",")
    if not set(modes) <= {"host", "device"}:
        ap.error(f"--modes takes host and/or device, got {args.modes!r}")
    routings = args.routing.split(",")
    if not set(routings) <= {"model", "calibrated"}:
        ap.error(f"--routing takes model and/or calibrated, got {args.routing!r}")
    overlaps = args.overlap.split(",")
    if not set(overlaps) <= {"on", "off", "zero_copy"}:
        ap.error(f"--overlap takes on, off and/or zero_copy, got {args.overlap!r}")
    gdn_kernels = args.gdn_kernel.split(",")
    if not set(gdn_kernels) <= {"auto", "on", "off"}:
        ap.error(f"--gdn-kernel takes auto, on and/or off, got {args.gdn_kernel!r}")
    chunks = [int(c) for c in args.chunks.split(",")]
    if min(chunks) < 1 or args.prompt < 1 or args.short_prompt < 1 or args.reps < 1:
        ap.error("chunks, --prompt, --short-prompt and --reps must be positive")
    out_dir = args.out = args.out or tempfile.mkdtemp(prefix="jaxflash_prefill_")
    os.makedirs(out_dir, exist_ok=True)
    traces = tempfile.mkdtemp(prefix="jaxflash_traces_")  # large: kept out of --out
    cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale).replace(mtp_num_hidden_layers=0)
    dev = jax.devices()[0]
    if args.trace is None:
        args.trace = dev.platform == "gpu"
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""), "preset": args.preset,
           "dtype": args.dtype, "prompt_tokens": args.prompt, "short_prompt_tokens": args.short_prompt,
           "chunks": chunks, "reps": args.reps, "budget": args.budget, "seed": args.seed, "runs": []}
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, Python {platform.python_version()}; "
        f"preset {args.preset}: {cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
        f"top-{cfg.num_experts_per_tok}, {args.dtype}")

    model = decode.build_model(cfg, args, max_tokens=max(chunks))  # a chunk: the most rows one program hashes
    res.update(pool_gib=model.pool.nbytes / 2**30, pool_pinned=model.pool.pinned, dense_gib=model.dense / 2**30,
               record_bytes=model.layout.record_bytes)
    rng = np.random.default_rng(1)

    # Plan every configuration first, from the device's free memory before anything big is allocated; each
    # runner allocates its state (KV, expert caches) on its first call and frees it after its run.
    align = math.lcm(planner.PAGE, cfg.indexer_compress_ratio if cfg.qsa_enabled else 1)
    configs = []
    for mode in modes:
        for chunk in chunks:
            for routing, overlap, gdn_kernel in ((r, o, g) for r in routings
                                                 for o in (overlaps if mode == "host" else ["off"])
                                                 for g in gdn_kernels):
                name = (f"{mode}-c{chunk}-{routing}" + {"off": "", "on": "-overlap", "zero_copy": "-overlap-zc"}[overlap]
                        + {"auto": "", "on": "-gdn-kernel", "off": "-xla-gdn"}[gdn_kernel])
                if args.only and name not in args.only.split(","):
                    continue
                seq = args.max_seq_len or -(-max(args.prompt, args.short_prompt, chunk) // align) * align
                free, note = planner.device_free_bytes(dev)
                try:
                    plan = planner.plan(cfg, model.mb, residency=mode, free=free, free_note=note, max_batch=1,
                                        budget=planner.parse_bytes(args.budget) if mode == "host" else None,
                                        max_seq_len=seq, prefill_chunk=chunk,
                                        dtype_bytes=jnp.dtype(args.dtype).itemsize)
                except planner.PlanError as e:
                    log(f"  {name}: no plan: {e}")
                    res["runs"].append({"config": name, "mode": mode, "routing": routing, "chunk": chunk,
                                        "error": f"PlanError: {e}"})
                    continue
                configs.append({"name": name, "mode": mode, "chunk": chunk, "routing": routing, "plan": plan,
                                "overlap": overlap,
                                "gdn_kernel": {"auto": None, "on": True, "off": False}[gdn_kernel],
                                "cfg": cfg, "record_bytes": model.layout.record_bytes})
    device_params = decode.device_resident(model) if any(c["mode"] == "device" for c in configs) else None

    calibrated = None
    if any(c["routing"] == "calibrated" for c in configs):
        from routing import RoutingModel

        rm = RoutingModel(num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                          top_k=cfg.num_experts_per_tok, seed=args.seed)
        # one stream's rows for every prefill of a configuration (then it would wrap around): the warm-up, the
        # timed, the traced and the short prompts; every configuration replays the same stream from its start
        tokens = (2 + args.reps * (2 if args.per_chunk else 1)) * args.prompt + 2 * args.reps * args.short_prompt
        t0 = time.perf_counter()
        calibrated, _ = rm.sample(tokens + 16, streams=1)
        log(f"calibrated routing: {tokens + 16} tokens sampled in {time.perf_counter() - t0:.1f} s")
    for c in configs:
        feed = decode.StreamRouting(calibrated) if c["routing"] == "calibrated" else None
        plan = c["plan"]
        host = (HostExperts(model.pool, model.layout, plan.cache_slots, overlap=c["overlap"] != "off",
                            overlap_mode="zero_copy" if c["overlap"] == "zero_copy" else "auto")
                if c["mode"] == "host" else None)
        c["engine"] = Engine(cfg, device_params if c["mode"] == "device" else model.params, plan=plan,
                             host_experts=host, ngram=model.ngram, routing=feed, gdn_kernel=c["gdn_kernel"])
        c["gdn_kernel"] = c["engine"].gdn_kernel
        for n in plan.notes:
            log(f"  {c['name']}: plan: {n}")

    t0 = time.perf_counter()
    def programs(c):  # the prefill buckets (the short prompt takes the smallest), admit, release
        return [("prefill", Want(), b) for b in c["engine"].scheduler.prefill_buckets] + [("admit", None),
                                                                                          ("release", None)]

    if configs:
        with concurrent.futures.ThreadPoolExecutor(min(len(configs), args.compile_threads)) as ex:
            list(ex.map(lambda c: c["engine"].scheduler.runner.compile(programs(c)), configs))
    res["compile_s"] = time.perf_counter() - t0
    log(f"compiled {len(configs)} configurations' prefill programs side by side in {res['compile_s']:.0f} s")

    gbps, how = None, "assumed: the H200's zero-copy gather (RESULTS.md); not measured here"
    host_plans = [c["plan"] for c in configs if c["mode"] == "host"]
    if host_plans:
        records = min(cfg.num_experts, max(p.cache_slots for p in host_plans))  # one block of a prefill chunk
        gbps = decode.gather_bandwidth(model.pool, model.layout, records)
        if gbps:
            how = f"measured: zero-copy gather alone, {records} random records"
            log(f"zero-copy gather alone: {gbps:.1f} GB/s ({records} random records)")
            if any(c["overlap"] == "on" for c in configs):  # the copy beside the kernels takes the copy engines
                res["memcpy_gbps"] = decode.gather_bandwidth(model.pool, model.layout, records, zero_copy=False)
                log(f"copy engines alone (cudaMemcpyAsync per record): {res['memcpy_gbps']:.1f} GB/s")
        else:
            log(f"gather bandwidth not measurable here (no bench_gather, or the pool is not pinned): floors at an "
                f"assumed {ASSUMED_GBPS:.0f} GB/s")
    res["gather_gbps"], res["gather_gbps_how"] = gbps or (ASSUMED_GBPS if host_plans else None), how

    for c in configs:
        plan = c["plan"]
        log()
        log(f"== {c['name']}: {dev.device_kind}, jax {jax.__version__}, preset {args.preset}, {args.dtype}, experts "
            f"on the {c['mode']}" + (f" (budget {args.budget}, {plan.cache_slots} cache slots/layer)"
                                     if c["mode"] == "host" else "")
            + f", routing {c['routing']}, prompt {args.prompt} tokens, chunk {c['chunk']}, max_seq_len "
            f"{plan.max_seq_len}, reps {args.reps}")
        log(f"  plan: {plan.summary()}")
        try:
            run = run_config(c, args, rng, traces, gbps, how)
        except Exception as e:  # noqa: BLE001 -- keep the other configurations' figures
            log(f"  failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            run = {"config": c["name"], "mode": c["mode"], "routing": c["routing"], "chunk": c["chunk"],
                   "error": f"{type(e).__name__}: {e}"}
        else:
            for line in report(run, res):
                log(line)
        res["runs"].append(run)
        with open(os.path.join(out_dir, "results.json"), "w") as f:  # after each run: a cut run keeps the rest
            json.dump(res, f, indent=1)
    log(f"\nresults: {os.path.join(out_dir, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
