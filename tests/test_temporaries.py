"""No large buffer that depends on nothing: what keeps a prefill chunk's temporaries to one layer's worth.

A value computed from constants alone (a zero-filled array, lax.scan's stacked outputs, which it lowers into a
buffer filled before the loop) can run anywhere in the program. XLA:GPU builds such buffers of all layers at
once, in one fused kernel at the start, and they stay until their layer runs: on the H200 the full-size prefill
program of 2048-token chunks held 26.4 GiB of temporaries, about 0.54 GiB per layer (the grouped kernels'
zero-filled [rows, H] tiles and output, the GDN chunk loop's output), and chunks of 8192 did not fit
(benchmarks/prefill_memory.py; RESULTS.md). These tests walk the programs' jaxprs for such values of a
chunk's size or more: the prefill program of an engine in both residencies, and the pieces that run only on a
GPU there (the grouped kernels, in interpret mode; the cache's block loop with the kernels).
"""

from __future__ import annotations

import math

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflash.engine.experts import CachedExperts, ChunkExperts, HostExperts
from jaxflash.ffi.experts import ExpertLayout
from jaxflash.model import gated_deltanet, moe

from test_expert_kernel import random_experts, records_of


# Where a value is materialised as a buffer of its own: the target of an in-place update, a loop's operands, a
# kernel's operands. Elsewhere (an elementwise consumer) XLA fuses a constant broadcast away.
MATERIALISED = {"scatter": (0,), "scatter-add": (0,), "scatter_add": (0,), "dynamic_update_slice": (0,)}
ALL_OPERANDS = ("while", "scan", "cond", "pallas_call", "ffi_call", "custom_call")


def _sub_jaxprs(eqn):
    """The jaxprs a call runs on its operands as they are (pjit, closed_call, custom_jvp/vjp): those whose
    inputs are the equation's inputs one for one."""
    for v in eqn.params.values():
        x = v.jaxpr if isinstance(v, jex.ClosedJaxpr) else v
        if isinstance(x, jex.Jaxpr) and len(x.invars) == len(eqn.invars):
            yield x


def buffers_from_nothing(fn, *args, min_elems: int) -> list[str]:
    """'primitive shape' of each value of fn's jaxpr (at any depth of calls) of at least min_elems elements
    that depends on none of fn's arguments and is materialised (MATERIALISED, ALL_OPERANDS), and of each
    stacked output of a scan of that size (lax.scan fills them in a buffer made before the loop)."""
    found = []

    def walk(jaxpr, depends):
        dep = dict(zip(jaxpr.invars, depends))
        made_by = {}
        for eqn in jaxpr.eqns:
            ins = [None if isinstance(v, jex.Literal) else v for v in eqn.invars]
            d = any(dep.get(v, False) for v in ins if v is not None)
            name = eqn.primitive.name
            subs = list(_sub_jaxprs(eqn))
            for sub in subs:
                walk(sub, [v is None or dep.get(v, False) for v in ins])
            if not subs:
                where = range(len(ins)) if name in ALL_OPERANDS else MATERIALISED.get(name, ())
                for i in where:
                    v = ins[i]
                    if v is not None and not dep.get(v, False) and math.prod(v.aval.shape) >= min_elems:
                        found.append(f"{made_by.get(v, 'argument')} {v.aval.str_short()} into {name}")
            if name == "scan":
                for v in eqn.outvars[eqn.params["num_carry"]:]:
                    if math.prod(v.aval.shape) >= min_elems:
                        found.append(f"scan output {v.aval.str_short()}")
            for v in eqn.outvars:
                dep[v], made_by[v] = d, name

    closed = jax.make_jaxpr(fn)(*args)
    walk(closed.jaxpr, [True] * len(closed.jaxpr.invars))
    return found


def test_the_check_finds_zeros_and_stacked_scan_outputs():
    """The check itself: a zero-filled buffer, and a scan's stacked outputs, are found; the same values built
    from the argument are not."""
    x = jnp.ones((64, 8))

    def zeros_then_set(x):
        return jnp.zeros((128, 8)).at[:64].set(x)

    def scanned(x):
        return jax.lax.scan(lambda c, r: (c, r * 2), None, x)[1]

    assert buffers_from_nothing(zeros_then_set, x, min_elems=512) == [
        "broadcast_in_dim float32[128,8] into scatter"]
    assert buffers_from_nothing(scanned, x, min_elems=512) == ["scan output float32[64,8]"]
    assert buffers_from_nothing(lambda x: jnp.concatenate([x, x]).at[:64].set(x), x, min_elems=512) == []
    assert buffers_from_nothing(lambda x: jnp.concatenate([x, x]) + jnp.zeros((128, 8)), x, min_elems=512) == []
    assert buffers_from_nothing(zeros_then_set, x, min_elems=2048) == []  # below the size asked about


