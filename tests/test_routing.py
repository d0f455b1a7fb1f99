"""benchmarks/routing.py: the calibrated routing model against the published figures, its vectorised cache
simulators against plain replays (jaxflash.ffi.reference.LruModel for LRU), and the call that records the
bundled model's routing."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from jaxflash.ffi.reference import LruModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import routing  # noqa: E402  (benchmarks/routing.py, as its docstring says to import it)


def _skewed_trace(rng, steps, rows, n, E):
    """Ids [steps, rows, n] skewed towards small ids, with repeats within a step and -1 padding."""
    ids = np.minimum(rng.integers(0, E, (steps, rows, n)), rng.integers(0, E, (steps, rows, n)))
    return np.where(rng.random(ids.shape) < 0.1, -1, ids)


def _lru_replay(trace, slots, E):
    """Per-step (hits, misses) [steps, rows] of LruModel, one model per row."""
    T, B, _ = trace.shape
    hits, misses = np.zeros((T, B), np.int64), np.zeros((T, B), np.int64)
    for b in range(B):
        model = LruModel(slots, E)
        for t in range(T):
            h, m = model.hits, model.misses
            model.resolve([e for e in trace[t, b] if e >= 0])
            hits[t, b], misses[t, b] = model.hits - h, model.misses - m
    return hits, misses


def _traces():
    rng = np.random.default_rng(5)
    yield _skewed_trace(rng, 150, 3, 6, 20), 20, (6, 7, 12, 20)
    ids, _ = routing.RoutingModel(3, 64, 8, seed=2).sample(100, 2)
    yield routing.layer_rows(ids), 64, (8, 16, 40)
    # two streams sharing each layer's cache (a decode batch): the union of their ids, repeats counted once
    yield routing.batch_rows(ids), 64, (16, 30)


@pytest.mark.parametrize("case", range(3))
def test_lru_simulator_is_lru_model(case):
    trace, E, slot_counts = list(_traces())[case]
    for slots in slot_counts:
        fast = routing.lru_hits(trace, slots, E)
        ref = _lru_replay(trace, slots, E)
        np.testing.assert_array_equal(fast[0], ref[0], err_msg=f"hits at {slots} slots")
        np.testing.assert_array_equal(fast[1], ref[1], err_msg=f"misses at {slots} slots")
        assert 0 < fast[0].sum() < fast[0].sum() + fast[1].sum()


def test_lru_simulator_refuses_too_many_experts():
    with pytest.raises(ValueError, match="distinct experts"):
        routing.lru_hits(np.arange(6).reshape(1, 1, 6), 5, 8)


def _lfu_replay(trace, slots, E):
    """Plain LFU with the simulator's tie-breaking: fewest uses so far, then least recent, then lower slot."""
    T, B, _ = trace.shape
    hits = np.zeros((T, B), np.int64)
    for b in range(B):
        holder, stamp, uses = [None] * slots, [-1] * slots, [0] * E
        for t in range(T):
            wanted = sorted({int(e) for e in trace[t, b] if e >= 0})
            kept = {holder.index(e) for e in wanted if e in holder}
            new = [e for e in wanted if e not in holder]
            free = sorted((-1 if holder[v] is None else uses[holder[v]], stamp[v], v)
                          for v in range(slots) if v not in kept)
            for e, (_, _, v) in zip(new, free):
                holder[v], stamp[v] = e, t + 1
            for v in kept:
                stamp[v] = t + 1
            for e in wanted:
                uses[e] += 1
            hits[t, b] = len(kept)
    return hits


def test_lfu_simulator_is_plain_lfu():
    for trace, E, slot_counts in _traces():
        for slots in slot_counts:
            np.testing.assert_array_equal(routing.lfu_hits(trace, slots, E)[0], _lfu_replay(trace, slots, E))


def test_pinned_hits_is_plain_replay():
    rng = np.random.default_rng(8)
    trace = _skewed_trace(rng, 80, 4, 5, 12)
    pinned = rng.random((4, 12)) < 0.5
    hits, misses = routing.pinned_hits(trace, pinned)
    for b in range(4):
        seen, h = set(), 0
        for t in range(80):
            wanted = {int(e) for e in trace[t, b] if e >= 0}
            h += sum(1 for e in wanted if pinned[b, e] and e in seen)
            seen |= wanted
        assert hits[:, b].sum() == h
        assert hits[:, b].sum() + misses[:, b].sum() == sum(len({e for e in r if e >= 0}) for r in trace[:, b])


