#!/usr/bin/env python3
"""Can a host-residency decode step copy one layer's experts over PCIe while it computes another layer?

Today each layer of a host-resident decode step resolves its routed experts, gathers the misses over PCIe (the
zero-copy kernel of ffi/cuda_handlers.cu) and only then computes, so the step costs gather + compute
(benchmarks/RESULTS.md: 5.5 + 3.5 ms at 24 layers on an H100). If layer l+1's experts could be fetched while
layer l computes (from a routing predicted one layer ahead), the step would approach max(gather, compute).
This probe asks only whether XLA runs such a gather beside the compute inside the step's one CUDA graph, and at
what cost; it does not predict routing and does not touch the engine.

The program: L layers; layer l gathers M records (the full-size NVFP4 expert record, from a pinned pool) into
its own cache buffer, adds a sum over the gathered slots' first bytes to x, then computes y = W_l x (bf16,
`--compute-mb` of weights per layer): all of layer l's compute waits for its gather, as a layer's experts and
everything after them do in the engine. Forms:
  compute  the computes alone (no gathers);
  gather   the gathers alone;
  serial   gather l depends on x_l, the output of layer l-1's compute (as the engine's resolve does on the
           router): nothing can overlap;
  ahead    gather l+1 depends on x_l (a prediction made from layer l's input), so it may run beside compute l:
           whether it does is XLA's choice (its command-buffer scheduling mode, XLA_FLAGS);
  stream   ahead, with each gather in `compute_on("gpu_stream:1")`: XLA's explicit stream annotation runs it on
           a second stream (an async call) that the compute of its layer joins.
  dma      ahead, on the copy engines: `gather_start` (mode memcpy: the miss list read back to the host, then a
           cudaMemcpyAsync per record on a side stream) for layer l+1 once layer l's copies are joined
           (`gather_wait`), then compute l, which takes a zero from the start's output so that XLA keeps
           that order. These calls cannot sit in a CUDA graph, so XLA splits the step's
           graph around them, and each start waits on the host for the stream to reach it.
  dma_serial  the same calls with each layer's start right before its wait: the copy-engine path's own cost.
The dependence on x is a zero XLA cannot fold ((x[0] != x[0]), false for finite x) added to the miss list.

Reported per form: wall ms per step (median of `--reps` calls, one call per step), and from a profiler trace of
3 calls: kernels per step, the gather kernels' time, the time in which a gather kernel and another kernel run at
once (overlap), the streams and CUDA graph ids the kernels ran in, and the floor max(compute, gather) from the
first two forms. The driver runs it once per scheduling mode, e.g.

    python3 benchmarks/overlap_probe.py --out $OUT
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT python3 benchmarks/overlap_probe.py --out $OUT

On the CPU (no GPU) it runs tiny sizes as a smoke test: `--layers 2 --misses 2 --compute-mb 1 --experts 4`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_file import write_json  # noqa: E402

FORMS = ("compute", "gather", "serial", "ahead", "stream", "dma_serial", "dma")


def log(msg=""):
    print(msg, flush=True)


def side_stream(fn):
    """fn run on XLA's second stream (an explicit stream annotation; ignored by the CPU backend)."""
    import jax
    from jax.experimental import compute_on
    # jax 0.10 calls the function form compute_on2; jax 0.11 names it compute_on
    form = getattr(compute_on, "compute_on2", compute_on.compute_on)
    return form(fn, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)


