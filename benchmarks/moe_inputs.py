#!/usr/bin/env python3
"""The MoE block's input kernel (jaxflash/kernels/moe_inputs.py: router softmax, top-k and renormalisation, the
shared expert's gate and activation) against XLA's form of the same work (moe.moe_parts without it), full-size
shapes.

L MoE blocks' input stages in one jitted program, each with its own random bf16 stacked input weight
[E + 2 Is + 1, H] (the product is the same in both forms and is timed with them), over N token rows. Per block
it reports the summed GPU kernel time from a profiler trace, the kernels per block and the top kernels by time;
first the numerics of the kernel against XLA's form from the same product rows (ids equal, largest relative
difference of the weights, gate and activation). --warps: the kernel at each of these warp counts.

    python3 benchmarks/moe_inputs.py --out $OUT                  # on the H200
    python3 benchmarks/moe_inputs.py --preset tiny --layers 2    # CPU smoke run (interpret mode)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import log, rel_err, trace_kernels_by_name  # noqa: E402
from results_file import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rows", default="1,4,8,32", help="token rows per step, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warps", default=None, help="comma-separated warp counts of the kernel (default: its own)")
    ap.add_argument("--out", default=None, help="directory for moe_inputs.json")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxflash import presets
    from jaxflash.kernels import moe_inputs
    from jaxflash.model import moe as moe_mod
    from jaxflash.model.base import linear, silu, up

    cfg = presets.preset(args.preset)
    e, si, h, k = cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    width = e + 2 * si + 1
    log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.preset}: {args.layers} blocks, "
        f"{e} experts top-{k}, shared {si}, hidden {h}, bf16")
    keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 1)
    weights = [(jax.random.normal(kk, (width, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16) for kk in keys[:-1]]

    def xla_form(proj):
        logits, g, u, gl = jnp.split(proj, [e, e + si, e + 2 * si], axis=-1)
        w, ids = moe_mod.route(None, cfg, proj, jax.nn.softmax(up(logits), axis=-1))
        return ids, w, jax.nn.sigmoid(up(gl)), silu(up(g)).astype(proj.dtype) * u

    def kernel_form(warps):
        return lambda proj: moe_inputs.moe_inputs(proj, e, si, k, cfg.norm_topk_prob, warps=warps)

    def program(form):
        return jax.jit(lambda ws, xs: [form(linear(x, w)) for w, x in zip(ws, xs)])

    warps = [int(w) for w in args.warps.split(",")] if args.warps else [moe_inputs.WARPS]
    programs = {"xla": program(xla_form)}
    programs.update({f"kernel-{w}w": program(kernel_form(w)) for w in warps})
    products = jax.jit(lambda ws, xs: [linear(x, w) for w, x in zip(ws, xs)])
    numerics = {"xla": jax.jit(lambda ps: [xla_form(p) for p in ps]),
                "kernel": jax.jit(lambda ps: [kernel_form(warps[0])(p) for p in ps])}
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "python": platform.python_version(),
              "preset": args.preset, "layers": args.layers, "experts": e, "top_k": k, "shared": si, "hidden": h,
              "reps": args.reps, "warps": warps, "cases": []}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [jax.random.normal(kk, (rows, h), jnp.float32).astype(jnp.bfloat16)
              for kk in jax.random.split(keys[-1], args.layers)]
        projs = products(weights, xs)  # both forms from the same product rows
        got, want = numerics["kernel"](projs), numerics["xla"](projs)
        same_ids = sum(int(jnp.all(a[0] == b[0])) for a, b in zip(got, want))
        case = {"rows": rows, "blocks_with_equal_ids": same_ids,
                "weights_rel": max(rel_err(a[1], b[1]) for a, b in zip(got, want)),
                "gate_rel": max(rel_err(a[2], b[2]) for a, b in zip(got, want)),
                "activation_rel": max(rel_err(a[3], b[3]) for a, b in zip(got, want))}
        log(f"rows {rows}: ids equal in {same_ids}/{args.layers} blocks; weights {case['weights_rel']:.2e}, gate "
            f"{case['gate_rel']:.2e}, activation {case['activation_rel']:.2e} (relative to the largest)")
        for name, fn in programs.items():
            total, n, top = trace_kernels_by_name(fn, (weights, xs), args.reps)
            case[name] = {"us_per_block": total / args.layers, "kernels_per_block": n / args.layers,
                          "top_us_per_block": [(kn, t / args.layers) for kn, t in top]}
            log(f"  {name:6s} {total / args.layers:7.2f} us per block ({n / args.layers:.1f} kernels): "
                + ", ".join(f"{kn[:40]} {t / args.layers:.2f}" for kn, t in top[:5]))
        result["cases"].append(case)
    write_json(args.out, "moe_inputs.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
