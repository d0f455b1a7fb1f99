#!/usr/bin/env python3
"""How long a decoding stream pauses while a long prompt prefills beside it (chunked prefill scheduling).

The scheduler dispatches at most one prefill chunk per step, between decode steps, so a running stream waits
for one chunk at a time, not for the whole prompt. Measured through the scheduler (Scheduler.step, the loop the
server runs): stream A (a short prompt, greedy, EOS ignored) decodes; after --before of its tokens, request B
with a --prompt-token prompt arrives and prefills in chunks while A keeps decoding; the run ends --after
tokens of A after B's first token. Each token's time is when the host reads it (what a client would see).

Reported: A's gaps between consecutive tokens before B arrives (median: the plain step), while B prefills
(the longest: the stall, and the chunks it spanned), B's time to first token and its chunks; the conditions
(GPU, residency, budget, routing, chunk size, expert misses).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python benchmarks/decode_stall.py --mode host --prompt 8192 --out DIR
    python benchmarks/decode_stall.py --preset tiny --mode host --budget 300MiB --prompt 200 --chunk 64 \\
        --routing model                                                                    # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import decode  # noqa: E402 -- benchmarks/decode.py: the model, device residency, routing streams
from results_file import write_json  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--mode", default="host", choices=["host", "device"])
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode")
    ap.add_argument("--prompt", type=int, default=8192, help="tokens of the long prompt (request B)")
    ap.add_argument("--short-prompt", type=int, default=64, help="tokens of the decoding stream's prompt (A)")
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (default: the planner's pick)")
    ap.add_argument("--before", type=int, default=32, help="A's tokens before B arrives")
    ap.add_argument("--after", type=int, default=32, help="A's tokens after B's first token")
    ap.add_argument("--routing", default="calibrated", choices=["model", "calibrated"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)
    if min(args.prompt, args.short_prompt, args.before, args.after) < 1 or args.chunk < 0:
        ap.error("--prompt, --short-prompt, --before and --after must be positive, --chunk at least 0")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.engine import Engine, planner
    from jaxflash.engine.experts import HostExperts
    from jaxflash.synthetic import make_config

    cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale).replace(mtp_num_hidden_layers=0)
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; preset {args.preset}: "
        f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, {args.dtype}")
    seq = args.prompt + args.short_prompt + args.before + args.after + 64
    free, note = planner.device_free_bytes(dev)
    model = decode.build_model(cfg, args, max_tokens=args.chunk or max(planner.PREFILL_CHUNKS))
    plan = planner.plan(cfg, model.mb, residency=args.mode, free=free, free_note=note, max_batch=2,
                        max_seq_len=seq, prefill_chunk=args.chunk or None,
                        budget=planner.parse_bytes(args.budget) if args.mode == "host" else None,
                        dtype_bytes=jnp.dtype(args.dtype).itemsize)
    for n in plan.notes:
        log(f"  plan: {n}")
    feed = None
    if args.routing == "calibrated":
        from routing import RoutingModel

        rm = RoutingModel(num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                          top_k=cfg.num_experts_per_tok, seed=args.seed)
        t0 = time.perf_counter()
        ids, _ = rm.sample(args.prompt + args.before + args.after + 256, streams=2)
        feed = decode.StreamRouting(ids)
        log(f"calibrated routing: 2 streams sampled in {time.perf_counter() - t0:.1f} s")
    host = HostExperts(model.pool, model.layout, plan.cache_slots) if args.mode == "host" else None
    params = decode.device_resident(model) if args.mode == "device" else model.params
    eng = Engine(cfg, params, plan=plan, host_experts=host, ngram=model.ngram, routing=feed)
    sched = eng.scheduler
    t0 = time.perf_counter()
    sched.warm_up()
    log(f"programs compiled in {time.perf_counter() - t0:.0f} s")

    rng = np.random.default_rng(args.seed)

    def prompt(n):
        return rng.integers(10, cfg.vocab_size - 10, n).tolist()

    def requests(prompts, new):
        return sched.make_requests(prompts, max_new_tokens=new, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                   seed=0, stop=None, eos_ids=(), ignore_eos=True)

    # first execution of every program the run takes: a long prompt beside a decoding stream
    for r in requests([prompt(args.short_prompt), prompt(args.prompt)], [8, 2]):
        sched.submit(r)
    while not sched.idle:
        sched.step()

    a, = requests([prompt(args.short_prompt)], args.before + args.after + 4096)
    b, = requests([prompt(args.prompt)], 1)
    a_times, b_first, b_arrival, chunk_dispatch = [], None, None, []
    real_prefill = sched.runner.prefill

    def timed_prefill(*x, **k):  # when each chunk of B was dispatched
        chunk_dispatch.append(time.perf_counter())
        return real_prefill(*x, **k)

    sched.runner.prefill = timed_prefill
    misses0 = sched.stats.expert_misses
    sched.submit(a)
    while b_first is None or len(a_times) < b_at + args.after:
        if b_arrival is None and len(a_times) >= args.before:
            chunk_dispatch.clear()
            b_arrival = time.perf_counter()
            b_at = len(a_times)
            sched.submit(b)
        for ev in sched.step():
            now = time.perf_counter()
            if ev.request is a and ev.token is not None:
                a_times.append(now)
            elif ev.request is b and ev.token is not None and b_first is None:
                b_first = now
                b_at = len(a_times)
    sched.cancel(a)
    while not sched.idle:
        sched.step()
    sched.runner.prefill = real_prefill

    gaps = np.diff(np.asarray(a_times)) * 1e3
    arrival_i = next(i for i, t in enumerate(a_times) if t >= b_arrival)
    before = gaps[: max(arrival_i - 1, 1)]
    during = gaps[arrival_i - 1: b_at + 1]
    worst = int(np.argmax(during))
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "preset": args.preset, "dtype": args.dtype, "mode": args.mode,
           "budget": args.budget if args.mode == "host" else None, "cache_slots": plan.cache_slots,
           "routing": args.routing, "prompt_tokens": args.prompt, "short_prompt_tokens": args.short_prompt,
           "prefill_chunk": plan.prefill_chunk, "chunks": len(chunk_dispatch),
           "plain_gap_ms_median": float(statistics.median(before)), "stall_ms": float(during[worst]),
           "gaps_during_prefill_ms": [float(g) for g in during], "b_ttft_s": b_first - b_arrival,
           "expert_misses_decode": sched.stats.expert_misses - misses0}
    log(f"== {args.mode}, {dev.device_kind}, preset {args.preset}, {args.dtype}"
        + (f", budget {args.budget} ({plan.cache_slots} cache slots/layer)" if args.mode == "host" else "")
        + f", routing {args.routing}: stream A decodes beside B's {args.prompt}-token prompt in "
          f"{len(chunk_dispatch)} chunk(s) of {plan.prefill_chunk}")
    log(f"  A's plain step (median gap before B arrived, {len(before)} gaps): {res['plain_gap_ms_median']:.1f} ms")
    log(f"  A's longest gap while B prefilled: **{res['stall_ms']:.1f} ms** "
        f"({len(during)} gaps from B's arrival to its first token: "
        + ", ".join(f"{g:.0f}" for g in during) + " ms)")
    log(f"  B's time to first token: {res['b_ttft_s'] * 1e3:.0f} ms "
        f"({args.prompt / res['b_ttft_s']:.0f} prompt tok/s beside the stream)")
    path = write_json(args.out, "results.json", res)
    if path:
        log(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
