"""FFI benchmark on a CUDA GPU: command-buffer capture, gather bandwidth, resolve time, PLE host-step cost.

    python benchmarks/ffi_bench.py --out DIR

Sections (all on the full-size expert record: NVFP4 gate+up+down at H=2560, I=640, 2,765,056 bytes):
  capture    resolve + gather + PLE step in one jitted step, replayed --steps times with donated state. The
             handler bodies count their calls (nanobind counter): captured in a command buffer, a body runs a
             bounded number of times however many steps replay. Every step's LRU state is checked against the
             Python LRU model right after the step; slots, misses, info, per-slot record tags and PLE ids/rows
             of every step are logged on the device and checked too, and full records every 10 steps. A child
             process repeats the run with command buffers off, where each body runs once per step.
  gather     copy bandwidth for 10..240 misses: zero-copy kernel vs batched cudaMemcpyAsync, timed with CUDA
             events outside XLA (bench_gather), then per jitted step inside XLA.
  resolve    48 layers' resolve per jitted step (decode T=1 and a T=16 chunk), time per layer.
  ple        the PLE host step per jitted step (B=1, B=8 decode; B=1 T=512), against an empty step.
Prints its figures and conditions; writes ffi_bench.json under --out.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
NO_CMDBUF_FLAGS = "--xla_gpu_enable_command_buffer="


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="directory for ffi_bench.json (and the XLA dump with --dump)")
    ap.add_argument("--steps", type=int, default=120, help="replayed steps in the capture check (>= 100)")
    ap.add_argument("--only", default="capture,gather,layers,resolve,ple", help="comma-separated sections")
    ap.add_argument("--no-command-buffer", action="store_true", help="run with XLA command buffers off")
    ap.add_argument("--dump", action="store_true", help="dump XLA's compiled modules to --out/xla_dump")
    ap.add_argument("--json", default=None, help="write this run's results here (default --out/ffi_bench.json)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run what can run on the CPU backend (a check of the script, no figures)")
    return ap.parse_args()


ARGS = _parse()
_flags = NO_CMDBUF_FLAGS if ARGS.no_command_buffer else CMDBUF_FLAGS
DUMP_DIR = os.path.join(tempfile.gettempdir(), "jaxflash_ffi_bench_xla_dump")
if ARGS.dump:
    _flags += f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_as_text"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flags).strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash import ffi as F  # noqa: E402
from jaxflash import presets  # noqa: E402
from jaxflash.ffi.reference import LruModel, ngram_ids_reference  # noqa: E402

H, I, E, K_TOP = 2560, 640, 512, 10
SLOTS = 186  # a per-layer cache that a 32 GB card's budget allows
LAYOUT = F.ExpertLayout("nvfp4", H, I)
R = LAYOUT.record_bytes
TAG = 0x4A46  # "JF": records carry (layer, expert, TAG) in their first 12 bytes


def log(msg=""):
    print(msg, flush=True)


def zipf_routing(rng, steps, layers, tokens, k=K_TOP, a=1.0):
    """[steps, layers, tokens, k] routed ids with a skewed popularity per layer (distinct per token)."""
    out = np.empty((steps, layers, tokens, k), np.int32)
    for layer in range(layers):
        p = 1.0 / np.arange(1, E + 1) ** a
        p /= p.sum()
        perm = rng.permutation(E)
        for s in range(steps):
            for t in range(tokens):
                out[s, layer, t] = perm[rng.choice(E, k, replace=False, p=p)]
    return out


def make_pool(rng):
    pool = F.ExpertPool(LAYOUT, 1, E, pin=True)
    base = rng.integers(0, 256, R + 4096, dtype=np.uint8)
    arr = pool.array
    for e in range(E):
        arr[0, e] = base[(e * 8) % 4096 :][:R]  # distinct bytes per expert, cheap to make
        arr[0, e, :12] = np.array([0, e, TAG], np.int32).view(np.uint8)
    return pool


def make_table(path, cfg):
    """A synthetic FP8 n-gram table file in 8 segments (the full table is 48 GiB; this one has the same row
    size and lives in the page cache)."""
    rows, dim = cfg.ngram_table_rows(), cfg.ngram_head_dim
    data = np.random.default_rng(7).integers(0, 0x7F, (rows, dim), dtype=np.uint8)
    data.tofile(path)
    per = -(-rows // 8)
    segs = [(path, i * per * dim, min(per, rows - i * per)) for i in range(8)]
    return F.NgramTable(segs, head_dim=dim, dtype="F8_E4M3", heads=cfg.num_ngram_heads, max_tokens=1024), data


def timed(fn, carry, n, warm=3):
    """Seconds per call of carry = fn(*carry), dispatch included (one jitted call per step, like the engine)."""
    for _ in range(warm):
        carry = fn(*carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    for _ in range(n):
        carry = fn(*carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / n, carry


# ----- capture ---------------------------------------------------------------------------------------------------
def capture_section(res, pool, table, table_data, cfg, steps, mode="zero_copy"):
    B = 4
    h = F.NgramHash.from_config(cfg)
    rng = np.random.default_rng(11)
    trace = zipf_routing(rng, steps, 1, 1)[:, 0]  # [steps, 1, k]
    tok_trace = rng.integers(0, cfg.vocab_size, (steps, B, 1)).astype(np.int32)
    tok_trace[rng.random(tok_trace.shape) < 0.1] = cfg.eos_token_id
    M = min(K_TOP, SLOTS, E)
    nh, dim = h.heads, table.head_dim

    def step(state, cache, ctx, counter, logs, trace, tok_trace):
        r = F.resolve(trace[counter], state, num_slots=SLOTS, num_experts=E)
        cache = F.gather(r.misses, r.info, cache, pool=pool, layer=0, mode=mode)
        p = F.ple_step(tok_trace[counter], ctx, table, h)
        tags = jax.lax.bitcast_convert_type(cache[:, :12].reshape(SLOTS, 3, 4), jnp.int32)
        rows = jax.lax.bitcast_convert_type(p.rows, jnp.uint8)
        new = dict(slots=r.slots, misses=r.misses, info=r.info, tags=tags, ids=p.ids, rows=rows, pinfo=p.info)
        logs = {k: logs[k].at[counter].set(v) for k, v in new.items()}
        return r.state, cache, p.context, counter + 1, logs

    step = jax.jit(step, donate_argnums=(0, 1, 2, 3, 4))
    logs = dict(slots=jnp.zeros((steps, 1, K_TOP), jnp.int32), misses=jnp.zeros((steps, M, 2), jnp.int32),
                info=jnp.zeros((steps, 4), jnp.int32), tags=jnp.zeros((steps, SLOTS, 3), jnp.int32),
                ids=jnp.zeros((steps, B, 1, nh), jnp.int32), rows=jnp.zeros((steps, B, 1, nh, dim), jnp.uint8),
                pinfo=jnp.zeros((steps, 2), jnp.int32))
    state = jnp.asarray(F.lru_state_init(SLOTS, E))
    cache = F.cache_init(SLOTS, R)
    ctx = jnp.asarray(F.ngram_context_init(B, cfg.eos_token_id))
    counter = jnp.int32(0)
    trace_d, tok_d = jnp.asarray(trace), jnp.asarray(tok_trace)

    model = LruModel(SLOTS, E)
    F.reset_handler_calls()
    calls_after, last_calls, changed_at = {}, F.handler_calls(), []
    full_checks = state_checks = 0
    t0 = time.perf_counter()
    for s in range(steps):
        state, cache, ctx, counter, logs = step(state, cache, ctx, counter, logs, trace_d, tok_d)
        _, misses, _ = model.resolve(trace[s])
        np.testing.assert_array_equal(np.asarray(state), model.state(), err_msg=f"LRU state after step {s}")
        state_checks += 1
        if s % 10 == 9 and misses:
            for e, v in misses[:3]:  # whole records, byte for byte
                np.testing.assert_array_equal(np.asarray(cache[v]), pool.array[0, e], err_msg=f"step {s} slot {v}")
                full_checks += 1
        now = F.handler_calls()
        if now != last_calls:
            changed_at.append(s + 1)  # some handler body ran during this (1-based) step
        if s in (1, 9):
            calls_after[s + 1] = now
        last_calls = now
    wall = time.perf_counter() - t0
    calls = F.handler_calls()

    # Every step's logged outputs against the references.
    logs = {k: np.asarray(v) for k, v in logs.items()}
    model = LruModel(SLOTS, E)
    ref_ctx = F.ngram_context_init(B, cfg.eos_token_id)
    for s in range(steps):
        want_slots, want_misses, distinct = model.resolve(trace[s])
        np.testing.assert_array_equal(logs["slots"][s].reshape(-1), want_slots, err_msg=f"slots, step {s}")
        np.testing.assert_array_equal(logs["misses"][s], model.padded_misses(want_misses, M), err_msg=f"step {s}")
        np.testing.assert_array_equal(logs["info"][s], [len(want_misses), distinct, 0, 0], err_msg=f"step {s}")
        want_tags = np.array([[0, e if e is not None else 0, TAG if e is not None else 0] for e in model.holder])
        np.testing.assert_array_equal(logs["tags"][s], want_tags, err_msg=f"slot tags, step {s}")
        want_ids, ref_ctx = ngram_ids_reference(tok_trace[s], ref_ctx, eos=h.eos, multipliers=h.multipliers,
                                                head_sizes=h.head_sizes, head_offsets=h.head_offsets)
        np.testing.assert_array_equal(logs["ids"][s], want_ids, err_msg=f"PLE ids, step {s}")
        np.testing.assert_array_equal(logs["rows"][s], table_data[want_ids], err_msg=f"PLE rows, step {s}")
        assert logs["pinfo"][s].tolist() == [0, 0]
    np.testing.assert_array_equal(np.asarray(ctx), ref_ctx)
    hit_rate = model.hits / max(1, model.hits + model.misses)
    out = dict(mode=mode, steps=steps, handler_calls=calls, handler_calls_after=calls_after, changed_at=changed_at,
               state_checks=state_checks, full_record_checks=full_checks, lru_hit_rate=hit_rate,
               seconds_per_step_with_checks=wall / steps, verified=True)
    res.setdefault("capture", {})[mode] = out
    log(f"capture [{mode}] {steps} steps verified (state after every step, logged outputs of every step, "
        f"{full_checks} full records); handler body calls: "
        + ", ".join(f"{k}={v}" for k, v in calls.items() if v)
        + f"; bodies ran during steps {changed_at[:12]}{' ...' if len(changed_at) > 12 else ''}")
    return out


def uncaptured_child(res, steps):
    """The same capture run in a child process with command buffers off."""
    path = os.path.join(ARGS.out, "ffi_bench_nocmdbuf.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--only", "capture", "--no-command-buffer", "--steps",
           str(steps), "--out", ARGS.out, "--json", path]
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(("--xla_gpu_enable_command_buffer", "--xla_gpu_graph_min",
                                                     "--xla_dump")))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        log(proc.stdout[-3000:] + proc.stderr[-3000:])
        res["capture_without_command_buffers"] = dict(error=proc.stderr[-2000:])
        return
    with open(path) as f:
        child = json.load(f)
    res["capture_without_command_buffers"] = child["capture"]["zero_copy"]
    calls = child["capture"]["zero_copy"]["handler_calls"]
    log(f"capture with command buffers OFF ({time.perf_counter() - t0:.0f} s child): handler body calls: "
        + ", ".join(f"{k}={v}" for k, v in calls.items() if v))


# ----- gather ----------------------------------------------------------------------------------------------------
def gather_section(res, pool, smoke=False):
    mod = F.module()
    rng = np.random.default_rng(3)
    cache_slots = 256
    counts = [] if smoke else [10, 20, 30, 60, 120, 186, 240]
    rows = []
    for M in counts:
        K = 16
        lists = np.empty((K, M, 2), np.int32)
        for k in range(K):
            lists[k, :, 0] = rng.choice(E, M, replace=False)
            lists[k, :, 1] = rng.choice(cache_slots, M, replace=False)
        iters = int(max(8, min(200, 4e9 / (M * R))))
        row = dict(misses=M, bytes=M * R, iters=iters)
        variants = [("zero_copy", True, 0), ("memcpy", False, 0)]
        if M in (10, 60, 240):  # blocks per missed record: auto (from the SM count) vs fixed
            variants += [("zero_copy_bpr8", True, 8), ("zero_copy_bpr128", True, 128)]
        for name, zero_copy, bpr in variants:
            mod.set_gather_blocks_per_record(bpr)
            sec, ok = mod.bench_gather(pool.id, 0, lists, cache_slots, zero_copy, iters)
            assert ok, f"{name}: gathered bytes differ from the pool"
            row[name] = M * R / sec / 1e9
        mod.set_gather_blocks_per_record(0)
        # One contiguous copy of the same bytes: adjacent experts into adjacent slots coalesce into one memcpy.
        contiguous = np.stack([np.arange(M), np.arange(M)], axis=1).astype(np.int32)[None]
        sec, ok = mod.bench_gather(pool.id, 0, contiguous, cache_slots, False, iters)
        row["one_contiguous_h2d"] = M * R / sec / 1e9
        rows.append(row)
        log(f"gather {M:4d} misses ({M * R / 1e6:7.1f} MB): " + ", ".join(
            f"{k} {v:.1f}" for k, v in row.items() if k not in ("misses", "bytes", "iters")) + " GB/s")
    res["gather_bench"] = rows

    # Inside XLA: one gather per jitted step, miss lists cycled from a device table (stable addresses).
    xla_rows = []
    for M in (10, 60, 240):
        K = 16
        table = np.empty((K, M, 2), np.int32)
        for k in range(K):
            table[k, :, 0] = rng.choice(E, M, replace=False)
            table[k, :, 1] = rng.choice(cache_slots, M, replace=False)
        table_d = jnp.asarray(table)
        info = jnp.asarray([M, M, 0, 0], jnp.int32)
        row = dict(misses=M)
        for mode in ("zero_copy", "memcpy") if pool.pinned else ("memcpy",):
            def step(cache, counter, table_d, info, mode=mode):
                cache = F.gather(table_d[counter % K], info, cache, pool=pool, layer=0, mode=mode)
                return cache, counter + 1

            fn = jax.jit(step, donate_argnums=(0, 1))
            n = 40 if M > 100 else 100
            sec, _ = timed(lambda c, i: fn(c, i, table_d, info), (F.cache_init(cache_slots, R), jnp.int32(0)), n)
            row[mode] = dict(ms_per_step=sec * 1e3, gbps=M * R / sec / 1e9)
        xla_rows.append(row)
        log(f"gather in a jitted step, {M:3d} misses: " + ", ".join(
            f"{m} {v['ms_per_step']:.3f} ms ({v['gbps']:.1f} GB/s)" for m, v in row.items() if m != "misses"))
    res["gather_xla"] = xla_rows


# ----- a decode step of 48 layers ------------------------------------------------------------------------------
def layers_section(res, pool):
    """48 layers per jitted step, each: resolve (skewed decode routing) -> gather -> a dependent read of the
    10 routed slots -> a dense bf16 MLP standing in for the layer's other work. Compares the gather modes in
    the setting that matters: the memcpy path must sync the stream once per layer."""
    L, steps = (4, 8) if ARGS.cpu_smoke else (48, 48)
    rng = np.random.default_rng(9)
    trace = zipf_routing(rng, 2 * steps, L, 1)  # the first `steps` steps warm the caches, the rest are timed
    models = [LruModel(SLOTS, E) for _ in range(L)]
    miss_bytes = hits = misses = 0
    for s in range(2 * steps):
        for layer in range(L):
            _, m, distinct = models[layer].resolve(trace[s, layer])
            if s >= steps:
                miss_bytes += len(m) * R
                misses += len(m)
                hits += distinct - len(m)
    hit_rate = hits / (hits + misses)
    trace_d = jnp.asarray(trace)
    w1 = jnp.asarray(rng.standard_normal((2560, 8192)) * 0.02, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((8192, 2560)) * 0.02, jnp.bfloat16)

    def make(mode):
        def step(states, caches, x, counter, trace, w1, w2):
            ids = trace[counter % (2 * steps)]
            new_states, new_caches = [], []
            for layer in range(L):
                r = F.resolve(ids[layer], states[layer], num_slots=SLOTS, num_experts=E)
                c = caches[layer]
                if mode != "none":
                    c = F.gather(r.misses, r.info, c, pool=pool, layer=0, mode=mode)
                touched = c[r.slots.reshape(-1), :4096].astype(jnp.float32).sum()
                x = (jnp.tanh(x @ w1) @ w2 + touched * 1e-12).astype(jnp.bfloat16)
                new_states.append(r.state)
                new_caches.append(c)
            return tuple(new_states), tuple(new_caches), x, counter + 1

        return jax.jit(step, donate_argnums=(0, 1, 2, 3))

    out = dict(layers=L, steps=steps, lru_hit_rate=hit_rate, miss_gb_per_step=miss_bytes / steps / 1e9)
    caches = tuple(F.cache_init(SLOTS, R) for _ in range(L))
    for mode in ("none", "zero_copy", "memcpy"):
        fn = make(mode)
        states = tuple(jnp.asarray(F.lru_state_init(SLOTS, E)) for _ in range(L))
        carry = (states, caches, jnp.zeros((1, 2560), jnp.bfloat16), jnp.int32(0))
        sec, carry = timed(lambda *c: fn(*c, trace_d, w1, w2), carry, steps, warm=steps)
        caches = carry[1]
        out[mode] = dict(ms_per_step=sec * 1e3)
        log(f"{L}-layer decode step, gather {mode:9s}: {sec * 1e3:7.3f} ms/step")
    floor = out["none"]["ms_per_step"] + out["miss_gb_per_step"] / 55.0 * 1e3
    out["floor_ms_at_55GBps"] = floor
    log(f"  LRU hit rate {hit_rate:.3f}, misses {out['miss_gb_per_step']:.3f} GB/step; compute-only step + misses "
        f"at 55 GB/s = {floor:.3f} ms")
    res["layers"] = out


# ----- resolve ---------------------------------------------------------------------------------------------------
def resolve_section(res):
    layers, steps = 48, 64
    rng = np.random.default_rng(5)
    out = []
    for T in (1, 16):
        trace = jnp.asarray(zipf_routing(rng, steps, layers, T))

        def step(states, counter, trace):
            ids = trace[counter % steps]
            new = tuple(F.resolve(ids[l], states[l], num_slots=SLOTS, num_experts=E).state for l in range(layers))
            return new, counter + 1

        def empty(states, counter, trace):
            return states, counter + 1

        states = tuple(jnp.asarray(F.lru_state_init(SLOTS, E)) for _ in range(layers))
        fn = jax.jit(step, donate_argnums=(0, 1))
        sec, _ = timed(lambda s, c: fn(s, c, trace), (states, jnp.int32(0)), 300)
        fn0 = jax.jit(empty, donate_argnums=(0, 1))
        states = tuple(jnp.asarray(F.lru_state_init(SLOTS, E)) for _ in range(layers))
        sec0, _ = timed(lambda s, c: fn0(s, c, trace), (states, jnp.int32(0)), 300)
        row = dict(tokens=T, ids_per_layer=T * K_TOP, layers=layers, step_ms=sec * 1e3, empty_step_ms=sec0 * 1e3,
                   us_per_layer=(sec - sec0) / layers * 1e6)
        out.append(row)
        log(f"resolve, T={T:2d} ({T * K_TOP} ids/layer), {layers} layers per step: {sec * 1e3:.3f} ms/step "
            f"(empty step {sec0 * 1e3:.3f} ms) -> {row['us_per_layer']:.2f} us per layer")
    res["resolve"] = out


# ----- PLE -------------------------------------------------------------------------------------------------------
def ple_section(res, table, cfg):
    h = F.NgramHash.from_config(cfg)
    out = []
    for B, T in ((1, 1), (8, 1), (1, 512)):
        toks = jnp.asarray(np.random.default_rng(B * T).integers(0, cfg.vocab_size, (16, B, T)).astype(np.int32))

        def step(ctx, counter, toks):
            # rows/ids stay temporaries, as in the model (returning them would give them new addresses each call)
            p = F.ple_step(toks[counter % 16], ctx, table, h)
            return p.context, counter + 1

        def empty(ctx, counter, toks):
            return ctx + 0 * toks[counter % 16][:, :1], counter + 1

        ctx0 = lambda: jnp.asarray(F.ngram_context_init(B, cfg.eos_token_id))  # noqa: E731
        fn = jax.jit(step, donate_argnums=(0, 1))
        sec, _ = timed(lambda c, i: fn(c, i, toks), (ctx0(), jnp.int32(0)), 200)
        fn0 = jax.jit(empty, donate_argnums=(0, 1))
        sec0, _ = timed(lambda c, i: fn0(c, i, toks), (ctx0(), jnp.int32(0)), 200)
        row = dict(batch=B, tokens=T, step_ms=sec * 1e3, empty_step_ms=sec0 * 1e3, ple_ms=(sec - sec0) * 1e3)
        out.append(row)
        log(f"PLE host step B={B} T={T}: {sec * 1e3:.3f} ms/step vs empty {sec0 * 1e3:.3f} ms -> "
            f"{row['ple_ms']:.3f} ms")
    res["ple"] = out


def scan_dump(res):
    hits, lines = [], []
    for path in sorted(glob.glob(os.path.join(DUMP_DIR, "*"))):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except (OSError, IsADirectoryError):
            continue
        n = text.count("command_buffer") + text.count("CommandBuffer")
        if n:
            hits.append((os.path.basename(path), n))
            lines += [ln.strip()[:200] for ln in text.splitlines()
                      if ("command_buffer" in ln or "CommandBuffer" in ln) and "jaxflash" in ln][:5]
    step_files = [p for p in glob.glob(os.path.join(DUMP_DIR, "*jit_step*")) if os.path.isfile(p)]
    if step_files:
        import tarfile

        with tarfile.open(os.path.join(ARGS.out, "xla_dump_step.tar.gz"), "w:gz") as tar:
            for p in step_files:
                if os.path.getsize(p) < 4 << 20:
                    tar.add(p, arcname=os.path.basename(p))
    res["xla_dump_command_buffer_mentions"] = [h for h in hits if "jit_step" in h[0]][:20] or hits[:20]
    res["xla_dump_command_buffer_lines"] = lines[:20]
    log(f"XLA dump: {len(hits)} files mention command buffers" + (f", e.g. {hits[:3]}" if hits else ""))


def main():
    os.makedirs(ARGS.out, exist_ok=True)
    sections = set(ARGS.only.split(","))
    dev = jax.devices()[0]
    mod = F.module()
    res = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, xla_flags=os.environ["XLA_FLAGS"],
               module=mod.__name__, record_bytes=R, num_experts=E, slots=SLOTS, host_memory=str(F.read_host_memory()))
    log(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, module {mod.__name__}")
    log(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
    log(f"expert record {R} bytes (NVFP4 H={H} I={I}), {E} experts, {SLOTS} slots/layer, top-{K_TOP}")
    smoke = ARGS.cpu_smoke
    if not smoke and (dev.platform != "gpu" or not mod.has_cuda):
        sys.exit("ffi_bench needs a CUDA GPU and jaxflash_ffi_cuda (or --cpu-smoke)")

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    pool = make_pool(rng)
    res["pool"] = dict(pinned=pool.pinned, note=pool.note, gib=pool.nbytes / 2**30)
    log(f"pool: {pool.nbytes / 2**30:.2f} GiB, pinned={pool.pinned} {pool.note} ({time.perf_counter() - t0:.1f} s)")
    cfg = presets.full().replace(ngram_vocab_size_base=100_000)  # real vocab/eos/hash; 1.6M-row table
    name = "ngram_nocmdbuf.bin" if ARGS.no_command_buffer else "ngram.bin"
    table, table_data = make_table(os.path.join(tempfile.gettempdir(), f"jaxflash_ffi_bench_{name}"), cfg)
    res["ngram_table"] = dict(rows=table.rows, row_bytes=table.row_bytes, staging_pinned=table.staging_pinned)

    if "capture" in sections:
        capture_section(res, pool, table, table_data, cfg, max(ARGS.steps, 100) if not ARGS.no_command_buffer
                        else ARGS.steps)
        if not ARGS.no_command_buffer:
            capture_section(res, pool, table, table_data, cfg, 40, mode="memcpy")
            if not smoke:
                uncaptured_child(res, min(ARGS.steps, 40))
            if ARGS.dump:
                scan_dump(res)
    if "gather" in sections:
        gather_section(res, pool, smoke)
    if "layers" in sections:
        layers_section(res, pool)
    if "resolve" in sections:
        resolve_section(res)
    if "ple" in sections:
        ple_section(res, table, cfg)

    path = ARGS.json or os.path.join(ARGS.out, "ffi_bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    table.close()
    pool.close()
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