def build(form: str, pool, layers: int, hidden: int):
    """The jitted step of one form: (x, weights, caches, misses, info) -> (x, caches), caches donated."""
    import jax
    import jax.numpy as jnp
    from jaxflash.ffi import cache as cache_ffi

    def gather_of(layer):  # the layer is a static attribute of the custom call
        def gather(misses, info, cache):
            return cache_ffi.gather(misses, info, cache, pool=pool, layer=layer, mode="zero_copy")
        return side_stream(gather) if form == "stream" else gather

    gathers = [gather_of(layer) for layer in range(layers)]

    def zero(x):  # 0, but not foldable: x[0] is finite
        return (x[0] != x[0]).astype(jnp.int32)

    def compute(x, w, cache):  # all of it after the layer's gather, as a layer's next part needs its experts
        if cache is not None:
            x = (x.astype(jnp.float32) + 1e-6 * cache[:, :hidden].astype(jnp.float32).sum(0)).astype(x.dtype)
        y = jnp.dot(w, x, preferred_element_type=jnp.float32).reshape(-1, hidden).sum(0)
        return (x.astype(jnp.float32) + 1e-3 * y).astype(x.dtype)

    def step(x, weights, caches, misses, info):
        caches = list(caches)
        if form == "compute":
            for layer in range(layers):
                x = compute(x, weights[layer], None)
        elif form == "gather":
            for layer in range(layers):
                caches[layer] = gathers[layer](misses[layer], info, caches[layer])
        elif form == "serial":
            for layer in range(layers):
                caches[layer] = gathers[layer](misses[layer] + zero(x), info, caches[layer])
                x = compute(x, weights[layer], caches[layer])
        elif form in ("dma", "dma_serial"):
            started = [None] * layers  # the miss list each start reads (alive until its wait)

            def start(layer, x):
                started[layer] = misses[layer] + zero(x)
                return cache_ffi.gather_start(started[layer], info, caches[layer], pool=pool, layer=layer,
                                              mode="memcpy")

            if form == "dma":
                caches[0] = start(0, x)
            for layer in range(layers):
                if form == "dma_serial":
                    caches[layer] = start(layer, x)
                caches[layer], x = cache_ffi.gather_wait(caches[layer], x, started[layer], info)
                if form == "dma" and layer + 1 < layers:  # beside compute l; the wait joins every start so far
                    caches[layer + 1] = start(layer + 1, x)
                    # a zero from the start's output, so that XLA schedules the start before compute l (a byte
                    # read while the copy may write it: its value is never used)
                    byte = caches[layer + 1][0, 0].astype(jnp.float32)
                    x = (x.astype(jnp.float32) + (byte != byte)).astype(x.dtype)
                x = compute(x, weights[layer], caches[layer])
        else:  # ahead, stream: layer l+1's gather is issued from x_l, before layer l computes
            caches[0] = gathers[0](misses[0] + zero(x), info, caches[0])
            for layer in range(layers):
                if layer + 1 < layers:
                    caches[layer + 1] = gathers[layer + 1](misses[layer + 1] + zero(x), info, caches[layer + 1])
                x = compute(x, weights[layer], caches[layer])
        return x, tuple(caches)

    return jax.jit(step, donate_argnums=(2,))


def computation_of_gathers(hlo: str) -> list[str]:
    """Names of the HLO computations that hold a gather custom call (a command buffer's, an async call's)."""
    names, current = [], None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
        elif "jaxflash_gather" in line and current and current not in names:
            names.append(current)
    return names


