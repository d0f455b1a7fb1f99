#!/usr/bin/env python3
"""Decode speed of the engine on the full-size model (SPEC.md section 1), experts on the host under a VRAM
budget and all experts on the device, with the step time split by part.

The model is seeded random (jaxflash.synthetic.SyntheticSource), built in memory: dense weights generated, the
routed experts generated for `--distinct-layers` layers and copied to the others (their bytes do not change the
timing; each layer keeps its own random router, so routing differs per layer). Random routers route close to
uniformly, which real ones do not: the hit rate printed beside each figure is what this routing gives. The
n-gram table is shrunk by --ngram-rows-scale and written to a file that the PLE host step memory-maps.

The breakdown comes from ablated variants of the same compiled step (StepContext.skip), timed on the same
state: gather = full - no-gather; routed experts (router, resolve, matmuls) = no-gather - no-routed;
attention/GDN = no-routed - no-routed-no-mixers; rest (embedding, hyper-connections, shared experts, PLE,
lm_head, sampling) = the last variant.

    python benchmarks/decode.py --budget 32GiB --modes host,device --out DIR        # on the GPU
    python benchmarks/decode.py --preset small --modes host,device --steps 8         # a CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

VARIANTS = {  # name -> parts left out
    "full": frozenset(),
    "no-gather": frozenset({"gather"}),
    "no-routed": frozenset({"gather", "routed"}),
    "no-routed-no-mixers": frozenset({"gather", "routed", "mixers"}),
}


def fill_pool(pool, src, cfg, distinct: int, log) -> None:
    """Expert records of the first `distinct` layers from the synthetic source; the rest copy them."""
    import numpy as np

    arr = pool.array
    for layer in range(cfg.num_hidden_layers):
        t0 = time.perf_counter()
        if layer < distinct:
            stacks = {proj: src.expert_stack(layer, proj) for proj in ("gate_proj", "up_proj", "down_proj")}
            for slot in pool.layout.tensors:
                proj, suffix = slot.suffix.split(".", 1)
                data = np.ascontiguousarray(np.asarray(stacks[proj][suffix], slot.dtype))
                arr[layer, :, slot.offset : slot.offset + slot.nbytes] = data.reshape(cfg.num_experts, -1).view(
                    np.uint8)
        else:
            arr[layer] = arr[layer % distinct]
        if layer < distinct or layer == cfg.num_hidden_layers - 1:
            log(f"  pool layer {layer + 1}/{cfg.num_hidden_layers} ({time.perf_counter() - t0:.1f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--modes", default="host,device", help="comma-separated: host (budgeted), device")
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (aggregate tok/s)")
    ap.add_argument("--long-prompt", type=int, default=0, help="also time the prefill of one prompt this long")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--ablation-steps", type=int, default=16, help="timed steps per ablated variant (0: none)")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash import ffi
    from jaxflash.engine import Engine, planner
    from jaxflash.engine import step as step_mod
    from jaxflash.model.weights import load_params
    from jaxflash.synthetic import SyntheticSource, make_config

    def log(msg):
        print(msg, flush=True)

    cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale).replace(mtp_num_hidden_layers=0)
    dev = jax.devices()[0]
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "preset": args.preset, "dtype": args.dtype,
           "prompt_tokens": args.prompt, "batch": args.batch, "steps": args.steps, "max_seq_len": args.max_seq_len, "modes": {}}
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; preset {args.preset}: "
        f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, {args.dtype}")

    src = SyntheticSource(cfg, seed=args.seed)
    t0 = time.perf_counter()
    params = load_params(src, cfg, args.dtype, routed_experts=False)
    jax.block_until_ready(params)
    dense = sum(x.nbytes for x in jax.tree.leaves(params))
    log(f"dense weights: {dense / 2**30:.2f} GiB on the device ({time.perf_counter() - t0:.0f} s)")

    layout = ffi.ExpertLayout.from_config(cfg, "nvfp4")
    t0 = time.perf_counter()
    pool = ffi.ExpertPool(layout, cfg.num_hidden_layers, cfg.num_experts)
    fill_pool(pool, src, cfg, min(args.distinct_layers, cfg.num_hidden_layers), log)
    log(f"expert pool: {pool.nbytes / 2**30:.2f} GiB on the host, pinned={pool.pinned} "
        f"({time.perf_counter() - t0:.0f} s)")
    res["pool_gib"], res["pool_pinned"], res["dense_gib"] = pool.nbytes / 2**30, pool.pinned, dense / 2**30

    tmp = tempfile.mkdtemp(prefix="jaxflash_ngram_")
    table_np = src.ngram_table()
    path = os.path.join(tmp, "ngram.bin")
    with open(path, "wb") as f:
        for shard in table_np.shards:
            f.write(np.ascontiguousarray(shard).tobytes())
    table = ffi.NgramTable([(path, 0, table_np.rows)], head_dim=table_np.dim, dtype=table_np.dtype,
                           heads=cfg.num_ngram_heads, max_tokens=max(256, args.prompt))
    ngram = (table, table_np.scale)

    rng = np.random.default_rng(1)
    prompts = [[int(x) for x in rng.integers(0, cfg.vocab_size, args.prompt)] for _ in range(args.batch)]
    prompt = prompts[0]
    mb = planner.ModelBytes(dense, pool.nbytes, layout.record_bytes)

    for mode in args.modes.split(","):
        log(f"--- experts on the {mode}")
        free, note = planner.device_free_bytes(dev)
        plan = planner.plan(cfg, mb, residency=mode, budget=planner.parse_bytes(args.budget) if mode == "host" else None,
                            free=free, free_note=note, max_batch=args.batch, max_seq_len=args.max_seq_len,
                            prefill_chunk=256, dtype_bytes=jnp.dtype(args.dtype).itemsize)
        for n in plan.notes:
            log("  plan: " + n)
        p, host = params, None
        if mode == "device":
            t0 = time.perf_counter()
            layers = []
            for i, layer in enumerate(params.layers):
                recs = jax.device_put(pool.array[i])  # [E, R] records; the compute views them as NVFP4
                ex = step_mod.records_as_experts(layout, recs)
                layers.append(dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, experts=ex)))
            p = dataclasses.replace(params, layers=tuple(layers))
            jax.block_until_ready(p)
            log(f"  experts copied to the device ({time.perf_counter() - t0:.0f} s)")
        else:
            host = step_mod.HostExperts(pool, layout, plan.cache_slots, plan.staging_slots)
        engine = Engine(cfg, p, plan=plan, host_experts=host, ngram=ngram)
        t0 = time.perf_counter()
        engine.generate([prompt], max_new_tokens=2, ignore_eos=True)  # compiles prefill + decode
        compile_s = time.perf_counter() - t0
        log(f"  compiled and warmed in {compile_s:.0f} s")
        gen = engine.generator
        gen.stats = type(gen.stats)()
        firsts, stamps = {}, []
        t0 = time.perf_counter()
        for i, tok in engine.generate_stream(prompts, args.steps + 1, ignore_eos=True):
            if tok is not None:
                stamps.append(time.perf_counter())
                firsts.setdefault(i, stamps[-1])
        end = time.perf_counter()
        n_out = len(stamps)
        ttft = min(firsts.values()) - t0
        decode_from = max(firsts.values())  # every prompt admitted: from here on, full-batch decode steps
        decode_tokens = sum(t > decode_from for t in stamps)
        st = gen.stats
        step_s = (end - decode_from) / max(1, decode_tokens / len(prompts))
        run = {"plan": plan.summary(), "cache_slots": plan.cache_slots, "compile_s": compile_s, "batch": args.batch,
               "ttft_s": ttft, "step_ms": step_s * 1e3, "tok_s": decode_tokens / (end - decode_from),
               "hit_rate": st.hit_rate, "tokens": n_out, "decode_steps": st.decode_steps}
        if st.hit_rate is not None:
            misses_per_step = st.expert_misses / max(1, st.decode_steps)
            run["misses_per_step"] = misses_per_step
            run["miss_gb_per_step"] = misses_per_step * layout.record_bytes / 1e9
        log(f"  decode: {run['tok_s']:.1f} tok/s over {args.batch} sequence(s) ({run['step_ms']:.2f} ms/step, "
            f"{st.decode_steps} steps); prompt {args.prompt} tokens -> first token {ttft * 1e3:.0f} ms"
            + (f"; hit rate {st.hit_rate:.1%}, {run['misses_per_step']:.0f} misses/step = "
               f"{run['miss_gb_per_step']:.2f} GB/step over PCIe" if st.hit_rate is not None else ""))
        if args.long_prompt:
            long = [int(x) for x in rng.integers(0, cfg.vocab_size, args.long_prompt)]
            t0 = time.perf_counter()
            engine.generate([long], max_new_tokens=1, ignore_eos=True)
            run["long_prompt"] = {"tokens": args.long_prompt, "ttft_s": time.perf_counter() - t0}
            run["long_prompt"]["prefill_tok_s"] = args.long_prompt / run["long_prompt"]["ttft_s"]
            log(f"  prefill: {args.long_prompt} tokens -> first token in {run['long_prompt']['ttft_s']:.2f} s "
                f"({run['long_prompt']['prefill_tok_s']:.0f} tok/s, chunks of {plan.prefill_chunk})")

        if args.ablation_steps and args.batch == 1:
            names = [v for v in VARIANTS if not (mode == "device" and v == "no-gather")]
            fns = {}
            for v in names:
                ctx = engine.step_context(VARIANTS[v])
                fns[v] = jax.jit(lambda pp, s, ctx=ctx: step_mod.decode_step(pp, ctx, s), donate_argnums=1)
            # one live sequence in the generator's state: admit, prefill, then time each variant's steps on it
            (req,) = gen.make_requests([prompt], max_new_tokens=10_000, temperature=0.0, top_p=1.0, top_k=0,
                                       min_p=0.0, seed=0, stop=None, eos_ids=(), ignore_eos=True)
            req.max_new_tokens = min(req.max_new_tokens, args.max_seq_len - args.prompt - 1)
            gen._admit_one(req)
            gen._prefill_all(req)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(len(fns)) as ex:  # compile the variants side by side
                compiled = dict(zip(fns, ex.map(lambda v, p=p, st=gen.state: fns[v].lower(p, st).compile(), fns)))
            log(f"  ablation variants compiled in {time.perf_counter() - t0:.0f} s")
            times = {}
            for v in names:
                fn = compiled[v]
                gen.state, tok, _ = fn(p, gen.state)
                jax.block_until_ready(tok)
                t0 = time.perf_counter()
                for _ in range(args.ablation_steps):
                    gen.state, tok, _ = fn(p, gen.state)
                    np.asarray(tok)  # the per-step read-back, as in generation
                times[v] = (time.perf_counter() - t0) / args.ablation_steps * 1e3
            gen._free(req)
            parts = {"gather": times["full"] - times.get("no-gather", times["full"]),
                     "routed experts": times.get("no-gather", times["full"]) - times["no-routed"],
                     "attention/GDN": times["no-routed"] - times["no-routed-no-mixers"],
                     "rest": times["no-routed-no-mixers"]}
            run["variants_ms"], run["breakdown_ms"] = times, parts
            log("  step variants (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
            log("  breakdown (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        res["modes"][mode] = run
        if args.out:  # after each mode, so a run cut short keeps what it measured
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(res, f, indent=2)
        del engine, gen, p
        import gc

        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
