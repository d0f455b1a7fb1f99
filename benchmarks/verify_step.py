#!/usr/bin/env python3
"""Speculative verify steps against plain decode steps on the full-size model (benchmarks/decode.py's seeded
random model, built in memory): what a verify step of K drafts costs, and the decoding speed that gives.

For each residency (--modes) an engine without speculation decodes --batch sequences by plain steps, and for
each proposer (--spec: ngram, mtp) and K in --draft-tokens an engine with speculative=proposer, draft_tokens=K
decodes them by verify steps alone, K drafts per sequence set in the state before every step (random tokens, in
place of the proposer's): every row of the step is then a real row, as in a step where the proposer found K
drafts. With MTP drafts the step also runs the MTP head over its rows and chains it K - 1 times (the next
step's drafts, overwritten), as it does in use. A random model keeps none
of them, and a verify step's cost does not depend on how many it keeps (it computes all K+1 rows and commits
the kept ones by masks), so acceptance enters afterwards: at tau tokens per verify step a sequence decodes
tau / (verify step time) tokens per second. The program runs as the scheduler runs it: dispatched before the
previous step's outputs are read, one step in flight.

Reported per configuration: the wall time per step (steady state), the GPU busy time and kernels per step from
a profiler trace and its split by part, and with host experts the misses and lookups per step. A speculating
engine also times its own plain decode steps, what it runs where drafts do not pay (with MTP drafts they keep
their pairs for the head, and its catch_up program runs after every 16, as the scheduler runs it; catch_up is
timed alone too), against the plain engine's. Per K the speedup over plain decoding
  * with every draft kept (tau = K + 1) and at tau = 2.4;
  * on the bundled model's held-out text: its verify and plain steps as benchmarks/speculative.py counted them
    (--text-counts, that script's JSON), timed at this device's step times (its plain steps at the speculating
    engine's own).
Routing (--routing): `model`, the random routers' own (near uniform over the experts; random drafts then route
independently of each other, an upper bound on the misses), or `calibrated`, expert ids drawn from
benchmarks/routing.py's model of the real model's routing on real text (decode.py's StreamRouting): a verify
step's K+1 rows are the next K+1 tokens of the sequence's routing stream, as the rows of kept drafts are; every
configuration reads the same stream from its start.

    python benchmarks/verify_step.py --modes host,device --spec ngram,mtp --draft-tokens 1,2,3 --out DIR  # GPU
    python benchmarks/verify_step.py --modes host --routing calibrated --spec mtp --draft-tokens 1,3 --warm 64 \
        --out DIR                                   # the cache past its cold start, under real-text routing
    python benchmarks/verify_step.py --preset tiny --modes host,device --steps 4 --trace-steps 2  # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from decode import StreamRouting, build_model, device_resident, log  # noqa: E402

TARGET_TAU = 2.4  # tokens per verify step at which issue 15's host-residency target is stated


def set_drafts(runner, drafts, n_draft) -> None:
    """Put drafts [max_batch, K] and their counts [max_batch] where the proposer would have put its own."""
    import jax
    import jax.numpy as jnp

    st = runner.state
    spec = dataclasses.replace(st.spec, drafts=jnp.asarray(drafts, jnp.int32), n_draft=jnp.asarray(n_draft, jnp.int32))
    runner._state = jax.tree.leaves(dataclasses.replace(st, spec=spec))


def run_config(name, engine, prompts, k, args, trace_dir):
    """Admit and prefill `prompts`, then time args.steps steps (verify steps of k drafts, or plain decode steps
    for k = 0) after args.warm untimed ones, and trace args.trace_steps more."""
    import jax
    import numpy as np

    import trace_parts
    from jaxflash.engine.runner import Want

    sched, rng = engine.scheduler, np.random.default_rng(7)
    runner = sched.runner
    batch = len(prompts)
    rows = next(b for b in sched.buckets if b >= batch)
    total = args.warm + args.steps + args.trace_steps
    own_plain = args.warm + args.steps if k else 0  # the speculating engine's own plain steps, after its verify steps
    reqs = sched.make_requests(prompts, max_new_tokens=total * (k + 1) + own_plain + 8, temperature=0.0, top_p=1.0,
                               top_k=0, min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
    for r in reqs:
        sched.submit(r)
    while sched.pending or any(not r.out for r in reqs):  # admissions and prefills, through the scheduler
        sched.step()
    while sched._in_flight:
        sched._process(sched._in_flight.popleft())
    longest = max(len(p) for p in prompts) + total * (k + 1) + own_plain + 8
    span = next(s for s in sched.spans if s >= longest)
    n_draft = np.zeros(runner.setup.max_batch, np.int32)
    n_draft[:batch] = k
    caps = np.full(rows, k, np.int32)
    vocab = engine.config.vocab_size
    stamps, misses, lookups = [], [], []
    in_flight = collections.deque()

    def step():
        if k:
            set_drafts(runner, rng.integers(0, vocab, (runner.setup.max_batch, k)), n_draft)
            in_flight.append(runner.verify(caps, rows=rows, span=span))
        else:
            in_flight.append(runner.decode(rows=rows, span=span))
        if len(in_flight) > 1:
            out = in_flight.popleft().result()
            misses.append(int(out.expert_misses or 0))
            lookups.append(int(out.expert_lookups or 0))
        stamps.append(time.perf_counter())

    for _ in range(args.warm + args.steps):
        step()
    timed = stamps[args.warm:]
    step_s = (timed[-1] - timed[0]) / (len(timed) - 1)
    m = misses[args.warm:]
    lk = lookups[args.warm:]
    jax.block_until_ready(runner.state)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.trace_steps):
            step()
        while in_flight:
            in_flight.popleft().result()
        jax.block_until_ready(runner.state)
    name_p = "verify" if k else "decode"
    hlo = runner.program_text(name_p, Want(), rows=rows, span=span)
    own = own_plain_steps(runner, rows, span, args) if k else {}
    for r in reqs:
        sched._free(r)
    runner.free()  # its KV and expert caches: the next configuration needs the memory
    run = {"config": name, "draft_tokens": k, "batch": batch, "rows_per_step": batch * (k + 1), "span": span,
           "plan": engine.plan.summary(), "cache_slots": engine.plan.cache_slots, "step_ms": step_s * 1e3,
           "steps_timed": len(timed) - 1, **own}
    if any(lk):
        run.update(misses_per_step=sum(m) / len(m), lookups_per_step=sum(lk) / len(lk),
                   hit_rate=1 - sum(m) / max(1, sum(lk)))
    if jax.devices()[0].platform == "gpu":  # the CPU backend's traces hold no device kernels
        try:
            run["trace"] = trace_parts.summarise(trace_parts.gpu_kernels(trace_dir), args.trace_steps, hlo)
        except Exception as e:  # noqa: BLE001 -- keep the timings even if the trace cannot be read
            log(f"  trace not summarised: {type(e).__name__}: {e}")
    return run


def own_plain_steps(runner, rows: int, span: int, args) -> dict:
    """A speculating engine's own plain decode steps (what it runs where its drafts do not pay), timed as
    run_config times its verify steps; with MTP drafts the catch_up program runs after every LAG_ROWS of them,
    as the scheduler runs it, and is timed alone too."""
    import jax

    from jaxflash.engine.speculative import catch_up_due

    lagging, lag = runner.setup.head_lags, 0
    stamps, in_flight = [], collections.deque()
    for _ in range(args.warm + args.steps):
        if lagging and catch_up_due(lag, verifying=False):  # the head over the pairs the last steps kept
            runner.catch_up(rows=rows, span=span)
            lag = 0
        in_flight.append(runner.decode(rows=rows, span=span))
        lag += lagging
        if len(in_flight) > 1:
            in_flight.popleft().result()
        stamps.append(time.perf_counter())
    while in_flight:
        in_flight.popleft().result()
    timed = stamps[args.warm:]
    out = {"own_plain_step_ms": (timed[-1] - timed[0]) / (len(timed) - 1) * 1e3}
    if lagging:
        times = []
        for _ in range(3):
            jax.block_until_ready(runner.state)
            t0 = time.perf_counter()
            runner.catch_up(rows=rows, span=span)
            jax.block_until_ready(runner.state)
            times.append(time.perf_counter() - t0)
        out["catch_up_ms"] = min(times) * 1e3
    return out


def speedups(plain: dict, run: dict, counts: dict | None) -> dict:
    """Tokens per second of one sequence, relative to plain decoding, from the steps' wall times."""
    k, t_p, t_v = run["draft_tokens"], plain["step_ms"], run["step_ms"]
    t_own = run.get("own_plain_step_ms", t_p)  # this engine's own plain step (where its drafts are held off)
    out = {"verify_over_plain": t_v / t_p, "all_kept": (k + 1) * t_p / t_v, "own_plain_over_plain": t_own / t_p}
    if k + 1 >= TARGET_TAU:  # a verify step yields at most k + 1 tokens
        out[f"tau_{TARGET_TAU}"] = TARGET_TAU * t_p / t_v
    if counts:  # the bundled model's text: the same tokens in (plain steps) + (verify steps) against plain steps
        c = counts.get((run["proposer"], k))
        if c:
            plain_steps = c["decode_steps"] - c["verify_steps"]
            out["text"] = counts[None, 0]["decode_steps"] * t_p / (plain_steps * t_own + c["verify_steps"] * t_v)
            out["text_tokens_per_verify_step"] = 1 + c["drafts_kept"] / max(1, c["verify_steps"])
    return out


