#!/usr/bin/env python3
"""How well can a layer's routed experts be known before its MoE block runs? (CPU, a trained checkpoint)

A host-residency decode step could fetch a layer's experts over PCIe while earlier work computes, if it knew
them early. This script measures two early guesses on a trained model's text, each the top-k of the layer's own
router applied to an input that exists before the layer's MoE input does:
  prev_moe   layer l-1's MoE input (available a whole layer early);
  mixer_in   layer l's mixer input (attention or GDN; available before the layer's mixer runs);
Each layer has an expert cache under the engine's LRU rules (`--slots`, cold at each window's start). Reported per
layer and on average, over tokens 1.. of each window: the cache's miss rate; for each guess, the share of
the misses it names (what a prefetch of it would have fetched early), and the experts it names that are
neither cached nor used by the token (a prefetch of them is wasted PCIe traffic), both per miss.

    python benchmarks/route_ahead.py                          # the bundled model on its held-out text
    python benchmarks/route_ahead.py --text FILE [--model DIR] # any text

The held-out text needs the data of scripts/train_tiny.py (benchmarks/routing.py --bundled says which); without
it, pass --text. The model runs eagerly in float32, with its MoE and mixer inputs recorded as they pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jaxflash.ffi.reference import LruModel  # noqa: E402
from results_file import write_json  # noqa: E402


def record_inputs(params, cfg, tokens):
    """(moe_in, mixer_in, ids): per layer, the MoE block's input [W*T, H], the mixer's input [W*T, H] and the
    routed ids [W*T, k] of a forward over token windows [W, T]."""
    import jax.numpy as jnp

    from jaxflash.model import ple, transformer

    moe_in, mixer_in = [], []
    real_moe, real_attn, real_gdn = transformer.moe_parts, transformer.attention, transformer.gdn.gated_deltanet_batch

    def moe_parts(p, cfg_, x, *a, **k):
        moe_in.append(np.asarray(x))
        return real_moe(p, cfg_, x, *a, **k)

    def attention(p, cfg_, x, *a, **k):
        mixer_in.append(np.asarray(x).reshape(-1, x.shape[-1]))
        return real_attn(p, cfg_, x, *a, **k)

    def gdn_batch(p, cfg_, x, *a, **k):
        mixer_in.append(np.asarray(x).reshape(-1, x.shape[-1]))
        return real_gdn(p, cfg_, x, *a, **k)

    transformer.moe_parts, transformer.attention, transformer.gdn.gated_deltanet_batch = moe_parts, attention, gdn_batch
    try:
        ngram = ple.ngram_ids(cfg, tokens)[0]
        _, routing = transformer.forward_hidden(params, cfg, jnp.asarray(tokens), ngram_ids=jnp.asarray(ngram),
                                                return_routing=True)
    finally:
        transformer.moe_parts, transformer.attention = real_moe, real_attn
        transformer.gdn.gated_deltanet_batch = real_gdn
    return moe_in, mixer_in, [np.asarray(r.ids) for r in routing]


def router_top_k(p, cfg, x):
    """The top-k of layer p's router on inputs x [N, H], as the model routes (jaxflash.model.moe.route)."""
    import jax.numpy as jnp

    from jaxflash.model import moe
    _, idx = moe.route(p, cfg, jnp.asarray(x))
    return np.asarray(idx)


