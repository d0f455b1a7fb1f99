#!/usr/bin/env python3
"""The full-size model (docs/model.md §1 dimensions) built in memory and run end to end on one device.

It shows that full size is feasible with the model as written: weights go to the device one layer at a time,
all 48 layers' NVFP4 experts stay resident (dequantised inside the matmuls), and the n-gram table stays on
the host, where the rows each call needs are gathered. It also times full-sequence forwards (prefill-like)
and the MTP head.

The weights are seeded random (jaxflash.synthetic.SyntheticSource): NVFP4 experts with random E2M1 codes,
everything else by the synthetic writer's rules. The n-gram table is shrunk by --ngram-rows-scale (the hash then
uses smaller primes); the real one is 48 GiB of FP8 and would only change the host gather.

    python benchmarks/full_model.py --tokens 128,1024 --out DIR
    python benchmarks/full_model.py --layers 2 --tokens 16 --no-mtp      # a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results_file import write_json  # noqa: E402


def device_bytes(dev) -> int | None:
    stats = dev.memory_stats() or {}
    return stats.get("bytes_in_use")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all 48)")
    ap.add_argument("--tokens", default="128,1024", help="comma-separated sequence lengths to run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--no-mtp", action="store_true", help="skip the MTP head")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per length (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from jaxflash.engine import Engine
    from jaxflash.model.weights import load_params
    from jaxflash.synthetic import SyntheticSource, make_config

    cfg = make_config("full", ngram_rows_scale=args.ngram_rows_scale)
    if args.layers is not None:
        cfg = cfg.replace(num_hidden_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    if args.no_mtp:
        cfg = cfg.replace(mtp_num_hidden_layers=0)
    dev = jax.devices()[0]
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "layers": cfg.num_hidden_layers, "dtype": args.dtype,
           "ngram_table_rows": cfg.ngram_table_rows(), "runs": []}
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; {cfg.num_hidden_layers} layers, "
          f"{cfg.num_experts} experts/layer NVFP4, {args.dtype}", flush=True)

    src = SyntheticSource(cfg, seed=args.seed)
    t0 = time.perf_counter()
    table = src.ngram_table()
    res["ngram_table_s"] = time.perf_counter() - t0
    base = device_bytes(dev)
    t0 = time.perf_counter()
    done = [0]

    def on_read(name):
        if name.endswith("mlp.gate.weight") and name.startswith("layers."):
            done[0] += 1
            print(f"  layer {done[0]}/{cfg.num_hidden_layers} on the device "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)

    params = load_params(src, cfg, args.dtype, ple_table=None, on_read=on_read)
    jax.block_until_ready(params)
    res["load_s"] = time.perf_counter() - t0
    loaded = device_bytes(dev)
    if loaded is not None:
        res["weights_gib"] = (loaded - (base or 0)) / 2**30
    print(f"built and loaded in {res['load_s']:.0f} s"
          + (f"; {res['weights_gib']:.1f} GiB of weights on the device" if loaded is not None else ""), flush=True)

    engine = Engine(cfg, params, host_table=table)
    rng = np.random.default_rng(1)
    for n in [int(x) for x in args.tokens.split(",")]:
        toks = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        toks[n // 3] = cfg.eos_token_id
        batch, _, _ = engine._batch(toks)
        rows = engine.ple_rows(batch)
        t0 = time.perf_counter()
        out = jax.block_until_ready(engine._logits(engine.params, batch, rows))
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            rows = engine.ple_rows(batch)  # the host gather is part of every call
            out = jax.block_until_ready(engine._logits(engine.params, batch, rows))
            times.append(time.perf_counter() - t0)
        logits = np.asarray(out[0, :n], np.float32)
        run = {"tokens": n, "padded": int(batch.shape[1]), "first_call_s": first,
               "median_s": float(np.median(times)), "tokens_per_s": n / float(np.median(times)),
               "finite": bool(np.isfinite(logits).all()), "logit_std": float(logits.std()),
               "peak_gib": (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30}
        res["runs"].append(run)
        print(f"T={n:5d} (padded {run['padded']}): first call {first:.1f} s, then {run['median_s'] * 1e3:.1f} ms "
              f"= {run['tokens_per_s']:.0f} tok/s; logits finite {run['finite']}, std {run['logit_std']:.2f}; "
              f"peak {run['peak_gib']:.1f} GiB", flush=True)

    if not args.no_mtp:
        n = 128
        toks = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        t0 = time.perf_counter()
        drafts = engine.mtp_logits(toks)
        res["mtp"] = {"tokens": n, "first_call_s": time.perf_counter() - t0,
                      "finite": bool(np.isfinite(drafts).all()), "logit_std": float(np.std(drafts))}
        print(f"MTP head over {n} tokens: {res['mtp']}", flush=True)

    write_json(args.out, "full_model.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
