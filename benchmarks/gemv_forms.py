#!/usr/bin/env python3
"""Decode-size matrix products y = x @ W^T (bf16 W stored [out, in], a few token rows) in two forms XLA compiles
differently, at the full-size model's shapes:
  * dot: an einsum with float32 sums (base.linear; XLA emits a Triton GEMM, split-K for narrow outputs such as
    out_proj's 2560 rows);
  * reduce: the products in float32 and their sum over K written as a multiply and a reduction (base.linear_by_sum,
    which base.linear_rows takes for one bf16 row on a GPU), which XLA emits as a row-reduction kernel reading W
    once per row of x;
  * kernel-BN:BK:W:S: jaxflash/kernels/gemv.py at the tiling block_n:block_k:warps:stages (--tiles).
Each shape is multiplied by L distinct weights in one jitted program (so L2 holds none of them); per product it
reports the GPU kernel time from a profiler trace, the kernels, the bytes of W and the fraction of 4.2 TB/s, and
the two forms' relative difference. The L products do not depend on each other, and XLA fuses the reductions of
several into one kernel (about 0.1 kernels per product on the H100), which the products of a decode step, each
waiting for the last, never allow: benchmarks/gdn_kernel.py measures the form inside GDN layers.

    python3 benchmarks/gemv_forms.py --out $OUT                   # on the GPU
    python3 benchmarks/gemv_forms.py --preset tiny --layers 2      # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import COPY_CEILING, log, rel_err, trace_kernels, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=24, help="distinct weights per shape in one program")
    ap.add_argument("--rows", default="1,8", help="comma-separated token rows")
    ap.add_argument("--tiles", default="8:1024:4:4,4:1024:4:4,16:512:4:4,8:2048:4:3,8:1024:8:4",
                    help="comma-separated gemv kernel tilings block_n:block_k:warps:stages ('' for none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxflash.kernels import gemv
    from jaxflash.model.base import linear, linear_by_sum
    from jaxflash.synthetic import make_config

    cfg = make_config(args.preset)
    h = cfg.hidden_size
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    in_rows = 2 * key_dim + 2 * value_dim + 2 * cfg.linear_num_value_heads  # qkv, z, b, a stacked
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"gdn_out_proj": (h, value_dim), "attn_o_proj": (h, nh * hd),
              "gdn_in_proj": (in_rows, h), "attn_qkv_proj": (nh * 2 * hd + 2 * nkv * hd, h),
              "router_shared": (cfg.num_experts + 2 * cfg.shared_expert_intermediate_size, h)}
    forms = {"dot": linear, "reduce": linear_by_sum}
    for v in filter(None, args.tiles.split(",")):
        tiles = gemv.Tiles(*(int(a) for a in v.split(":")))
        forms["kernel-" + v] = lambda x, w, tiles=tiles: gemv.linear(x, w, tiles=tiles)
    dev = jax.devices()[0]
    res = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "layers": args.layers, "runs": []}
    log(f"device {dev.device_kind}, jax {jax.__version__}; {args.layers} distinct weights per shape")
    key = jax.random.key(0)
    for name, (n, k) in shapes.items():
        key, kw = jax.random.split(key)
        ws = [w for w in jax.random.normal(kw, (args.layers, n, k), jnp.bfloat16) * 0.02]
        nbytes = n * k * 2
        for rows in (int(r) for r in args.rows.split(",")):
            key, kx = jax.random.split(key)
            x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
            outs = {}
            for form, f in forms.items():
                fn = jax.jit(lambda ws, x, f=f: [f(x, w) for w in ws])
                try:
                    outs[form] = fn(ws, x)
                except Exception as e:  # a tiling Triton cannot compile: say so, go on
                    log(f"  {name:14s} rows {rows}: {form}: failed: {str(e).splitlines()[0][:200]}")
                    res["runs"].append({"shape": name, "rows": rows, "form": form, "error": str(e)[:500]})
                    continue
                us, kernels = trace_kernels(fn, (ws, x), args.reps)
                wall = wall_us(fn, (ws, x), args.reps)
                per = max(us / args.layers, 1e-9)  # a CPU trace has no GPU kernels
                run = {"shape": name, "n": n, "k": k, "rows": rows, "form": form, "gpu_us": per,
                       "kernels": kernels / args.layers, "wall_us": wall / args.layers, "bytes": nbytes,
                       "tbps": nbytes / (per * 1e-6) / 1e12, "frac": nbytes / (per * 1e-6) / COPY_CEILING}
                res["runs"].append(run)
                log(f"  {name:14s} [{n:6d} x {k:5d}] rows {rows}: {form:6s} GPU {per:8.2f} us in "
                    f"{run['kernels']:.1f} kernels, {run['tbps']:.2f} TB/s ({run['frac'] * 100:.0f}% of 4.2), "
                    f"wall {run['wall_us']:.2f} us")
            for form, out in outs.items():
                if form != "dot":
                    err = rel_err(out, outs["dot"])
                    next(r for r in res["runs"] if r["shape"] == name and r["rows"] == rows
                         and r["form"] == form)["rel_diff_vs_dot"] = err
                    log(f"  {name:14s} rows {rows}: {form} vs dot, relative difference {err:.2e}")
    write_json(args.out, "gemv_forms.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
