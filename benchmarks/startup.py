#!/usr/bin/env python3
"""Start-up time: what `scripts/serve.py` does before it reports ready (load the checkpoint, plan, then compile
or find every program it serves with, Engine.warm_up), in fresh processes that share one compilation cache
directory: the first start finds it empty, the later ones find what the first wrote (JAX's persistent cache
and jaxflash's program store, jaxflash/engine/program_store.py).

Each start reports its load and warm-up seconds, how many programs it compiled and how many it loaded from the
program store, and the greedy tokens of a fixed prompt, which must be the same in every start.

    python benchmarks/startup.py --out DIR                                           # the bundled model, CPU
    python benchmarks/startup.py --model CKPT --vram-budget 32GiB --out DIR          # a checkpoint, on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, HERE)

from results_file import write_json  # noqa: E402

# one start, in its own process; argv: the options as JSON
START = r"""
import json, logging, sys, time
t0 = time.perf_counter()
import jaxflash
from jaxflash import compile_cache
o = json.loads(sys.argv[1])
compile_cache.enable_compilation_cache(o["cache"])
how = {"compiled": 0, "loaded": 0}
class Count(logging.Handler):
    def emit(self, record):
        word = record.getMessage().split(" ", 1)[0]
        if word in how:
            how[word] += 1
logging.getLogger("jaxflash").addHandler(Count())
logging.getLogger("jaxflash").setLevel(logging.INFO)
t1 = time.perf_counter()
import jax
dtype = o["dtype"] or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")  # serve.py's default
e = jaxflash.load(o["model"], dtype=dtype, vram_budget=o["vram_budget"], max_batch=o["max_batch"], progress=False)
t2 = time.perf_counter()
seconds = e.warm_up()
t3 = time.perf_counter()
tokens = e.generate([list(range(1, 9))], max_new_tokens=8, ignore_eos=True)[0]
print("RESULT " + json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "warm_up_s": t3 - t2, "programs": len(seconds),
                              **how, "tokens": tokens, "plan": e.plan.summary(), "dtype": dtype,
                              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--vram-budget", default=None, help="as serve.py's --vram-budget")
    ap.add_argument("--max-batch", type=int, default=8, help="as serve.py's --max-batch")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="as serve.py's --dtype")
    ap.add_argument("--starts", type=int, default=2, help="fresh processes, one after another")
    ap.add_argument("--cache", default=None, help="the compilation cache directory (default: a new empty one)")
    ap.add_argument("--out", default=None, help="directory for startup.json")
    args = ap.parse_args(argv)
    if args.starts < 1:
        ap.error("--starts must be at least 1")
    cache = args.cache or tempfile.mkdtemp(prefix="jaxflash_cc_")
    opts = json.dumps({"model": args.model, "vram_budget": args.vram_budget, "max_batch": args.max_batch,
                       "dtype": args.dtype, "cache": cache})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = {"python": platform.python_version(), "model": args.model or "bundled", "vram_budget": args.vram_budget,
           "max_batch": args.max_batch, "starts": []}
    for i in range(args.starts):
        p = subprocess.run([sys.executable, "-c", START, opts], env=env, capture_output=True, text=True)
        if p.returncode:
            print(p.stdout[-2000:] + p.stderr[-4000:], file=sys.stderr)
            print(f"start {i + 1} failed (exit status {p.returncode})", file=sys.stderr)
            return 1
        r = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
        res["starts"].append(r)
        print(f"start {i + 1}: import {r['import_s']:.1f} s, load {r['load_s']:.1f} s, warm-up {r['warm_up_s']:.1f} s "
              f"({r['programs']} programs: {r['compiled']} compiled, {r['loaded']} from the program store)",
              flush=True)
    first = res["starts"][0]
    print(f"{first['device']}, jax {first['jax']}, {first['dtype']}; plan: {first['plan']}")
    same = all(s["tokens"] == res["starts"][0]["tokens"] for s in res["starts"])
    res["same_tokens"] = same
    print(f"greedy tokens of a fixed prompt equal in every start: {same}")
    write_json(args.out, "startup.json", res)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
