#!/usr/bin/env python3
"""The GDN chunk kernels (jaxflash/kernels/gdn_chunk.py) against XLA's chunked form, full-size heads, one prefill
chunk of T tokens of one GDN layer (the model has 36).

Cases: `xla` is what the model ran before the kernels (q and k repeated over the value heads, then
gated_deltanet.chunk_gated_delta_rule: batched float32 matmuls and a loop over the chunks); the kernel variants
are precision:block_v:prep_warps:scan_warps:out_warps:stages. Per case: wall time per call (what a prefill pays, launches
included), GPU kernel time and kernel count from a profiler trace, the top kernels.

Numerics: against the same recurrence in float64 on the CPU (T = --check-tokens), for the XLA form on the GPU
and for each kernel variant, relative to the largest value of o and of the state; two inputs: `typical` (decays
and betas in the model's ranges) and `hard` (no decay, beta 1: the largest entries of A and of its inverse).

    python3 benchmarks/gdn_chunk.py --out $OUT                            # on the H200
    python3 benchmarks/gdn_chunk.py --preset tiny --tokens 200 --check-tokens 130 --variants tf32x3:16:4:4:4:1
                                                                          # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import COPY_CEILING, log, trace_kernels_by_name, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--tokens", default="8192", help="comma-separated chunk lengths T to time")
    ap.add_argument("--check-tokens", type=int, default=1024, help="T of the float64 numerics check")
    ap.add_argument("--variants", default="tf32:64:4:4:4:1,tf32x3:64:4:4:4:1,tf32:128:4:8:4:1,tf32:32:4:4:4:1,"
                                          "tf32:64:4:4:4:2,ieee:64:4:4:4:1",
                    help="comma-separated kernel variants precision:block_v:prep_warps:scan_warps:out_warps:stages")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)  # the float64 oracle (every array below has an explicit dtype)
    from jaxflash import presets
    from jaxflash.kernels import gdn_chunk, on_gpu
    from jaxflash.model import gated_deltanet as gdn

    cfg = presets.preset(args.preset)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dev = jax.devices()[0]
    cpu = jax.devices("cpu")[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}; {args.preset}: Hk {hk} Hv {hv} dk {dk} dv {dv}, "
        f"chunk {gdn_chunk.CHUNK}")

    def inputs(t, kind, seed=0):
        r = np.random.default_rng(seed)
        nrm = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
        q = nrm(r.normal(size=(t, hk, dk))) * dk ** -0.5
        k = nrm(r.normal(size=(t, hk, dk)))
        v = r.normal(size=(t, hv, dv))
        if kind == "typical":  # -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): the model's forms
            a_log = r.uniform(-1.0, 1.0, size=hv)
            g = -np.exp(a_log) * np.log1p(np.exp(r.normal(size=(t, hv)) - 2.0))
            beta = 1 / (1 + np.exp(-r.normal(size=(t, hv))))
        else:
            g, beta = np.zeros((t, hv)), np.ones((t, hv))
        s = r.normal(size=(hv, dk, dv)) * 0.1
        return [np.asarray(a, np.float64) for a in (q, k, v, g, beta, s)]

    def rep(a):
        return jnp.repeat(a, hv // hk, axis=1)

    def xla(q, k, v, g, beta, s):  # the model's path without the kernels
        return gdn.chunk_gated_delta_rule(rep(q), rep(k), v, g, beta, s)

    def variant_fn(spec):
        prec, bv, wp, ws, wo, st = spec.split(":")
        return jax.jit(lambda q, k, v, g, beta, s: gdn_chunk.chunk_rule(
            q, k, v, g, beta, s, precision=prec, block_v=int(bv), warps=(int(wp), int(ws), int(wo)),
            stages=int(st)))

    variants = args.variants.split(",")
    res = {"device": str(dev.device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "chunk": gdn_chunk.CHUNK, "numerics": [], "runs": []}

    def err(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    for kind in ("typical", "hard"):
        x64 = inputs(args.check_tokens, kind)
        with jax.default_device(cpu):
            o64, s64 = jax.jit(xla)(*(jnp.asarray(a) for a in x64))
        x32 = [jnp.asarray(a, jnp.float32) for a in x64]
        for name, fn in [("xla", jax.jit(xla))] + [(v, variant_fn(v)) for v in variants]:
            try:
                o, s = fn(*x32)
                row = {"input": kind, "case": name, "o": err(o, o64), "state": err(s, s64)}
            except Exception as e:  # a variant that does not compile is reported, not fatal
                traceback.print_exc()
                row = {"input": kind, "case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            res["numerics"].append(row)
            log(f"numerics {kind:8s} {name:18s} vs float64: " + (
                f"o {row['o']:.2e}, state {row['state']:.2e}" if "o" in row else row["error"]))

    gpu = on_gpu()
    for t in [int(x) for x in args.tokens.split(",")]:
        x32 = [jnp.asarray(a, jnp.float32) for a in inputs(t, "typical", seed=1)]
        # bytes a kernel pass must move at least: q, k (key heads), v, g, beta read; o and the state written
        nbytes = 4 * (2 * t * hk * dk + t * hv * dv + 2 * t * hv + t * hv * dv + 2 * hv * dk * dv)
        for name, fn in [("xla", jax.jit(xla))] + [(v, variant_fn(v)) for v in variants]:
            run = {"tokens": t, "case": name, "min_bytes": nbytes}
            try:
                run["wall_us"] = wall_us(fn, x32, args.reps)
                line = f"T {t:6d} {name:18s}: wall {run['wall_us'] / 1e3:8.3f} ms"
                if gpu:
                    kus, n, top = trace_kernels_by_name(fn, x32, max(2, args.reps // 2), top=6)
                    run.update(kernel_us=kus, kernels=n, top=top,
                               floor_us=nbytes / COPY_CEILING * 1e6)
                    line += (f", GPU {kus / 1e3:8.3f} ms in {n} kernels (floor {run['floor_us'] / 1e3:.3f} ms); "
                             + "; ".join(f"{k[:40]} {v / 1e3:.3f}" for k, v in top[:4]))
            except Exception as e:
                traceback.print_exc()
                run["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                line = f"T {t:6d} {name:18s}: {run['error']}"
            log(line)
            res["runs"].append(run)
    write_json(args.out, "gdn_chunk.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
