#!/usr/bin/env python3
"""The NVFP4 expert kernels alone, both routes (Pallas: jaxflash/kernels/nvfp4_experts.py; CUDA: ffi/nvfp4_moe.cu
through jaxflash.ffi.nvfp4_moe), against their jnp twin, on full-size shapes.

For each case (batch 1, 4, 8; 4 rows of one sequence, as a speculative verify step) the script routes every row
to top-k of E experts per layer, runs L layers' routed experts chained in one jitted program (the output of
layer l feeds layer l+1, as in a decode step; each layer has its own weights, L x E experts, so nothing stays
in the 60 MB L2) and reports per layer:
  * wall: the program's wall time / L (XLA captures the whole program in one CUDA graph);
  * kernels: the summed GPU time of the expert kernels (or of the twin's fusions) from a profiler trace / L;
  * the distinct experts and NVFP4 bytes it must read, GB/s and the fraction of the copy ceiling.
It first checks numerics on the GPU (each route vs the twin vs a float64 numpy reference) and sweeps block
shapes (--sweep for the Pallas tiles, --cuda-sweep for the CUDA kernels' CudaTiles).

    python3 benchmarks/expert_kernel.py --out $OUT              # on the H200 (the CUDA route needs the package built)
    python3 benchmarks/expert_kernel.py --preset tiny --layers 2 --reps 2 --sweep none --cuda-sweep none
                                                                # CPU smoke run (interpret mode, CPU handler)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_timing import COPY_CEILING, log, rel_err  # noqa: E402


def random_experts(key, e: int, h: int, i: int):
    """Random NVFP4 experts on the device: every code (negative zero too), block scales 2^-6..2^2, global scales
    0.5..2."""
    import jax
    import jax.numpy as jnp

    from jaxflash.model.moe import NVFP4, Experts

    def one(k, n, kk):
        k1, k2, k3 = jax.random.split(k, 3)
        packed = jax.random.randint(k1, (e, n, kk // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jnp.exp2(jax.random.uniform(k2, (e, n, kk // 16), minval=-6, maxval=2)).astype(jnp.float8_e4m3fn)
        return NVFP4(packed, scale, jax.random.uniform(k3, (e,), minval=0.5, maxval=2.0))

    kg, ku, kd = jax.random.split(key, 3)
    return Experts(one(kg, i, h), one(ku, i, h), one(kd, h, i))


def as_records(layout, ex):
    """The same experts as ExpertLayout records uint8 [E, record_bytes] (the VRAM cache slot layout)."""
    import jax
    import jax.numpy as jnp

    def raw(a):
        a = a.reshape(a.shape[0], -1)
        if a.dtype == jnp.uint8:
            return a
        if a.dtype.itemsize == 1:
            return jax.lax.bitcast_convert_type(a, jnp.uint8)
        return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(a.shape[0], -1)

    parts = {"gate_up_weight": jnp.concatenate([raw(ex.gate.packed), raw(ex.up.packed)], 1),
             "down_weight": raw(ex.down.packed),
             "gate_up_scale": jnp.concatenate([raw(ex.gate.scale), raw(ex.up.scale)], 1),
             "down_scale": raw(ex.down.scale),
             "scale_2": raw(jnp.stack([ex.gate.scale2, ex.up.scale2, ex.down.scale2], 1))}
    cols, at = [], 0
    n = ex.gate.packed.shape[0]
    for name, sec in layout.sections.items():
        if sec.offset > at:
            cols.append(jnp.zeros((n, sec.offset - at), jnp.uint8))
        cols.append(parts[name])
        at = sec.offset + sec.nbytes
    cols.append(jnp.zeros((n, layout.record_bytes - at), jnp.uint8))
    return jnp.concatenate(cols, 1)


def f64_reference(ex, x, ids, w):
    """The routed sum in float64 numpy (bf16 rounding where the model rounds), for a few tokens."""
    import numpy as np

    from jaxflash import quant

    def deq(m, e):
        return quant.dequantize_nvfp4(np.asarray(m.packed[e]), np.asarray(m.scale[e]), np.asarray(m.scale2[e]))

    import ml_dtypes

    bf = lambda a: np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
    xs = np.asarray(x.astype(np.float32), np.float64)
    out = np.zeros((x.shape[0], ex.down.packed.shape[1]))
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            g = bf(deq(ex.gate, e).astype(np.float64) @ xs[n])
            u = bf(deq(ex.up, e).astype(np.float64) @ xs[n])
            a = bf(g / (1 + np.exp(-g)) * u)
            y = bf(deq(ex.down, e).astype(np.float64) @ a)
            out[n] += float(np.asarray(w[n, j], np.float32)) * y
    return out


def routing_ids(case: str, rows: int, layers: int, e: int, k: int, routing: str, seed: int):
    """ids [layers, rows, k]: rows are separate sequences (batch) or consecutive tokens of one (verify)."""
    import numpy as np

    if routing == "uniform":
        rng = np.random.default_rng(seed)
        return np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(rows)]) for _ in range(layers)]
                        ).astype(np.int32)
    from routing import RoutingModel

    model = RoutingModel(num_layers=layers, num_experts=e, top_k=k, seed=seed)
    if case == "verify":
        ids, _ = model.sample(64 + rows, streams=1)  # [1, T, L, k]: the last `rows` tokens of one stream
        return np.transpose(ids[0, -rows:], (1, 0, 2)).astype(np.int32)
    ids, _ = model.sample(64, streams=rows)  # [S, T, L, k]: token 63 of each stream
    return np.transpose(ids[:, -1], (1, 0, 2)).astype(np.int32)


def kernel_time_us(events: list[dict], match) -> tuple[float, int]:
    """Summed duration (us) and count of the GPU kernel events whose name satisfies `match`."""
    ev = [e for e in events if match(e.get("name", ""))]
    return sum(float(e.get("dur", 0)) for e in ev), len(ev)


def graph_ids(events: list[dict], match) -> dict:
    """How many of the matching kernels carry a CUDA graph id in the trace (an arg whose name mentions
    'graph'), and the arg names seen: whether the kernels ran inside the program's command buffer."""
    ev = [e for e in events if match(e.get("name", ""))]
    keys = sorted({k for e in ev for k in (e.get("args") or {})})
    graphed = sum(1 for e in ev if any("graph" in k.lower() and str(v) not in ("", "0")
                                       for k, v in (e.get("args") or {}).items()))
    return {"kernels": len(ev), "with_graph_id": graphed, "arg_names": keys}