def trace_figures(trace_dir: str, steps: int) -> dict:
    from trace_parts import busy_us, gpu_kernels
    ev = gpu_kernels(trace_dir)
    if not ev:
        return {}
    is_gather = [("gather" in e.get("name", "")) for e in ev]
    gathers = [e for e, g in zip(ev, is_gather) if g]
    others = [e for e, g in zip(ev, is_gather) if not g]
    both = busy_us(gathers) + busy_us(others) - busy_us(ev)  # time in which the two sets overlap
    streams = lambda es: sorted({str(e.get("tid")) for e in es})  # noqa: E731
    graphs = sorted({str(e.get("args", {}).get("cuda_graph_id")) for e in ev})
    return {"kernels_per_step": len(ev) / steps, "busy_ms": busy_us(ev) / 1e3 / steps,
            "gather_ms": sum(e["dur"] for e in gathers) / 1e3 / steps, "overlap_ms": both / 1e3 / steps,
            "gather_streams": streams(gathers), "other_streams": streams(others), "graph_ids": graphs,
            "span_ms": (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / 1e3 / steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--misses", type=int, default=5, help="records gathered per layer per step (host b1: ~5)")
    ap.add_argument("--experts", type=int, default=64, help="records per pool layer (the steps rotate through)")
    ap.add_argument("--compute-mb", type=float, default=400.0, help="bf16 weights per layer's compute, MB")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--gather-blocks", default="0", help="gather blocks per record, comma list (0: its default)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="folder for overlap_probe_<mode>.json")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxflash import presets
    from jaxflash.ffi import ExpertLayout, ExpertPool, _ext

    forms = [f for f in a.forms.split(",") if f]
    bad = [f for f in forms if f not in FORMS]
    if bad:
        ap.error(f"unknown forms {bad}; expected some of {FORMS}")
    if a.misses > a.experts:
        ap.error("--misses must not exceed --experts")
    block_counts = [int(b) for b in a.gather_blocks.split(",")]
    if block_counts != [0] and not hasattr(_ext.module(), "set_gather_blocks_per_record"):
        ap.error("--gather-blocks sets a knob of the CUDA build of jaxflash's FFI module, which is not loaded")
    cfg = presets.full()
    hidden = cfg.hidden_size
    layout = ExpertLayout.from_config(cfg)
    rows = max(1, round(a.compute_mb * 1e6 / (2 * hidden * hidden))) * hidden  # whole [H, H] blocks
    flags = os.environ.get("XLA_FLAGS", "")
    mode = "concurrent" if "CONCURRENT" in flags else ("serialize" if "SERIALIZE" in flags else "default")
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}, XLA_FLAGS={flags!r}; {a.layers} layers, "
        f"{a.misses} records of {layout.record_bytes / 1e6:.2f} MB gathered per layer, compute "
        f"{rows * hidden * 2 / 1e6:.0f} MB per layer")

    pool = ExpertPool(layout, a.layers, a.experts, pin=True if dev.platform == "gpu" else "auto")
    key = jax.random.PRNGKey(0)
    weights = tuple(jax.random.normal(jax.random.fold_in(key, i), (rows, hidden), jnp.bfloat16) * 0.01
                    for i in range(a.layers))
    x0 = jnp.ones((hidden,), jnp.bfloat16)
    info = jnp.array([a.misses, a.misses, 0, 0], jnp.int32)
    slots = np.arange(a.misses, dtype=np.int32)
    miss_sets = [jnp.asarray(np.stack([np.stack([(np.arange(a.misses) + r * a.misses + layer) % a.experts, slots], 1)
                                       for layer in range(a.layers)]).astype(np.int32))
                 for r in range(max(1, a.experts // a.misses))]  # rotate records so no step re-reads the last

    def fresh_caches():
        return tuple(jnp.zeros((a.misses, layout.record_bytes), jnp.uint8) for _ in range(a.layers))

    result = {"device": dev.device_kind, "jax": jax.__version__, "xla_flags": flags, "mode": mode,
              "layers": a.layers, "misses": a.misses, "record_bytes": layout.record_bytes,
              "compute_bytes_per_layer": rows * hidden * 2, "pinned": bool(pool.pinned),
              "python": platform.python_version(), "forms": {}}
    for blocks in block_counts:
        if block_counts != [0]:  # a CUDA build's knob, read when a graph is captured
            _ext.module().set_gather_blocks_per_record(blocks)
        for form in forms:
            name = form if blocks == 0 else f"{form}@{blocks}"
            try:
                fn = build(form, pool, a.layers, hidden)
                caches = fresh_caches()
                t0 = time.perf_counter()
                x, caches = fn(x0, weights, caches, miss_sets[0], info)
                jax.block_until_ready(x)
                compile_s = time.perf_counter() - t0
                hlo = fn.lower(x0, weights, caches, miss_sets[0], info).compile().as_text()
                times = []
                for r in range(a.reps + 2):
                    t = time.perf_counter()
                    x, caches = fn(x, weights, caches, miss_sets[r % len(miss_sets)], info)
                    jax.block_until_ready(x)
                    times.append(time.perf_counter() - t)
                wall = statistics.median(times[2:]) * 1e3
                with tempfile.TemporaryDirectory() as td:
                    with jax.profiler.trace(td, create_perfetto_trace=True):
                        for r in range(3):
                            x, caches = fn(x, weights, caches, miss_sets[r % len(miss_sets)], info)
                        jax.block_until_ready(x)
                    tr = trace_figures(td, 3) if dev.platform == "gpu" else {}
                fig = {"wall_ms": wall, "compile_s": compile_s, "gather_computations": computation_of_gathers(hlo),
                       "call_starts": hlo.count("call-start"), **tr}
                result["forms"][name] = fig
                log(f"{name:>12}: {wall:8.3f} ms/step  " + "  ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fig.items()
                    if k not in ("wall_ms",)))
            except Exception as e:  # report and go on: one form's failure says something too
                result["forms"][name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
                log(f"{name:>12}: FAILED {type(e).__name__}: {str(e)[:800]}")
    f = result["forms"]
    if "compute" in f and "gather" in f and "wall_ms" in f["compute"] and "wall_ms" in f["gather"]:
        floor = max(f["compute"]["wall_ms"], f["gather"]["wall_ms"])
        result["floor_ms"] = floor
        for name, fig in f.items():
            if "wall_ms" in fig:
                fig["of_floor"] = fig["wall_ms"] / floor
        log(f"floor max(compute, gather) {floor:.3f} ms; serial sum "
            f"{f['compute']['wall_ms'] + f['gather']['wall_ms']:.3f} ms")
    pool.close()
    write_json(a.out, f"overlap_probe_{mode}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
