#!/usr/bin/env python3
"""Decode speed of the engine on the full-size model (docs/model.md, "Dimensions"): experts on the host under
a VRAM budget and all on the device, one or more batch sizes, with the routers' own routing or a routing
calibrated to real text; each step's GPU time split by part from a profiler trace.

The model is seeded random (jaxflash.synthetic.SyntheticSource), built in memory: dense weights generated, the
routed experts generated for `--distinct-layers` layers and copied to the others (their bytes do not change the
timing; each layer keeps its own random router). The n-gram table is shrunk by --ngram-rows-scale and written
to a file that the PLE host step memory-maps.

Routing (--routing):
  model       the random routers' top-k: close to uniform over the experts, so few cache hits;
  calibrated  expert ids drawn from benchmarks/routing.py's model of the real model's routing on real text
              (skewed popularity, temporal reuse), fed to the engine through its RoutingSource (each batch
              slot is one stream); the routers still run and weight those experts.

For every configuration (residency x batch x routing) it reports: decode tok/s, the step time (wall clock,
steady state), the dispatch cost per step (host time inside the runner's decode call), the GPU busy time per
step and the ratio step / busy, kernels per step and their share inside CUDA graphs, and the time per part;
with host experts also the cache hit rate, misses and GB per step over PCIe, the gather bandwidth measured
alone, the PCIe floor (miss bytes / that bandwidth) and the step's ratio to it.

    python benchmarks/decode.py --modes host --batch 1,8 --routing calibrated,model --out DIR   # on the GPU
    python benchmarks/decode.py --preset small --modes host,device --steps 8 --trace-steps 4    # CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def log(msg=""):
    print(msg, flush=True)


def fill_pool(pool, src, cfg, distinct: int) -> None:
    """Expert records of the first `distinct` layers from the synthetic source; the rest copy them."""
    import numpy as np

    arr = pool.array
    for layer in range(cfg.num_hidden_layers):
        if layer < distinct:
            stacks = {proj: src.expert_stack(layer, proj) for proj in ("gate_proj", "up_proj", "down_proj")}
            for slot in pool.layout.tensors:
                proj, suffix = slot.suffix.split(".", 1)
                data = np.ascontiguousarray(np.asarray(stacks[proj][suffix], slot.dtype))
                arr[layer, :, slot.offset : slot.offset + slot.nbytes] = data.reshape(cfg.num_experts, -1).view(
                    np.uint8)
        else:
            arr[layer] = arr[layer % distinct]


class StreamRouting:
    """A RoutingSource (jaxflash.engine.runner) that gives each batch slot its own stream of a routing model's
    trace: a prefill chunk takes the slot's next n rows, a decode step the next row of every slot, a verify step the
    next K+1 rows of every slot."""

    def __init__(self, ids):  # int32 [streams, tokens, layers, k]
        import numpy as np

        self.ids = np.ascontiguousarray(np.transpose(ids, (0, 2, 1, 3)))  # [streams, layers, tokens, k]
        self.pos = [0] * ids.shape[0]

    def _take(self, slot: int, n: int):
        t = self.ids.shape[2]
        rows = [(self.pos[slot] + i) % t for i in range(n)]
        self.pos[slot] += n
        return self.ids[slot][:, rows]

    def prefill_ids(self, slot: int, n: int, width: int):
        import numpy as np

        got = self._take(slot, n)
        return np.concatenate([got, np.repeat(got[:, :1], width - n, axis=1)], axis=1)

    def decode_ids(self, batch: int):
        import numpy as np

        return np.stack([self._take(s, 1)[:, 0] for s in range(batch)], axis=1)

    def verify_ids(self, batch: int, width: int):
        """Each slot's next `width` rows (its stream moves on by all of them, as if every draft were kept: the
        rows of one verify step are consecutive tokens of the stream either way)."""
        import numpy as np

        return np.concatenate([self._take(s, width) for s in range(batch)], axis=1)


@dataclasses.dataclass
class Model:
    """The full-size synthetic model in memory: dense weights on the device, the routed experts in a pinned host
    pool, the n-gram table in a file the PLE host step maps."""

    cfg: object
    params: object  # without the routed experts
    pool: object  # ffi.ExpertPool
    layout: object  # ffi.ExpertLayout
    ngram: tuple  # (ffi.NgramTable, its scale)
    mb: object  # planner.ModelBytes
    dense: int  # bytes of params


def build_model(cfg, args, max_tokens: int) -> Model:
    """cfg's seeded random model (args.seed, args.dtype, args.distinct_layers); max_tokens: the most token rows
    one program hashes in the PLE host step (a prefill chunk, or a step's rows)."""
    import jax
    import numpy as np

    from jaxflash import ffi
    from jaxflash.engine import planner
    from jaxflash.model.weights import load_params
    from jaxflash.synthetic import SyntheticSource

    src = SyntheticSource(cfg, seed=args.seed)
    t0 = time.perf_counter()
    params = load_params(src, cfg, args.dtype, routed_experts=False)
    jax.block_until_ready(params)
    dense = sum(x.nbytes for x in jax.tree.leaves(params))
    layout = ffi.ExpertLayout.from_config(cfg, "nvfp4")
    pool = ffi.ExpertPool(layout, cfg.num_hidden_layers, cfg.num_experts)
    fill_pool(pool, src, cfg, min(args.distinct_layers, cfg.num_hidden_layers))
    log(f"dense weights {dense / 2**30:.2f} GiB on the device; expert pool {pool.nbytes / 2**30:.2f} GiB on the "
        f"host, pinned={pool.pinned} ({time.perf_counter() - t0:.0f} s)")
    table_np = src.ngram_table()
    path = os.path.join(tempfile.mkdtemp(prefix="jaxflash_ngram_"), "ngram.bin")
    with open(path, "wb") as f:
        for shard in table_np.shards:
            f.write(np.ascontiguousarray(shard).tobytes())
    table = ffi.NgramTable([(path, 0, table_np.rows)], head_dim=table_np.dim, dtype=table_np.dtype,
                           heads=cfg.num_ngram_heads, max_tokens=max_tokens)
    mb = planner.ModelBytes(dense, pool.nbytes, layout.record_bytes)
    return Model(cfg, params, pool, layout, (table, table_np.scale), mb, dense)


def device_resident(model: Model):
    """model's params with every layer's routed experts on the device (the pool's records, viewed as NVFP4)."""
    import jax

    from jaxflash.engine.experts import records_as_experts

    layers = []
    for i, layer in enumerate(model.params.layers):
        ex = records_as_experts(model.layout, jax.device_put(model.pool.array[i]))
        layers.append(dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, experts=ex)))
    params = dataclasses.replace(model.params, layers=tuple(layers))
    jax.block_until_ready(params)
    return params


