"""Helpers of the kernel benchmarks (expert_kernel.py, gdn_kernel.py, hc_kernel.py): GPU kernel time from a
profiler trace, wall time, a state-donating stepper, the relative error of two trees, the copy ceiling."""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trace_parts  # noqa: E402

COPY_CEILING = 4.2e12  # bytes/s: a device-to-device copy on the H200 moves 4.2-4.3 TB/s (read + write)


def log(msg=""):
    print(msg, flush=True)


def trace_kernels(fn, args, reps: int) -> tuple[float, int]:
    """(summed GPU kernel time in us, kernel count) per call of fn(*args), from a profiler trace of `reps` calls."""
    total, n, _ = trace_kernels_by_name(fn, args, reps, top=0)
    return total, n


def trace_kernels_by_name(fn, args, reps: int, top: int = 14) -> tuple[float, int, list[tuple[str, float]]]:
    """trace_kernels' figures and the `top` kernel names by GPU time per call (us)."""
    import collections

    import jax

    d = tempfile.mkdtemp(prefix="kernel_trace_")
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
    ks = trace_parts.gpu_kernels(d)
    by = collections.Counter()
    for e in ks:
        by[e["name"]] += float(e["dur"]) / reps
    return sum(by.values()), len(ks) // reps, by.most_common(top) if top else []


class Stepper:
    """A jitted fn(state, *rest) -> (out, new state) that donates its state: each call feeds the previous call's
    state back (the engine's decode steps do the same), so in-place updates need no copy."""

    def __init__(self, fn, state, *rest):
        self.fn, self.state, self.rest = fn, state, rest

    def __call__(self):
        out, self.state = self.fn(self.state, *self.rest)
        return out, self.state


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over all leaves of two trees of arrays, in float64."""
    import jax
    import numpy as np

    a = np.concatenate([np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(a)])
    b = np.concatenate([np.asarray(t, np.float64).ravel() for t in jax.tree.leaves(b)])
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def wall_us(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps * 1e6