def cache_walk(actual: np.ndarray, guesses: dict, T: int, slots: int, num_experts: int) -> dict:
    """One layer's expert cache of `slots` slots under the engine's rules (jaxflash.ffi.reference.LruModel), cold
    at each window's start, over tokens [W*T, k]: its misses, and for each guess the share of those misses it
    names and the experts it names that are neither cached nor used (a prefetch of them would be wasted), both
    per miss."""
    out = {"misses": 0, "uses": 0}
    named = dict.fromkeys(guesses, 0)
    wasted = dict.fromkeys(guesses, 0)
    for i, row in enumerate(actual.tolist()):
        if i % T == 0:
            cache = LruModel(slots, num_experts)
        cached = set(cache.where)
        miss = {e for e, _ in cache.resolve(row)[1]}
        if i % T:  # token 0 of a window (an empty cache) is not scored
            out["misses"] += len(miss)
            out["uses"] += len(row)
            for name, g in guesses.items():
                guess = set(g[i].tolist())
                named[name] += len(guess & miss)
                wasted[name] += len(guess - set(row) - cached)
    m = max(out["misses"], 1)
    out.update({f"{n}_covers": named[n] / m for n in guesses}, **{f"{n}_wasted": wasted[n] / m for n in guesses})
    out["miss_rate"] = out["misses"] / max(out["uses"], 1)
    return out


def measure(params, cfg, windows: np.ndarray, slots: int) -> dict:
    W, T = windows.shape
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    moe_in, mixer_in, ids = record_inputs(params, cfg, windows)
    rows = []
    for layer in range(cfg.num_hidden_layers):
        p = params.layers[layer].moe
        guesses = {"mixer_in": router_top_k(p, cfg, mixer_in[layer])}
        if layer > 0:
            guesses["prev_moe"] = router_top_k(p, cfg, moe_in[layer - 1])
        rows.append({"layer": layer, **cache_walk(ids[layer], guesses, T, slots, E)})
    cols = ["miss_rate", "mixer_in_covers", "mixer_in_wasted", "prev_moe_covers", "prev_moe_wasted"]
    mean = {c: float(np.mean([r[c] for r in rows if c in r])) for c in cols}
    return {"layers": rows, "mean": mean, "random_covers": k / E, "windows": W, "tokens": T, "experts": E,
            "top_k": k, "slots": slots}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--text", default=None, help="a text file to run instead of the held-out text")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=0,
                    help="cache slots per layer (default: the share of a full-size layer at 32 GiB, 178 of 512)")
    ap.add_argument("--out", default=None, help="folder for route_ahead.json")
    a = ap.parse_args(argv)

    import jaxflash
    model_dir = a.model or jaxflash.DEFAULT_MODEL
    if a.text:
        from tokenizers import Tokenizer
        with open(a.text, encoding="utf-8") as f:
            stream = np.array(Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(f.read()).ids,
                              np.int32)
        source = os.path.basename(a.text)
    else:
        from routing import heldout_tokens
        stream, source = heldout_tokens(model_dir), "the held-out text"
    if len(stream) < a.tokens:
        ap.error(f"{source} has {len(stream)} tokens, fewer than --tokens {a.tokens}")
    engine = jaxflash.load(model_dir, dtype="float32", progress=False)
    cfg = engine.config
    starts = np.linspace(0, len(stream) - a.tokens, a.windows).astype(int)
    slots = a.slots or max(cfg.num_experts_per_tok, round(cfg.num_experts * 178 / 512))
    r = measure(engine.params, cfg, np.stack([stream[s:s + a.tokens] for s in starts]), slots)
    r["source"] = source
    print(f"{cfg.num_hidden_layers} layers, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, LRU cache of "
          f"{slots} slots per layer, cold per window; {a.windows} windows of {a.tokens} tokens of {source}.\n"
          "Per miss: the share of misses a guess names (covers), and the uncached experts it names that the token "
          "does not use (wasted)")
    names = list(r["mean"])
    print("layer " + " ".join(f"{n:>16}" for n in names))
    for row in r["layers"]:
        print(f"{row['layer']:>5} " + " ".join(f"{row[n]:16.3f}" if n in row else f"{'-':>16}" for n in names))
    print("mean  " + " ".join(f"{r['mean'][n]:16.3f}" for n in names))
    print(f"a random guess of {cfg.num_experts_per_tok} experts covers {r['random_covers']:.3f} of the misses")
    write_json(a.out, "route_ahead.json", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