def gather_bandwidth(pool, layout, misses: int, zero_copy: bool = True) -> float | None:
    """GB/s of the zero-copy gather kernel (or with zero_copy=False the copy engines, one cudaMemcpyAsync per
    record) copying `misses` random records from the pool (CUDA events, outside XLA; None without the CUDA
    module)."""
    import numpy as np

    from jaxflash import ffi

    mod = ffi.module()
    if not hasattr(mod, "bench_gather") or not pool.pinned:
        return None
    rng = np.random.default_rng(3)
    slots = max(misses, 256)
    lists = np.stack([np.stack([rng.choice(pool.num_experts, misses, replace=False),
                                rng.choice(slots, misses, replace=False)], axis=1) for _ in range(16)]).astype(np.int32)
    sec, ok = mod.bench_gather(pool.id, 0, lists, slots, zero_copy, 40)
    if not ok:
        raise RuntimeError("bench_gather: gathered bytes differ from the pool")
    return misses * layout.record_bytes / sec / 1e9


def run_config(name, engine, prompts, args, trace_dir, gather_gbps, layout):
    """Decode `prompts` (one per slot) for args.steps steps; then trace args.trace_steps more steps."""
    import jax

    import trace_parts
    from jaxflash.engine.runner import Want

    sched = engine.scheduler
    runner = sched.runner
    dispatch, stamps = [], []
    real_decode = runner.decode

    spans = []

    def timed_decode(*a, **k):  # the host cost of dispatching one step, and when it happened
        spans.append(k.get("span"))
        t0 = time.perf_counter()
        p = real_decode(*a, **k)
        t1 = time.perf_counter()
        dispatch.append(t1 - t0)
        stamps.append(t1)
        return p

    runner.decode = timed_decode
    engine.generate([prompts[0]], max_new_tokens=4, ignore_eos=True)  # first execution of every program
    dispatch.clear()
    stamps.clear()
    sched.stats = type(sched.stats)()
    reqs = sched.make_requests(prompts, max_new_tokens=args.steps + args.trace_steps + len(prompts) + 2,
                               temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0, stop=None, eos_ids=(),
                               ignore_eos=True)
    for r in reqs:
        sched.submit(r)
    t_start = time.perf_counter()
    while sched.pending or any(not r.out for r in reqs):  # admissions (one per step) and first tokens
        sched.step()
    ttft = time.perf_counter() - t_start
    first = len(stamps)
    stats0 = dataclasses.replace(sched.stats)
    for _ in range(args.steps):
        sched.step()
    steady = stamps[first:]
    step_s = (steady[-1] - steady[0]) / (len(steady) - 1)
    # the steps just before the trace: the same stretch of the sequences (cache hit rates drift along them)
    late = steady[-(2 * args.trace_steps + 1):]
    late_s = (late[-1] - late[0]) / (len(late) - 1)
    st = sched.stats
    steps = st.decode_steps - stats0.decode_steps
    misses = st.expert_misses - stats0.expert_misses
    lookups = st.expert_lookups - stats0.expert_lookups

    jax.block_until_ready(runner.state)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.trace_steps):
            sched.step()
        jax.block_until_ready(runner.state)
    traced_span = spans[-1]  # the context bucket of the traced steps
    for r in reqs:
        sched.cancel(r)
    while not sched.idle:
        sched.step()
    runner.decode = real_decode
    runner.free()  # its KV and expert caches: the next configuration needs the memory

    tr = None
    hlo = runner.program_text("decode", Want(), rows=next(b for b in sched.buckets if b >= len(prompts)),
                              span=traced_span)
    if args.keep_trace:  # the raw material, for a second look at the split
        import glob
        import gzip
        import shutil

        tag = name
        newest = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                     key=os.path.getmtime)
        shutil.copy(newest, os.path.join(args.out, f"trace_{tag}.json.gz"))
        with gzip.open(os.path.join(args.out, f"decode_hlo_{tag}.txt.gz"), "wt") as f:
            f.write(hlo)
    if jax.devices()[0].platform == "gpu":  # the CPU backend's traces hold no device kernels
        try:
            tr = trace_parts.summarise(trace_parts.gpu_kernels(trace_dir), args.trace_steps, hlo)
        except Exception as e:  # noqa: BLE001 -- keep the timings even if the trace cannot be read
            log(f"  trace not summarised: {type(e).__name__}: {e}")
    batch = len(prompts)
    run = {"config": name, "plan": engine.plan.summary(), "cache_slots": engine.plan.cache_slots, "batch": batch,
           "max_batch": engine.plan.max_batch, "max_seq_len": engine.plan.max_seq_len, "span": traced_span,
           "ttft_all_s": ttft, "step_ms": step_s * 1e3, "tok_s": batch / step_s, "late_step_ms": late_s * 1e3,
           "dispatch_ms_median": statistics.median(dispatch[first:]) * 1e3,
           "dispatch_ms_max": max(dispatch[first:]) * 1e3, "steps_timed": len(steady) - 1}
    if lookups:
        run.update(hit_rate=1 - misses / lookups, misses_per_step=misses / steps,
                   miss_gb_per_step=misses / steps * layout.record_bytes / 1e9)
        if gather_gbps and misses:  # no misses (a cache holding every expert the run routes to): no floor
            floor = run["miss_gb_per_step"] / gather_gbps
            run.update(gather_gbps=gather_gbps, pcie_floor_ms=floor * 1e3, step_over_floor=step_s / floor)
    if tr is not None:
        run["trace"] = tr
        run["step_over_busy"] = run["late_step_ms"] / tr["busy_ms_per_step"]
        gather = tr["parts_ms_per_step"].get("expert gather (PCIe)", 0.0)
        run["compute_ms"] = tr["busy_ms_per_step"] - gather
    return run


