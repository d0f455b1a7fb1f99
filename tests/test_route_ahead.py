"""benchmarks/route_ahead.py: its cache walk counts misses, named misses and wasted guesses as defined, on a
hand-worked sequence."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import route_ahead  # noqa: E402


def test_cache_walk_counts_by_hand():
    # one window of 3 tokens, top-2, 2 slots: token 0 fills the cache with {0, 1} (not scored); token 1 uses
    # {1, 2}: expert 2 misses; token 2 uses {2, 3} with {1, 2} cached: expert 3 misses. So 2 misses of 4 scored
    # uses.
    actual = np.array([[0, 1], [1, 2], [2, 3]])
    good = np.array([[5, 5], [2, 3], [0, 3]])  # names both misses; 3 (token 1) and 0 (token 2) are wasted
    bad = np.array([[5, 5], [0, 3], [1, 0]])  # names neither; 3 and 0 wasted; 0 (cached at token 1) and 1 not
    r = route_ahead.cache_walk(actual, {"good": good, "bad": bad}, T=3, slots=2, num_experts=6)
    assert (r["misses"], r["uses"]) == (2, 4)
    assert r["miss_rate"] == pytest.approx(0.5)
    assert (r["good_covers"], r["good_wasted"]) == (pytest.approx(1.0), pytest.approx(1.0))
    assert (r["bad_covers"], r["bad_wasted"]) == (pytest.approx(0.0), pytest.approx(1.0))


def test_cache_walk_starts_each_window_cold():
    # two windows of 2 tokens, top-1, 3 slots: with the cache kept across windows, token 1 of window 2 (expert
    # 0, used in window 1) would hit; cold, it misses
    actual = np.array([[0], [1], [2], [0]])
    r = route_ahead.cache_walk(actual, {"g": np.array([[9], [1], [9], [0]])}, T=2, slots=3, num_experts=10)
    assert (r["misses"], r["uses"]) == (2, 2)
    assert r["g_covers"] == pytest.approx(1.0)
