#!/usr/bin/env python3
"""The grouped NVFP4 kernels of prefill chunks (jaxflash/kernels/nvfp4_grouped.py) alone, on full-size shapes,
against the tiled jnp path they replace (moe.experts_tiled: weights gathered and dequantised per tile).

For each chunk size C it routes C tokens to top-k of E experts per layer (calibrated routing from
benchmarks/routing.py's model, or uniform), runs L layers' routed experts chained in one jitted program (each
layer its own E experts, so nothing stays in L2) and reports per layer:
  * the GPU kernel time of the program / L from a profiler trace (every kernel: sorting, the kernels, the sums),
    and its wall time / L;
  * the live tiles, the distinct experts and the NVFP4 bytes they hold, the floor those bytes need at 4.2 TB/s;
  * the tensor-core work of the live tiles (2 x rows x 3 x H x I per tile) and the TFLOP/s it runs at.
First it checks the kernels against the twin at the largest C (max |diff| / max |twin|).

    python3 benchmarks/grouped_kernel.py --out $OUT                                  # on the H200
    python3 benchmarks/grouped_kernel.py --preset tiny --chunks 16,64 --layers 2     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_kernel import random_experts  # noqa: E402
from kernel_timing import COPY_CEILING, log, rel_err, trace_kernels, wall_us  # noqa: E402


def chunk_ids(c: int, layers: int, e: int, k: int, routing: str, seed: int):
    """ids [layers, C, k]: C consecutive tokens of one stream."""
    import numpy as np

    if routing == "uniform":
        rng = np.random.default_rng(seed)
        return np.stack([np.argsort(rng.random((c, e)), axis=1)[:, :k] for _ in range(layers)]).astype(np.int32)
    from routing import RoutingModel

    ids, _ = RoutingModel(num_layers=layers, num_experts=e, top_k=k, seed=seed).sample(c, streams=1)
    return np.transpose(ids[0], (1, 0, 2)).astype(np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--chunks", default="256,1024,2048,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--routing", default="calibrated", choices=["calibrated", "uniform"])
    ap.add_argument("--impls", default="grouped,tiled")
    ap.add_argument("--sweep", default="",
                    help="grouped-kernel tiles to time as well, ';'-separated tile:rows_gu:bytes_gu:rows_down:"
                         "bytes_down:warps:stages (tile: rows per tile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.kernels import nvfp4_experts
    from jaxflash.model import moe
    from jaxflash.synthetic import make_config

    cfg = make_config(args.preset)
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    dev = jax.devices()[0]
    out_dir = args.out or tempfile.mkdtemp(prefix="jaxflash_grouped_")
    os.makedirs(out_dir, exist_ok=True)
    res = {"device": str(dev.device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "routing": args.routing, "layers": args.layers, "shapes": dict(H=h, I=i, E=e, k=k),
           "cases": []}
    log(f"{dev.device_kind}, jax {jax.__version__}; H={h} I={i} E={e} top-{k}; {args.layers} layers chained; "
        f"{args.routing} routing")
    keys = jax.random.split(jax.random.PRNGKey(args.seed), args.layers)
    experts = [random_experts(kk, e, h, i) for kk in keys]
    jax.block_until_ready(experts)
    from functools import partial

    from jaxflash.kernels.nvfp4_grouped import GroupTiles

    paths = {"grouped": moe.experts_grouped, "tiled": moe.experts_tiled}
    impls = args.impls.split(",")
    for spec in filter(None, args.sweep.split(";")):
        tile, *t = (int(v) for v in spec.split(":"))
        paths[f"grouped[{spec}]"] = partial(moe.experts_grouped, tile=tile, tiles=GroupTiles(*t))
        impls.append(f"grouped[{spec}]")
    tile_of = lambda impl: int(impl[8:-1].split(":")[0]) if impl.startswith("grouped[") else moe.GROUP_TILE  # noqa

    def chained(fn):
        @jax.jit
        def run(exs, x, ids, w):
            for layer, ex in enumerate(exs):
                x = (fn(ex, x, ids[layer], w[layer]) + x.astype(jnp.float32)).astype(x.dtype)
            return x
        return run

    chunks = [int(c) for c in args.chunks.split(",")]
    for c in chunks:
        ids_np = chunk_ids(c, args.layers, e, k, args.routing, args.seed)
        rng = np.random.default_rng(c)
        x = jnp.asarray(rng.normal(size=(c, h)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(size=(args.layers, c, k)), jnp.bfloat16)
        ids = jnp.asarray(ids_np)
        counts = [np.bincount(ids_np[l].reshape(-1), minlength=e) for l in range(args.layers)]
        distinct = float(np.mean([(cn > 0).sum() for cn in counts]))
        live_tiles = float(np.mean([np.sum(-(-cn // moe.GROUP_TILE)) for cn in counts]))
        nbytes = nvfp4_experts.kernel_bytes(nvfp4_experts.resident_operands(experts[0])[0], 1) * distinct
        flops = 2 * live_tiles * moe.GROUP_TILE * 3 * h * i
        case = {"chunk": c, "distinct_experts": distinct, "live_tiles": live_tiles,
                "nvfp4_mb": nbytes / 1e6, "floor_us": nbytes / COPY_CEILING * 1e6, "tile_tflop": flops / 1e12}
        if c == chunks[-1] and "grouped" in impls and "tiled" in impls:
            one = lambda fn: jax.jit(fn)(experts[0], x, ids[0], w[0])  # noqa: E731
            case["rel_err_vs_tiled"] = rel_err(one(moe.experts_grouped), one(moe.experts_tiled))
        for impl in impls:
            run = chained(paths[impl])
            try:
                us, n = trace_kernels(run, (experts, x, ids, w), args.reps)
                wall = wall_us(run, (experts, x, ids, w), args.reps)
            except Exception as ex:  # noqa: BLE001 -- an impl that does not fit is reported, not fatal
                case[impl] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
                log(f"C={c} {impl}: {case[impl]['error']}")
                continue
            per = (us or wall) / args.layers  # no GPU kernels in the trace (CPU): the wall time
            tl = tile_of(impl)
            flops = 2 * float(np.mean([np.sum(-(-cn // tl)) for cn in counts])) * tl * 3 * h * i
            case[impl] = {"us_per_layer": per, "wall_us_per_layer": wall / args.layers,
                          "kernels_per_layer": n / args.layers,
                          "tflops": flops / (per * 1e-6) / 1e12, "tokens_per_s_per_layer": c / (per * 1e-6)}
            log(f"C={c:5d} {impl:30s} {per:9.1f} us/layer ({n / args.layers:.0f} kernels)  "
                f"{case[impl]['tflops']:6.1f} TFLOP/s on live tiles  floor {case['floor_us']:.1f} us "
                f"({per / case['floor_us']:.1f}x)  distinct {distinct:.0f}, live tiles {live_tiles:.0f}")
        res["cases"].append(case)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
    if "rel_err_vs_tiled" in res["cases"][-1]:
        log(f"grouped vs tiled at C={chunks[-1]}: max|diff|/max|tiled| = {res['cases'][-1]['rel_err_vs_tiled']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