def report(run) -> str:
    lines = [f"  {run['config']}: {run['tok_s']:.1f} tok/s ({run['batch']} sequence(s)), step {run['step_ms']:.2f} ms,"
             f" dispatch {run['dispatch_ms_median']:.2f} ms/step (median; max {run['dispatch_ms_max']:.2f})"]
    if "hit_rate" in run:
        s = (f"    hit rate {run['hit_rate']:.1%}, {run['misses_per_step']:.0f} misses/step = "
             f"{run['miss_gb_per_step']:.3f} GB/step over PCIe")
        if "pcie_floor_ms" in run:
            s += (f"; gather {run['gather_gbps']:.1f} GB/s -> PCIe floor {run['pcie_floor_ms']:.2f} ms/step, "
                  f"step = {run['step_over_floor']:.2f} x floor")
        lines.append(s)
    if "trace" in run:
        import trace_parts

        lines.append(f"    last {2 * run['trace']['steps']} untraced steps {run['late_step_ms']:.2f} ms/step / GPU busy of "
                     f"the {run['trace']['steps']} traced steps after them = {run['step_over_busy']:.3f}; compute "
                     f"(busy - gather) {run['compute_ms']:.2f} ms/step")
        lines += ["    " + l for l in trace_parts.format_summary(run["trace"]).splitlines()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "small", "tiny"])
    ap.add_argument("--modes", default="host,device", help="comma-separated: host (budgeted), device")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes (sequences decoded together)")
    ap.add_argument("--routing", default="model", help="comma-separated: model, calibrated")
    ap.add_argument("--kernel", default="auto",
                    help="comma-separated: auto (decode experts by the NVFP4 kernels on a GPU, the engine's default "
                         "route), pallas, cuda (that route of the kernels), off (the jnp path)")
    ap.add_argument("--gdn-kernel", default="auto",
                    help="comma-separated: auto (the engine's default: the GDN decode kernel, "
                         "jaxflash.kernels.gdn_decode, on a GPU), on, off (XLA's form)")
    ap.add_argument("--hc-kernel", default="auto",
                    help="comma-separated: auto (the engine's default: the hyper-connection mix kernels, "
                         "jaxflash.kernels.hc_mix, for steps of at most hc_mix.FASTER_ROWS rows on a GPU), on "
                         "(every step they take), off (XLA's mix)")
    ap.add_argument("--attention-kernel", default="auto",
                    help="comma-separated: auto (the engine's default: the paged attention kernel on a GPU), on, "
                         "off (XLA's attention)")
    ap.add_argument("--max-batch", default="",
                    help="comma-separated engine max_batch values (default: the batch); one larger than the batch "
                         "measures a lone request in a larger engine, which decodes in the smallest bucket holding it")
    ap.add_argument("--budget", default="32GiB", help="VRAM budget of the host mode")
    ap.add_argument("--cache-slots", default="",
                    help="comma-separated expert cache slots per layer of the host mode (default: what the planner "
                         "fits in the budget); e.g. the slots left beside a larger prefill chunk's workspace")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps (steady state, all admitted)")
    ap.add_argument("--trace-steps", type=int, default=8, help="decode steps in the profiler trace")
    ap.add_argument("--max-seq-len", default="4096",
                    help="comma-separated context lengths the engine plans for (the server's default is 32768): "
                         "the decode step's attention spans the whole planned context, not the sequences' lengths")
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--distinct-layers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (0: the preset's); fewer fit a smaller GPU with every expert on it")
    ap.add_argument("--ngram-rows-scale", type=float, default=1 / 64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json")
    ap.add_argument("--compile-threads", type=int, default=3, help="configurations compiled at once")
    ap.add_argument("--only", default=None, help="comma-separated configurations to run, e.g. host-b1-calibrated")
    ap.add_argument("--keep-trace", action="store_true",
                    help="also copy each configuration's trace and decode HLO into --out")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.trace_steps < 1:
        ap.error("--steps takes 2 or more and --trace-steps 1 or more (the step time is a span between steps)")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash.engine import Engine, planner
    from jaxflash.engine.experts import HostExperts
    from jaxflash.engine.runner import Want
    from jaxflash.synthetic import make_config

    out_dir = args.out = args.out or tempfile.mkdtemp(prefix="jaxflash_decode_")
    os.makedirs(out_dir, exist_ok=True)
    traces = tempfile.mkdtemp(prefix="jaxflash_traces_")  # large: kept out of --out
    cfg = make_config(args.preset, ngram_rows_scale=args.ngram_rows_scale).replace(mtp_num_hidden_layers=0)
    if args.layers:  # the first N layers of the preset (its layer pattern; PLE where it falls among them)
        cfg = cfg.replace(num_hidden_layers=args.layers, layer_types=cfg.layer_types[: args.layers],
                          ple_layer_ids=tuple(i for i in cfg.ple_layer_ids if i <= args.layers))
    dev = jax.devices()[0]
    modes, batches = args.modes.split(","), [int(b) for b in args.batch.split(",")]
    routings = args.routing.split(",")
    max_batches = [int(b) for b in args.max_batch.split(",") if b] or [0]
    slot_counts = [int(n) for n in args.cache_slots.split(",") if n] or [None]
    res = {"device": str(dev.device_kind), "platform": dev.platform, "jax": jax.__version__,
           "python": platform.python_version(), "preset": args.preset, "layers": cfg.num_hidden_layers,
           "dtype": args.dtype, "prompt_tokens": args.prompt, "steps": args.steps, "trace_steps": args.trace_steps,
           "max_seq_len": args.max_seq_len, "budget": args.budget, "runs": []}
    seq_lens = [int(n) for n in args.max_seq_len.split(",")]
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}; preset {args.preset}: "
        f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts top-{cfg.num_experts_per_tok}, {args.dtype}")

    model = build_model(cfg, args, max_tokens=max(args.prefill_chunk, max(batches), max(max_batches)))
    res.update(pool_gib=model.pool.nbytes / 2**30, pool_pinned=model.pool.pinned, dense_gib=model.dense / 2**30)
    params, pool, layout, ngram, mb = model.params, model.pool, model.layout, model.ngram, model.mb
    rng = np.random.default_rng(1)

    # Plan every configuration first, from the device's free memory before anything big is allocated; each
    # runner allocates its state (KV, expert caches) on its first call and frees it after its run.
    configs = []
    kernels = args.kernel.split(",")
    if not set(kernels) <= {"auto", "off", "pallas", "cuda"}:
        ap.error(f"--kernel takes auto, off, pallas and/or cuda, got {args.kernel!r}")
    gdn_kernels = args.gdn_kernel.split(",")
    if not set(gdn_kernels) <= {"auto", "off", "on"}:
        ap.error(f"--gdn-kernel takes auto, off and/or on, got {args.gdn_kernel!r}")
    hc_kernels = args.hc_kernel.split(",")
    if not set(hc_kernels) <= {"auto", "off", "on"}:
        ap.error(f"--hc-kernel takes auto, off and/or on, got {args.hc_kernel!r}")
    attn_kernels = args.attention_kernel.split(",")
    if not set(attn_kernels) <= {"auto", "off", "on"}:
        ap.error(f"--attention-kernel takes auto, off and/or on, got {args.attention_kernel!r}")
    for mode, batch, routing, kern, gdn_k, hc_k, attn_k, want_mb, seq_len, slots in itertools.product(
            modes, batches, routings, kernels, gdn_kernels, hc_kernels, attn_kernels, max_batches, seq_lens,
            slot_counts):
        free, note = planner.device_free_bytes(dev)
        max_batch = max(batch, want_mb)
        plan = planner.plan(cfg, mb, residency=mode, free=free, free_note=note, max_batch=max_batch,
                            budget=planner.parse_bytes(args.budget) if mode == "host" else None,
                            max_seq_len=seq_len, prefill_chunk=args.prefill_chunk,
                            cache_slots=slots if mode == "host" else None,
                            dtype_bytes=jnp.dtype(args.dtype).itemsize)
        name = f"{mode}-b{batch}-{routing}" + {"auto": "", "off": "-jnp", "pallas": "-pallas", "cuda": "-cuda"}[kern]
        name += {"auto": "", "on": "-gdnk", "off": "-xlagdn"}[gdn_k] + {"auto": "", "on": "-hck", "off": "-xlahc"}[hc_k]
        name += {"auto": "", "on": "-attnk", "off": "-xlaattn"}[attn_k]
        name += f"-mb{max_batch}" if max_batch != batch else ""
        name += f"-ctx{seq_len}" if len(seq_lens) > 1 else ""
        name += f"-s{slots}" if mode == "host" and slots is not None else ""
        if (args.only and name not in args.only.split(",")) or name in [c[0] for c in configs]:
            continue
        configs.append((name, mode, batch, routing, plan, {"auto": None, "off": False}.get(kern, kern),
                        {"auto": None, "on": True, "off": False}[gdn_k], {"auto": None, "on": True, "off": False}[hc_k],
                        {"auto": None, "on": True, "off": False}[attn_k]))
    device_params = device_resident(model) if "device" in modes else None

    engines = []
    for name, mode, batch, routing, plan, expert_kernel, gdn_kernel, hc_kernel, attention_kernel in configs:
        feed = None
        if routing == "calibrated":
            from routing import RoutingModel

            model = RoutingModel(num_layers=cfg.num_hidden_layers, num_experts=cfg.num_experts,
                                 top_k=cfg.num_experts_per_tok, seed=args.seed)
            # each slot's stream: its prompt, the warm-up, the timed and traced steps (then it wraps around)
            ids, _ = model.sample(args.prompt + args.steps + args.trace_steps + 2 * batch + 16, streams=batch)
            feed = StreamRouting(ids)
        host = HostExperts(pool, layout, plan.cache_slots) if mode == "host" else None
        eng = Engine(cfg, device_params if mode == "device" else params, plan=plan, host_experts=host,
                     ngram=ngram, routing=feed, expert_kernel=expert_kernel, gdn_kernel=gdn_kernel,
                     hc_kernel=hc_kernel, attention_kernel=attention_kernel)
        for n in plan.notes:
            log(f"  {name}: plan: {n}")
        engines.append((name, eng))

    t0 = time.perf_counter()
    def programs(e):  # plain decoding: the decode step in every bucket the batch passes through while admitting
        return [("prefill", Want()), ("admit", None), ("release", None)] + [
            ("decode", Want(), b, span) for b in e.scheduler.buckets for span in e.scheduler.spans]

    with concurrent.futures.ThreadPoolExecutor(min(len(engines), args.compile_threads)) as ex:
        list(ex.map(lambda e: e.scheduler.runner.compile(programs(e)), [e for _, e in engines]))
    res["compile_s"] = time.perf_counter() - t0
    log(f"compiled {len(engines)} configurations' programs side by side in {res['compile_s']:.0f} s")

    gbps = gather_bandwidth(pool, layout, 186) if "host" in modes else None
    if gbps:
        log(f"zero-copy gather alone: {gbps:.1f} GB/s (186 random records)")
    res["gather_gbps"] = gbps
    for (name, eng), (_, mode, batch, routing, plan, *_kernels) in zip(engines, configs):
        prompts = [[int(x) for x in rng.integers(0, cfg.vocab_size, args.prompt)] for _ in range(batch)]
        trace_dir = os.path.join(traces, name)
        run = run_config(name, eng, prompts, args, trace_dir, gbps, layout)
        run.update(mode=mode, routing=routing)
        log(report(run))
        res["runs"].append(run)
        with open(os.path.join(out_dir, "results.json"), "w") as f:  # after each run: a cut run keeps the rest
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
