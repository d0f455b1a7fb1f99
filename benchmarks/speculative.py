#!/usr/bin/env python3
"""Speculative decoding on the bundled model's held-out text: acceptance and speed of n-gram and MTP drafts.

W windows of the held-out token stream (scripts/train_tiny.py's documents, as benchmarks/routing.py rebuilds them)
are prompts of P tokens; each is continued greedily for N tokens by plain decoding and by speculation with each
proposer (--spec) and K = 1, 2, 3 drafts (one sequence, max_batch 1). Greedy speculation must give plain decoding's
tokens, and the script checks that it did. Per configuration: tokens per step (generated / decode steps,
verify steps included), drafts fed and kept, the fraction kept, decode wall time per token (prefill excluded:
the first token's time is taken off) and the speedup over plain decoding. Then the same windows again (--off-rounds
times) with every speculating engine's drafts held off (its scheduler finds every verify step too dear), which
gives the floor of adaptive drafts: what a speculating engine costs per token when drafts never pay, against
plain decoding (the median round).

    python benchmarks/speculative.py                      # the bundled model on this machine's CPU
    python benchmarks/speculative.py --windows 4 --new 32 # a quick run
    python benchmarks/speculative.py --spec mtp           # MTP drafts only
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_file import write_json  # noqa: E402


def run(engine, prompts, new: int):
    """(outputs, decode seconds excluding each prompt's first token, stats delta) of greedy generation."""
    sched = engine.scheduler
    before = dict(vars(sched.stats))
    outs, secs = [], 0.0
    for p in prompts:
        t0 = first = None
        out = []
        t0 = time.perf_counter()
        for _, tok in engine.generate_stream([p], new, ignore_eos=True):
            if tok is None:
                break
            if first is None:
                first = time.perf_counter()
            out.append(tok)
        secs += time.perf_counter() - (first or t0)
        outs.append(out)
    after = vars(sched.stats)
    return outs, secs, {k: after[k] - before[k] for k in before}


def label(config) -> str:
    """A configuration (proposer, K) as the report names it: "plain", "ngram K=2", ..."""
    proposer, k = config
    return f"{proposer} K={k}" if k else "plain"


def drafts_off(engine):
    """The engine's scheduler with step costs under which no draft pays (it runs plain decode steps only)."""
    from jaxflash.engine.scheduler import StepCosts

    class NoDrafts(StepCosts):
        def of(self, rows, fed):
            return 1.0 if fed == 0 else float("inf")

    engine.scheduler.costs = NoDrafts()
    return engine


def program_costs(engine) -> dict:
    """XLA's cost analysis of the one-slot programs the engine decodes with (Runner.program_cost)."""
    from jaxflash.engine.runner import LAG_PROGRAMS, Want

    runner, names = engine.scheduler.runner, ["decode"]
    names += ["verify"] if runner.setup.draft_tokens else []
    names += list(LAG_PROGRAMS) if runner.setup.head_lags else []
    return {n: runner.program_cost(n, None if n in LAG_PROGRAMS else Want(), 1) for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled model)")
    ap.add_argument("--spec", default="ngram,mtp", help="comma-separated proposers: ngram, mtp")
    ap.add_argument("--draft-tokens", default="1,2,3", help="comma-separated K values")
    ap.add_argument("--windows", type=int, default=8, help="prompts taken from the held-out stream")
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens per window")
    ap.add_argument("--new", type=int, default=64, help="generated tokens per window")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--off-rounds", type=int, default=5, help="rounds of the pass with drafts held off")
    ap.add_argument("--out", default=None, help="directory for speculative.json")
    args = ap.parse_args(argv)
    specs = args.spec.split(",")
    if not set(specs) <= {"ngram", "mtp"}:
        ap.error(f"--spec takes ngram and/or mtp, got {args.spec!r}")

    import jax
    import numpy as np

    import jaxflash
    from routing import heldout_tokens

    model = args.model or str(jaxflash.DEFAULT_MODEL)
    stream = heldout_tokens(model)
    span = args.prompt + args.new
    if len(stream) < span:
        raise SystemExit(f"the held-out stream has {len(stream)} tokens, fewer than one window ({span})")
    starts = np.linspace(0, len(stream) - span, args.windows).astype(int)
    prompts = [[int(t) for t in stream[s : s + args.prompt]] for s in starts]
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; {model}, {args.dtype}; held-out stream "
          f"{len(stream)} tokens, {len(prompts)} windows of {args.prompt} prompt + {args.new} generated tokens, "
          "greedy, batch 1", flush=True)
    kw = dict(dtype=args.dtype, max_batch=1, max_seq_len=512, progress=False)
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "model": os.path.basename(os.path.normpath(model)),
           "stream_tokens": int(len(stream)), "windows": len(prompts), "prompt": args.prompt, "new": args.new,
           "runs": []}
    ks = [(None, 0)] + [(s, int(x)) for s in specs for x in args.draft_tokens.split(",")]  # (proposer, K)
    engines = {}
    for c in ks:
        engines[c] = jaxflash.load(model, speculative=c[0], draft_tokens=c[1] or 3, **kw)
        engines[c].warm_up(serving=False)
        run(engines[c], prompts[:1], 4)  # every program once more, outside the timing
    # the configurations take turns window by window, so that whatever else the machine does hits them alike
    outs = {c: [] for c in ks}
    secs = {c: 0.0 for c in ks}
    stats = {c: None for c in ks}
    for p in prompts:
        for c in ks:
            o, dt, st = run(engines[c], [p], args.new)
            outs[c] += o
            secs[c] += dt
            stats[c] = st if stats[c] is None else {n: stats[c][n] + st[n] for n in st}
    plain = ks[0]
    for c in ks:
        (proposer, k), st = c, stats[c]
        tokens = sum(len(o) for o in outs[c]) - len(outs[c])  # the first token of each window is prefill's
        row = {"proposer": proposer, "draft_tokens": k, "tokens": tokens, "decode_steps": st["decode_steps"],
               "verify_steps": st["verify_steps"], "drafts_fed": st["drafts_fed"],
               "drafts_kept": st["drafts_accepted"], "catch_ups": st.get("catch_ups"), "decode_s": secs[c],
               "ms_per_token": secs[c] / tokens * 1e3}
        row["tokens_per_step"] = tokens / max(st["decode_steps"], 1)
        row["kept_fraction"] = st["drafts_accepted"] / st["drafts_fed"] if st["drafts_fed"] else None
        name = label(c)
        if k:
            row["equal_to_plain"] = sum(a == b for a, b in zip(outs[c], outs[plain]))
            row["speedup"] = res["runs"][0]["ms_per_token"] / row["ms_per_token"]
        res["runs"].append(row)
        line = (f"  {name:11s}: {row['tokens_per_step']:.2f} tokens/step ({tokens} tokens, {st['decode_steps']} "
                f"steps, {st['verify_steps']} verify), {row['ms_per_token']:.2f} ms/token")
        if k:
            kept = "-" if row["kept_fraction"] is None else f"{row['kept_fraction']:.0%}"
            line += (f", drafts {st['drafts_fed']} fed / {st['drafts_accepted']} kept ({kept}), speedup "
                     f"{row['speedup']:.2f}x, {row['equal_to_plain']}/{len(outs[c])} windows equal to plain")
        print(line, flush=True)
    # drafts held off: each speculating engine's plain steps against the plain engine's, windows taking turns, in
    # --off-rounds rounds: the median round of each (this machine's speed drifts by tens of % within minutes)
    off = {c: [] for c in ks}
    for c in ks[1:]:
        drafts_off(engines[c])
    for _ in range(args.off_rounds):
        secs_round = {c: 0.0 for c in ks}
        for i, p in enumerate(prompts):
            for c in ks:
                o, dt, st = run(engines[c], [p], args.new)
                assert st["verify_steps"] == 0 and o[0] == outs[plain][i]
                secs_round[c] += dt
        for c in ks:
            off[c].append(secs_round[c])
    print(f"drafts held off ({args.off_rounds} rounds, the median):")
    for row, c in zip(res["runs"], ks):
        ratios = [a / b for a, b in zip(off[plain], off[c])]  # plain's time over this one's, round by round
        row["drafts_off_ms_per_token"] = float(np.median(off[c])) / row["tokens"] * 1e3
        row["drafts_off_speedup"] = float(np.median(ratios))
        row["drafts_off_speedup_range"] = [min(ratios), max(ratios)]
        name = label(c)
        print(f"  {name:11s}: {row['drafts_off_ms_per_token']:.2f} ms/token, {row['drafts_off_speedup']:.3f}x plain "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    # what the programs compute, by XLA's count: deterministic where the times above are not
    print("programs, one slot (XLA's cost analysis; x: against the plain engine's decode step):")
    base = None
    for row, c in zip(res["runs"], ks):
        row["programs"] = costs = program_costs(engines[c])
        if None in costs.values():
            print("  (no cost analysis on this backend)")
            break
        base = base or costs["decode"]
        name = label(c)
        print(f"  {name:11s}: " + "; ".join(f"{n} {v['flops'] / 1e6:.2f} MFLOP ({v['flops'] / base['flops']:.3f}x), "
                                            f"{v['bytes'] / 1e6:.2f} MB ({v['bytes'] / base['bytes']:.3f}x)"
                                            for n, v in costs.items()), flush=True)
    write_json(args.out, "speculative.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