@pytest.mark.parametrize("seed", [0, 1])
def test_calibrated_model_reproduces_published_figures(seed):
    stats = routing.calibrated(seed=seed)
    P = routing.PUBLISHED
    for slots, target in P["hit_rate"].items():
        assert abs(stats["lru"][slots] - target) <= 0.03, (slots, stats["lru"][slots], target)
    assert abs(stats["touched_layer0"] / P["touched_layer0"] - 1) <= 0.10, stats["touched_layer0"]
    assert abs(stats["top_share"] / P["top64_share"] - 1) <= 0.10, stats["top_share"]
    assert abs(stats["top_share_layer0"] / P["top64_share"] - 1) <= 0.10, stats["top_share_layer0"]
    assert abs(stats["pinned"][186] - P["pinned"][186]) <= 0.03, stats["pinned"][186]
    for slots in (93, 186, 279, 372):
        assert stats["pinned"][slots] < stats["lru"][slots], slots  # pinning loses to LRU
    assert stats["pinned"][512] == pytest.approx(stats["lru"][512])  # all pinned = all cached: cold misses only
    # the 85% at 512 slots needs the average layer to touch more experts than layer 0 does
    assert stats["touched_all"] > stats["touched_layer0"] + 30
    assert routing.check(stats) == []


def test_check_flags_a_missed_figure():
    stats = {"lru": dict(routing.PUBLISHED["hit_rate"]), "pinned": {186: 0.594, 512: 0.85},
             "touched_layer0": 384.0, "top_share": 0.41, "top_share_layer0": 0.41}
    assert routing.check(stats) == []
    assert len(routing.check({**stats, "lru": {**stats["lru"], 279: 0.755}})) == 1
    assert len(routing.check({**stats, "touched_layer0": 430.0})) == 1
    assert len(routing.check({**stats, "pinned": {186: 0.63, 512: 0.85}})) == 2  # off target, and beats LRU


@pytest.mark.parametrize("config", [(8, 16, 4), (48, 512, 10), (2, 4, 4)])
def test_rows_are_valid_routing(config):
    L, E, k = config
    ids, w = routing.RoutingModel(L, E, k, seed=4).sample(40, 3)
    assert ids.shape == w.shape == (3, 40, L, k) and ids.dtype == np.int32 and w.dtype == np.float32
    assert ids.min() >= 0 and ids.max() < E
    assert (np.diff(np.sort(ids, axis=-1), axis=-1) > 0).all()  # distinct within a row
    assert (w > 0).all() and np.allclose(w.sum(-1), 1.0, atol=1e-5)
    assert (np.diff(w, axis=-1) <= 0).all()  # heaviest first


def test_seeds_streams_and_prefixes():
    model = routing.RoutingModel(8, 16, 4, seed=3)
    ids, w = model.sample(40, 3)
    again, w2 = routing.RoutingModel(8, 16, 4, seed=3).sample(40, 3)
    np.testing.assert_array_equal(ids, again)
    np.testing.assert_array_equal(w, w2)
    other, _ = routing.RoutingModel(8, 16, 4, seed=4).sample(40, 3)
    assert (other != ids).mean() > 0.5
    assert (ids[0] != ids[1]).mean() > 0.5  # streams differ
    np.testing.assert_array_equal(model.sample(40, 2, first_stream=1)[0], ids[1:])  # a stream is its own
    np.testing.assert_array_equal(model.sample(23, 3)[0], ids[:, :23])  # a longer sample extends a shorter one
    np.testing.assert_array_equal(routing.RoutingModel(3, 16, 4, seed=3).sample(40, 3)[0], ids[:, :, :3])


def test_streams_share_popularity_and_reuse_recent_experts():
    """Usage counts of two streams correlate (shared popularity); which experts a token shares with the one
    before is far above chance (temporal reuse)."""
    model = routing.RoutingModel(4, 64, 8, seed=0)
    ids, _ = model.sample(300, 2)
    counts = routing.usage_counts(ids, 64).astype(float)  # [streams, layers, E]
    corr = [np.corrcoef(counts[0, layer], counts[1, layer])[0, 1] for layer in range(4)]
    assert min(corr) > 0.3, corr
    same = (ids[:, 1:, :, :, None] == ids[:, :-1, :, None, :]).any(-1).mean()
    assert same > 2 * 8 / 64, same


def test_model_routing_of_the_bundled_model():
    import jaxflash

    engine = jaxflash.load(dtype="float32", progress=False)
    cfg = engine.config
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
    ids = routing.model_routing(engine.params, cfg, tokens)
    assert ids.shape == (2, 24, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert ids.min() >= 0 and ids.max() < cfg.num_experts
    assert (np.diff(np.sort(ids, axis=-1), axis=-1) > 0).all()