def _engine(residency, tmp_path):
    from jaxflash import ffi
    from jaxflash.engine import Engine, planner
    from jaxflash.model.weights import load_params
    from jaxflash.synthetic import SyntheticSource, make_config

    cfg = make_config("tiny")
    src = SyntheticSource(cfg, seed=0)
    params = load_params(src, cfg, "float32", routed_experts=residency == "device")
    table = src.ngram_table()
    path = tmp_path / "ngram.bin"
    path.write_bytes(b"".join(np.ascontiguousarray(shard).tobytes() for shard in table.shards))
    ngram = (ffi.NgramTable([(str(path), 0, table.rows)], head_dim=table.dim, dtype=table.dtype,
                            heads=cfg.num_ngram_heads), table.scale)
    host = None
    if residency == "host":
        layout = ffi.ExpertLayout.from_config(cfg, "nvfp4")
        pool = ffi.ExpertPool(layout, cfg.num_hidden_layers, cfg.num_experts)
        host = HostExperts(pool, layout, 4)
    mb = planner.ModelBytes(sum(x.nbytes for x in jax.tree.leaves(params)), 0, 0)
    plan = planner.plan(cfg, mb, residency="device", budget=2**30, max_batch=2, max_seq_len=128,
                        prefill_chunk=32)
    return cfg, Engine(cfg, params, plan=plan, host_experts=host, ngram=ngram)


@pytest.mark.parametrize("residency", ["device", "host"])
def test_the_prefill_program_builds_no_chunk_sized_buffer_from_nothing(residency, tmp_path):
    cfg, engine = _engine(residency, tmp_path)
    chunk = engine.plan.prefill_chunk
    run, args = engine.scheduler.runner.program_fn("prefill")
    # twice a chunk's hidden rows: the tiles' index vectors (an int per row) stay below, their rows do not
    assert buffers_from_nothing(run, *args, min_elems=2 * chunk * cfg.hidden_size) == []


def test_grouped_kernels_and_their_tiles_build_nothing_from_nothing():
    """moe.experts_grouped: plan_tiles' rows gathered from x, the kernels' output written whole (no zero-filled
    y0), in interpret mode as on the CPU."""
    rng = np.random.default_rng(0)
    e, h, i, k, n = 7, 64, 32, 2, 96
    ex = random_experts(rng, e, h, i)
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
    w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
    fn = lambda ex, x, ids, w: moe.experts_grouped(ex, x, ids, w, interpret=True)  # noqa: E731
    assert buffers_from_nothing(fn, ex, x, ids, w, min_elems=n * h) == []
    assert buffers_from_nothing(moe.experts_tiled, ex, x, ids, w, min_elems=n * h) == []


@pytest.mark.parametrize("overlap", [False, True])  # copy then compute; each block's copy beside the kernels
@pytest.mark.parametrize("kernel", [False, True])
def test_the_cache_block_loop_builds_nothing_from_nothing(kernel, overlap):
    from jaxflash import ffi

    rng = np.random.default_rng(1)
    e, h, i, k, n = 9, 64, 32, 2, 48
    ex = random_experts(rng, e, h, i)
    layout = ExpertLayout("nvfp4", h, i)
    pool = ffi.ExpertPool(layout, 1, e)
    pool.array[0] = records_of(layout, ex)
    with pool:
        src = ChunkExperts(CachedExperts.empty(HostExperts(pool, layout, 4, kernel=kernel, overlap=overlap), 1))
        x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
        w = jnp.asarray(rng.uniform(size=(n, k)), jnp.float32)
        fn = lambda s, x, ids, w: s.routed(0, None, x, ids, w, jnp.ones(n, bool))  # noqa: E731
        assert buffers_from_nothing(fn, src, x, ids, w, min_elems=n * h) == []


def test_the_gdn_chunk_loop_builds_nothing_from_nothing():
    rng = np.random.default_rng(2)
    t, hv, dk, dv = 256, 2, 16, 32
    q, k = (jnp.asarray(rng.normal(size=(t, hv, dk)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(t, hv, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(size=(t, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(t, hv)), jnp.float32)
    state = jnp.zeros((hv, dk, dv), jnp.float32)
    found = buffers_from_nothing(gated_deltanet.chunk_gated_delta_rule, q, k, v, g, beta, state,
                                 min_elems=t * hv * dv)
    assert found == []