def pallas_tiles(g: tuple):
    """nvfp4_experts.Tiles of a sweep entry: (rows_gu, chunk_gu, warps_gu, rows_down, chunk_down, warps_down
    [, unroll[, math[, x_scale]]]); the fields left out keep their defaults."""
    from jaxflash.kernels import nvfp4_experts as K

    d = K.Tiles()
    return K.Tiles(rows_gu=g[0], chunk_gu=g[1], warps_gu=g[2], rows_down=g[3], chunk_down=g[4], warps_down=g[5],
                   unroll=g[6] if len(g) > 6 else d.unroll, math=g[7] if len(g) > 7 else d.math,
                   x_scale=g[8] if len(g) > 8 else d.x_scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=12, help="distinct layers chained in one program")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--routing", default="calibrated", choices=["calibrated", "uniform"])
    ap.add_argument("--cases", default="b1,b4,b8,verify4")
    ap.add_argument("--impls", default="pallas,cuda", help="comma-separated: pallas, cuda, twin (the table's rows)")
    ap.add_argument("--cuda-sweep", default="default",
                    help="'default' (one change at a time from the defaults, at batch 1 and 8), 'none', or "
                         "lanes_gu:lanes_down:threads_gu:threads_down:stages:blocks_gu:blocks_down:prefetch;... "
                         "(0 lanes, 0 blocks: automatic)")
    ap.add_argument("--sweep", default="none",
                    help="'default' (a small tile grid at batch 1 and 8), 'none', or rows_gu:chunk_gu:warps_gu:"
                         "rows_down:chunk_down:warps_down[:unroll[:math[:x_scale]]];... (math: f32, f16x2, "
                         "auto; x_scale: chunk, row)")
    ap.add_argument("--sweep-budget", type=float, default=300,
                    help="seconds for the sweep: configurations left when it is spent are skipped (and listed)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.ffi.experts import ExpertLayout
    from jaxflash.ffi.nvfp4_moe import CudaTiles
    from jaxflash.kernels import nvfp4_experts as K
    from jaxflash.model.moe import experts_gather

    out_dir = args.out or tempfile.mkdtemp(prefix="jaxflash_expert_kernel_")
    os.makedirs(out_dir, exist_ok=True)
    dev = jax.devices()[0]
    if args.preset == "full":
        E, H, I, k = 512, 2560, 640, 10
    else:
        E, H, I, k = 16, 64, 32, 4
    L = args.layers
    res = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "shape": {"experts": E, "hidden": H, "inter": I, "top_k": k},
           "layers": L, "routing": args.routing, "reps": args.reps, "copy_ceiling": COPY_CEILING}
    log(f"device {dev.device_kind}, jax {jax.__version__}; E={E} H={H} I={I} top-{k}; {L} layers chained; "
        f"routing {args.routing}")
    layout = ExpertLayout("nvfp4", H, I)

    # ---- weights: L layers of E experts, on the device ------------------------------------------------------
    t0 = time.perf_counter()
    keys = jax.random.split(jax.random.key(args.seed), L)
    layers = [random_experts(kk, E, H, I) for kk in keys]
    jax.block_until_ready(layers)
    log(f"weights: {L} x {E} experts, {L * E * K.kernel_bytes(K.resident_operands(layers[0])[0], 1) / 2**30:.1f} "
        f"GiB ({time.perf_counter() - t0:.1f} s)")

    # ---- the copy ceiling -----------------------------------------------------------------------------------
    if dev.platform == "gpu":
        buf = jnp.ones((2**30,), jnp.float32)  # 4 GiB
        cp = jax.jit(lambda a: a * 1.0001)
        cp(buf).block_until_ready()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            cp(buf).block_until_ready()
            ts.append(time.perf_counter() - t)
        res["copy_tbps"] = 2 * buf.nbytes / min(ts) / 1e12
        log(f"copy ceiling (read + write, best of 10): {res['copy_tbps']:.2f} TB/s")
        del buf

    # ---- numerics on this device -------------------------------------------------------------------------------
    rng = np.random.default_rng(args.seed)
    num = {}
    for n_tok in (1, 3, 8):
        ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n_tok)]), jnp.int32)
        if n_tok == 8:
            ids = ids.at[5].set(ids[0]).at[6, :3].set(ids[1, :3])  # shared experts, partial and whole
        x = jnp.asarray(rng.normal(size=(n_tok, H)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(size=(n_tok, k)) / k, jnp.bfloat16)
        ex = layers[0]
        twin = jax.jit(experts_gather)(ex, x, ids, w)
        place, ops = K.resident_operands(ex)
        rec = as_records(layout, ex)
        rplace, rops = K.record_operands(layout, rec)
        ref = f64_reference(ex, x, np.asarray(ids), w) if n_tok <= 3 else None
        r = {}
        for math in ("f32", "f16x2", "cuda"):  # the Pallas kernels' two product paths, and the CUDA route
            t = K.Tiles(math=math if math != "cuda" else "auto")
            route = "cuda" if math == "cuda" else "pallas"
            try:
                kern = jax.jit(lambda ops, x, ids, w: K.routed_experts(place, ops, x, ids, w, t, route=route))(
                    ops, x, ids, w)
                kern_rec = jax.jit(lambda ops, x, ids, w: K.routed_experts(rplace, ops, x, ids, w, t, route=route))(
                    rops, x, ids, w)
            except Exception as exc:  # reported, and the run goes on (the sweep reports it per configuration)
                r[f"{math}_error"] = "".join(traceback.format_exception_only(type(exc), exc))[-600:]
                continue
            r.update({f"{math}_vs_twin": rel_err(kern, twin), f"{math}_records_vs_resident": rel_err(kern_rec, kern),
                      f"{math}_finite": bool(np.isfinite(np.asarray(kern)).all())})
            if ref is not None:
                r[f"{math}_vs_f64"] = rel_err(kern, ref)
        if ref is not None:
            r["twin_vs_f64"] = rel_err(twin, ref)
        num[f"n{n_tok}"] = r
        log(f"numerics, {n_tok} tokens: " + ", ".join(f"{a} {b:.2e}" if isinstance(b, float) else f"{a} {b}"
                                                     for a, b in r.items()))
    res["numerics"] = num

    # ---- timing ------------------------------------------------------------------------------------------------
    ops_layers = [K.resident_operands(ex)[1] for ex in layers]
    place = K.resident_operands(layers[0])[0]

    def chained(impl, tiles):
        def run(ops_layers, x, ids, w):
            for l in range(L):
                if impl == "pallas":
                    y = K.routed_experts(place, ops_layers[l], x, ids[l], w[l], tiles, route="pallas")
                elif impl == "cuda":
                    y = K.routed_experts(place, ops_layers[l], x, ids[l], w[l], route="cuda", cuda_tiles=tiles)
                else:
                    y = experts_gather(ops_layers[l], x, ids[l], w[l])  # here: the NVFP4 pytrees
                x = (x.astype(jnp.float32) + 1e-3 * y).astype(x.dtype)
            return x
        return jax.jit(run)

    def measure(impl, tiles, rows, ids_np, trace=True):
        x = jnp.asarray(rng.normal(size=(rows, H)), jnp.bfloat16)
        w = jnp.asarray(rng.uniform(size=(L, rows, k)) / k, jnp.bfloat16)
        ids = jnp.asarray(ids_np)
        fn = chained(impl, tiles)
        arg0 = layers if impl == "twin" else ops_layers  # the twin reads the NVFP4 pytrees themselves
        t = time.perf_counter()
        fn(arg0, x, ids, w).block_until_ready()
        compile_s = time.perf_counter() - t
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            fn(arg0, x, ids, w).block_until_ready()
            ts.append(time.perf_counter() - t)
        out = {"wall_us": statistics.median(ts) / L * 1e6, "compile_s": compile_s}
        if trace and dev.platform == "gpu":
            tdir = tempfile.mkdtemp(prefix="trace_")
            with jax.profiler.trace(tdir, create_perfetto_trace=True):
                for _ in range(3):
                    fn(arg0, x, ids, w).block_until_ready()
            from trace_parts import gpu_kernels

            events = gpu_kernels(tdir)  # read and parse the trace once for every figure below
            names = {"pallas": ("nvfp4_gate_up", "nvfp4_down"), "cuda": ("nvfp4_moe_gate_up", "nvfp4_moe_down")}
            match = (lambda n: "nvfp4" in n) if impl != "twin" else (lambda n: True)
            us, cnt = kernel_time_us(events, match)
            allk, allc = kernel_time_us(events, lambda n: True)
            if impl != "twin":
                gu, dn = names[impl]
                out["graph"] = graph_ids(events, match)
                out["launch"] = sorted({str((ev.get("args") or {}).get("kernel_details", ""))
                                        for ev in events if match(ev.get("name", ""))})
                out["gate_up_us"] = kernel_time_us(events, lambda n: gu in n)[0] / 3 / L
                out["down_us"] = kernel_time_us(events, lambda n: dn in n)[0] / 3 / L
            out.update(kernels_us=us / 3 / L, kernels_per_layer=cnt / 3 / L, all_kernels_us=allk / 3 / L,
                       all_kernels_per_layer=allc / 3 / L)
        return out

    def distinct(ids_np):
        return float(np.mean([len(np.unique(ids_np[l])) for l in range(ids_np.shape[0])]))

    def describe(r, ids_np):
        d = distinct(ids_np)
        nbytes = d * K.kernel_bytes(place, 1)
        t_us = r.get("kernels_us", r["wall_us"])
        r.update(distinct=d, bytes=nbytes, floor_us=nbytes / COPY_CEILING * 1e6,
                 gbps=nbytes / (t_us * 1e-6) / 1e9, frac=nbytes / (t_us * 1e-6) / COPY_CEILING,
                 wall_frac=nbytes / (r["wall_us"] * 1e-6) / COPY_CEILING)
        return r

    cases = {}
    for c in args.cases.split(","):
        rows = int(c[1:]) if c.startswith("b") else int(c[len("verify"):])
        cases[c] = (rows, routing_ids("verify" if c.startswith("verify") else "batch", rows, L, E, k,
                                      args.routing, args.seed))

    # Pallas tile sweep
    if args.sweep == "default":
        # rows_gu, chunk_gu, warps_gu, rows_down, chunk_down, warps_down, unroll
        # (unrolled walks were slower and compile slowly: benchmarks/RESULTS.md)
        # (the first rows: the default, its input scale per row, its float32 products)
        grid = [(32, 256, 8, 8, 64, 1, 0, "f16x2", "chunk"), (32, 256, 8, 8, 64, 1, 0, "f16x2", "row"),
                (32, 256, 8, 8, 64, 1, 0, "f32"), (8, 256, 4, 8, 64, 1, 0, "f16x2", "row"),
                (16, 256, 4, 16, 64, 2, 0, "f16x2", "row"), (64, 256, 8, 8, 64, 1, 0, "f16x2", "row"),
                (32, 256, 4, 4, 64, 1, 0, "f16x2", "row"), (32, 256, 8, 8, 32, 1, 0, "f16x2", "row")]
    elif args.sweep == "none":
        grid = []  # the default tiles, measured in the table
    else:
        grid = [tuple(int(v) if v.isdigit() else v for v in s.split(":")) for s in args.sweep.split(";")]
    sweep_cases = [c for c in ("b1", "b8") if c in cases] or list(cases)[:1]
    sweep = []

    def run_sweep(impl: str, configs: list, deadline: float = float("inf")):
        """Measure each block-shape configuration of `impl` on the sweep cases; the best per case."""
        best = {}
        for tiles in configs:
            if time.perf_counter() > deadline:
                log(f"{impl} sweep {tiles}: skipped (the {args.sweep_budget:.0f} s sweep budget is spent)")
                sweep.append({"skipped": True, "impl": impl, "tiles": dataclasses.asdict(tiles)})
                continue
            for c in sweep_cases:
                rows, ids_np = cases[c]
                try:
                    r = describe(measure(impl, tiles, rows, ids_np), ids_np)
                except Exception as exc:  # a configuration that does not compile is reported, not fatal
                    r = {"error": "".join(traceback.format_exception_only(type(exc), exc))[-600:]}
                r.update(case=c, impl=impl, tiles=dataclasses.asdict(tiles))
                sweep.append(r)
                if "error" in r:
                    log(f"{impl} sweep {tiles} {c}: ERROR {r['error'][:300]}")
                    continue
                log(f"{impl} sweep {tiles} {c}: kernels {r.get('kernels_us', float('nan')):.1f} us/layer (gate_up "
                    f"{r.get('gate_up_us', float('nan')):.1f}, down {r.get('down_us', float('nan')):.1f}), wall "
                    f"{r['wall_us']:.1f} us/layer, all kernels {r.get('all_kernels_us', float('nan')):.1f} us/layer, "
                    f"{r['frac'] * 100:.0f}% of copy ceiling; launches {r.get('launch')}")
                # every kernel of the chain: a form whose inputs are prepared by XLA fusions pays for them here
                # (the chain's own fusions are the same in every configuration)
                key = r.get("all_kernels_us", r["wall_us"])
                if c not in best or key < best[c][0]:
                    best[c] = (key, tiles)
        return best

    best = run_sweep("pallas", [pallas_tiles(g) for g in grid], time.perf_counter() + args.sweep_budget)
    chosen = best.get("b1", (None, K.Tiles()))[1]
    res["chosen_tiles"] = dataclasses.asdict(chosen)
    log(f"chosen Pallas tiles (best at batch 1): {chosen}")

    # CUDA block shapes: each variant changes one thing from the defaults
    if args.cuda_sweep == "default":
        cgrid = [CudaTiles(), CudaTiles(prefetch=True), CudaTiles(stages=1), CudaTiles(stages=3),
                 CudaTiles(threads_gu=128), CudaTiles(threads_gu=512), CudaTiles(threads_down=128),
                 CudaTiles(threads_down=512), CudaTiles(lanes_down=8), CudaTiles(lanes_gu=32)]
    elif args.cuda_sweep == "none":
        cgrid = []
    else:
        cgrid = [CudaTiles(*(int(v) for v in s.split(":")[:7]), bool(int(s.split(":")[7])))
                 for s in args.cuda_sweep.split(";")]
    cbest = run_sweep("cuda", cgrid if "cuda" in args.impls.split(",") else [])
    cchosen = cbest.get("b1", (None, CudaTiles()))[1]
    res["chosen_cuda_tiles"] = dataclasses.asdict(cchosen)
    log(f"chosen CUDA tiles (best at batch 1): {cchosen}")
    res["sweep"] = sweep

    # the table
    table = []
    for c, (rows, ids_np) in cases.items():
        for impl in args.impls.split(","):
            if impl == "pallas" and rows > K.MAX_TOKENS:
                continue
            try:
                r = describe(measure(impl, cchosen if impl == "cuda" else chosen, rows, ids_np), ids_np)
            except Exception as exc:
                r = {"error": "".join(traceback.format_exception_only(type(exc), exc))[-600:]}
            r.update(case=c, impl=impl, rows=rows)
            table.append(r)
    res["table"] = table

    with open(os.path.join(out_dir, "expert_kernel.json"), "w") as f:
        json.dump(res, f, indent=1)
    log("")
    log(f"{'case':8} {'impl':6} {'distinct':>8} {'MB':>6} {'floor us':>8} {'kern us':>8} {'gate_up':>8} "
        f"{'down':>6} {'wall us':>8} {'GB/s':>6} {'%ceil':>6} {'k/layer':>7} {'all us':>7}")
    for r in table:
        if "error" in r:
            log(f"{r['case']:8} {r['impl']:6} ERROR {r['error'][:200]}")
            continue
        log(f"{r['case']:8} {r['impl']:6} {r['distinct']:8.1f} {r['bytes'] / 1e6:6.1f} {r['floor_us']:8.2f} "
            f"{r.get('kernels_us', float('nan')):8.2f} {r.get('gate_up_us', float('nan')):8.2f} "
            f"{r.get('down_us', float('nan')):6.2f} {r['wall_us']:8.2f} {r['gbps']:6.0f} {r['frac'] * 100:5.0f}% "
            f"{r.get('all_kernels_per_layer', float('nan')):7.1f} {r.get('all_kernels_us', float('nan')):7.2f}")
    for r in table:
        if "graph" in r:
            g = r["graph"]
            log(f"{r['case']}: {g['with_graph_id']} of {g['kernels']} expert kernels carry a CUDA graph id "
                f"(trace args: {', '.join(g['arg_names'])})")
    log(f"per layer; x48 layers for a decode step. Results: {out_dir}/expert_kernel.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
