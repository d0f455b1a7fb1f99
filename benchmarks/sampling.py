"""GPU time of the decode step's sampling and of candidate forms without a full-vocabulary sort (issue 14).

The engine samples through `engine.sampling.sample`. Its programs built with Want.filters (RICH: a request in
the batch uses top-k, top-p or min-p, logprobs or a grammar) sort the whole vocabulary per row (XLA:GPU runs it
as a cub radix sort, outside the CUDA graph of the step); PLAIN programs do not. This times, per call on logits
[rows, V] (float32, random), from a profiler trace (summed kernel time and kernel count):
  engine        the engine's sampling with filters (temperature 0.8, top-p 0.95; what RICH runs)
  plain         the engine's sampling without filters (temperature 0.8: what PLAIN runs)
  plain greedy  the same program, every row greedy
  logprobs      the log-probabilities and top alternatives RICH returns (runner.logprobs_of)
  argmax        greedy alone
  gumbel        a draw from the whole softmax without a sort (Gumbel noise + argmax; no top-k/p/min-p)
  top_k C       lax.top_k(logits, C): a partial selection of C candidates
  grouped C     top C of each 1024-wide group of the vocabulary, then the top C of those
  radix         the k-th largest value of each row by 8 passes of 16-bin counts over the vocabulary (the
                threshold a sort-free top-k / top-p would search for), k = 50
The forms after `logprobs` are candidates for a filtered sampler without the full sort; they live here only.

    python3 benchmarks/sampling.py --out DIR                 # on the GPU
    python3 benchmarks/sampling.py --forms engine,plain,plain_greedy,logprobs --out DIR
    python3 benchmarks/sampling.py --vocab 4096 --reps 2     # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import log, trace_kernels  # noqa: E402
from results_file import write_json  # noqa: E402


def ordered_key(x):
    """float32 -> uint32 keys in the same order."""
    import jax.numpy as jnp
    from jax import lax

    b = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) != 0, ~b, b | jnp.uint32(0x80000000))


def radix_kth_key(x, k: int, bits: int = 4):
    """The key (ordered_key) of each row's k-th largest value of x [R, V]: 32 / bits passes, each counting the
    entries under the prefix found so far by their next digit."""
    import jax.numpy as jnp

    key = ordered_key(x)
    r = x.shape[0]
    digits = jnp.arange(1 << bits, dtype=jnp.uint32)
    prefix = jnp.zeros((r,), jnp.uint32)
    need = jnp.full((r,), k, jnp.int32)
    for shift in range(32 - bits, -1, -bits):
        d = (key >> shift) & jnp.uint32((1 << bits) - 1)
        under = jnp.ones(key.shape, bool) if shift + bits == 32 else (key >> (shift + bits)) == prefix[:, None]
        counts = jnp.sum(under[:, None, :] & (d[:, None, :] == digits[None, :, None]), axis=-1, dtype=jnp.int32)
        at_least = jnp.cumsum(counts[:, ::-1], axis=-1)[:, ::-1]  # entries with digit >= each digit
        pick = jnp.sum(at_least >= need[:, None], axis=-1, dtype=jnp.int32) - 1  # the largest such digit
        need = need - (jnp.take_along_axis(at_least, pick[:, None], 1)[:, 0]
                       - jnp.take_along_axis(counts, pick[:, None], 1)[:, 0])
        prefix = (prefix << bits) | pick.astype(jnp.uint32)
    return prefix


def variants(vocab: int):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxflash.engine import sampling

    from jaxflash.engine.runner import logprobs_of

    def engine(temperature: float, top_p: float, filters: bool):
        def f(logits):
            r = logits.shape[0]
            rows = sampling.SamplingRows(jnp.full(r, temperature, jnp.float32), jnp.zeros(r, jnp.int32),
                                         jnp.full(r, top_p, jnp.float32), jnp.zeros(r, jnp.float32),
                                         jnp.arange(r, dtype=jnp.uint32))
            return sampling.sample(logits, rows, jnp.arange(r, dtype=jnp.int32), filters=filters)
        return f

    def gumbel(logits):
        g = jax.random.gumbel(jax.random.key(0), logits.shape, jnp.float32)
        return jnp.argmax(logits / 0.8 + g, axis=-1)

    def grouped(c):
        def f(logits):
            r, v = logits.shape
            g = -(-v // 1024)
            x = jnp.pad(logits, ((0, 0), (0, g * 1024 - v)), constant_values=-jnp.inf).reshape(r, g, 1024)
            vals, idx = lax.top_k(x, c)
            idx = idx + (jnp.arange(g) * 1024)[None, :, None]
            top, at = lax.top_k(vals.reshape(r, -1), c)
            return top, jnp.take_along_axis(idx.reshape(r, -1), at, axis=-1)
        return f

    out = {"engine": engine(0.8, 0.95, True), "plain": engine(0.8, 1.0, False), "plain_greedy": engine(0.0, 1.0, False),
           "logprobs": lambda x: logprobs_of(x, jnp.argmax(x, axis=-1)),
           "argmax": lambda x: jnp.argmax(x, axis=-1), "gumbel": gumbel}
    for c in (16, 64, 256, 1024):
        if c <= vocab:
            out[f"top_k {c}"] = (lambda c: lambda x: lax.top_k(x, c))(c)
    for c in (16, 64):
        if 1024 * 2 <= vocab:
            out[f"grouped {c}"] = grouped(c)
    out["radix"] = lambda x: radix_kth_key(x, 50)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248320, help="vocabulary (the full-size model's by default)")
    ap.add_argument("--rows", default="1,4,8", help="comma-separated rows per call (a step's sequences, or a "
                                                    "verify step's rows)")
    ap.add_argument("--reps", type=int, default=20, help="traced calls per form")
    ap.add_argument("--forms", default=None, help="comma-separated forms to time (default: all)")
    ap.add_argument("--out", default=None, help="directory for sampling.json")
    args = ap.parse_args()

    import jax
    import numpy as np

    dev = jax.devices()[0]
    log(f"device: {dev.device_kind}, jax {jax.__version__}, vocab {args.vocab}, {args.reps} calls per form")
    rng = np.random.default_rng(0)
    results = {"device": dev.device_kind, "jax": jax.__version__, "vocab": args.vocab, "reps": args.reps, "runs": []}
    forms = variants(args.vocab)
    chosen = list(forms) if args.forms is None else args.forms.split(",")
    if unknown := set(chosen) - set(forms):
        ap.error(f"unknown forms {sorted(unknown)}; known: {', '.join(forms)}")
    for rows in (int(r) for r in args.rows.split(",")):
        logits = jax.device_put(rng.standard_normal((rows, args.vocab)).astype(np.float32) * 3)
        if "radix" in chosen:
            kth = np.sort(np.asarray(logits), axis=-1)[:, ::-1][:, 49]
            got = np.asarray(jax.jit(forms["radix"])(logits))
            assert (got == np.asarray(ordered_key(jax.numpy.asarray(kth)))).all(), "radix: wrong k-th value"
        for c in (16, 64):
            if f"grouped {c}" in chosen:
                want = np.asarray(jax.lax.top_k(logits, c)[0])
                assert (np.asarray(jax.jit(forms[f"grouped {c}"])(logits)[0]) == want).all(), "grouped: wrong values"
        for name in chosen:
            fn = forms[name]
            us, n = trace_kernels(jax.jit(fn), (logits,), args.reps)
            log(f"  rows {rows:2d}  {name:12s} {us:8.1f} us  {n:4d} kernels")
            results["runs"].append({"rows": rows, "form": name, "us": us, "kernels": n})
    write_json(args.out, "sampling.json", results)


if __name__ == "__main__":
    main()