def report(run: dict) -> str:
    s = f"  {run['config']}: step {run['step_ms']:.2f} ms ({run['rows_per_step']} rows)"
    if "misses_per_step" in run:
        s += (f"; {run['misses_per_step']:.0f} misses / {run['lookups_per_step']:.0f} lookups per step "
              f"(hit rate {run['hit_rate']:.1%})")
    lines = [s]
    if "trace" in run:
        import trace_parts

        lines += ["    " + line for line in trace_parts.format_summary(run["trace"]).splitlines()]
    if "speedup" in run:
        sp = run["speedup"]
        catch = f", catch_up {run['catch_up_ms']:.2f} ms" if "catch_up_ms" in run else ""
        s = (f"    verify / plain step {sp['verify_over_plain']:.2f}x, its own plain step "
             f"{run['own_plain_step_ms']:.2f} ms ({sp['own_plain_over_plain']:.3f}x){catch}; speedup with every "
             f"draft kept {sp['all_kept']:.2f}x")
        if f"tau_{TARGET_TAU}" in sp:
            s += f", at {TARGET_TAU} tokens/step {sp[f'tau_{TARGET_TAU}']:.2f}x"
        if "text" in sp:
            s += (f", on the bundled model's text ({sp['text_tokens_per_verify_step']:.2f} tokens per verify step) "
                  f"{sp['text']:.2f}x")
        lines.append(s)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--modes", default="host,device", help="comma-separated: host (budgeted), device")
    ap.add_argument("--spec", default="ngram", help="comma-separated proposers: ngram, mtp")
    ap.add_argument("--routing", default="model", choices=["model", "calibrated"])
    ap.add_argument("--draft-tokens", default="1,2,3", help="comma-separated K (1 to 3)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--warm", type=int, default=4, help="untimed steps first (first executions)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps")
    ap.add_argument("--trace-steps", type=int, default=4, help="steps in the profiler trace")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-threads", type=int, default=4, help="configurations compiled at once")
    ap.add_argument("--text-counts", default=os.path.join(HERE, "results", "speculative_cpu_mtp.json"),
                    help="benchmarks/speculative.py's JSON: the bundled model's step counts per K ('' for none)")
    ap.add_argument("--out", default=None, help="directory for verify_step.json")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.draft_tokens.split(",")]
    if not all(1 <= k <= 3 for k in ks):
        ap.error(f"--draft-tokens takes K from 1 to 3, got {args.draft_tokens!r}")
    specs = args.spec.split(",")
    if not set(specs) <= {"ngram", "mtp"}:
        ap.error(f"--spec takes ngram and/or mtp, got {args.spec!r}")
    modes = args.modes.split(",")
    if not set(modes) <= {"host", "device"}:
        ap.error(f"--modes takes host and/or device, got {args.modes!r}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.engine import Engine, planner
    from jaxflash.engine.experts import HostExperts
    from jaxflash.engine.runner import Want
    from jaxflash.synthetic import make_config

    counts = None
    if args.text_counts:
        with open(args.text_counts) as f:
            # by (proposer, K); the first version of that JSON had n-gram runs only, without "proposer"
            counts = {(r.get("proposer", "ngram" if r["draft_tokens"] else None), r["draft_tokens"]): r
                      for r in json.load(f)["runs"]}
    out_dir = args.out = args.out or tempfile.mkdtemp(prefix="jaxflash_verify_")
    os.makedirs(out_dir, exist_ok=True)
    traces = tempfile.mkdtemp(prefix="jaxflash_traces_")
    cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale)
    if "mtp" not in specs:  # no MTP head: its weights would only take memory
        cfg = cfg.replace(mtp_num_hidden_layers=0)
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; preset {args.preset}: "
        f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, {args.dtype}; "
        f"batch {args.batch}, proposers {specs}, K {ks}")
    model = build_model(cfg, args, max_tokens=max(args.prefill_chunk, args.batch * (1 + max(ks))))
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "preset": args.preset, "dtype": args.dtype, "batch": args.batch,
           "prompt_tokens": args.prompt, "steps": args.steps, "trace_steps": args.trace_steps,
           "budget": args.budget, "routing": {"model": "the random routers' (near uniform)",
                                              "calibrated": "benchmarks/routing.py's RoutingModel, seed "
                                                            f"{args.seed}"}[args.routing], "runs": []}

    def routing_feed(k):  # the calibrated stream: prompt, then every step's K+1 rows, and a margin
        if args.routing == "model":
            return None
        from routing import RoutingModel

        rm = RoutingModel(num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                          top_k=cfg.num_experts_per_tok, seed=args.seed)
        steps = args.warm + args.steps + args.trace_steps + 4
        return StreamRouting(rm.sample(args.prompt + args.prefill_chunk + steps * (k + 1), streams=args.batch)[0])

    free, note = planner.device_free_bytes(dev)  # before the resident experts take their part of it
    dparams = device_resident(model) if "device" in modes else None
    engines = []  # (name, mode, proposer, K, engine)
    for mode in modes:
        for proposer, k in [(None, 0)] + [(p, k) for p in specs for k in ks]:
            plan = planner.plan(cfg, model.mb, residency=mode, free=free, free_note=note, max_batch=args.batch,
                                budget=planner.parse_bytes(args.budget) if mode == "host" else None,
                                max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                                dtype_bytes=jnp.dtype(args.dtype).itemsize, rows_per_seq=1 + k)
            host = None
            if mode == "host":
                host = HostExperts(model.pool, model.layout, plan.cache_slots)
            eng = Engine(cfg, model.params if mode == "host" else dparams, plan=plan, host_experts=host,
                         ngram=model.ngram, speculative=proposer, draft_tokens=k or 3, routing=routing_feed(k))
            engines.append((f"{mode}-b{args.batch}-{proposer or 'plain'}{k or ''}", mode, proposer, k, eng))

    def programs(e, k):
        rows = next(b for b in e.scheduler.buckets if b >= args.batch)
        step = [("verify" if k else "decode", Want(), rows, span) for span in e.scheduler.spans]
        own = [("decode", Want(), rows, span) for span in e.scheduler.spans] if k else []  # own_plain_steps
        lag = [("catch_up", None, rows, span) for span in e.scheduler.spans] if e.scheduler.lagging else []
        base = [("prefill", Want()), ("admit", None), ("release", None), ("decode", Want(), rows, None)]
        return base + step + own + lag

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(len(engines), args.compile_threads)) as ex:
        list(ex.map(lambda e: e[4].scheduler.runner.compile(programs(e[4], e[3])), engines))
    res["compile_s"] = time.perf_counter() - t0
    log(f"compiled {len(engines)} configurations' programs side by side in {res['compile_s']:.0f} s")

    rng = np.random.default_rng(1)
    prompts = [[int(x) for x in rng.integers(0, cfg.vocab_size, args.prompt)] for _ in range(args.batch)]
    plain = {}
    for name, mode, proposer, k, eng in engines:
        run = run_config(name, eng, prompts, k, args, os.path.join(traces, name))
        run.update(mode=mode, proposer=proposer)
        if k == 0:
            plain[mode] = run
        elif mode in plain:
            run["speedup"] = speedups(plain[mode], run, counts)
        log(report(run))
        res["runs"].append(run)
        with open(os.path.join(out_dir, "verify_step.json"), "w") as f:  # after each run: a cut run keeps the rest
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
