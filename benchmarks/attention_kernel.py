#!/usr/bin/env python3
"""The paged attention kernel of decode steps (jaxflash/kernels/attention_decode.py) against XLA's attention,
full-size shapes (24 query heads over 2 KV heads of 256, QSA's indexer), bf16.

Each case is B sequences of `ctx` tokens in a cache of `span` keys per sequence (a context bucket: the page
table's width), each adding T new tokens (1: decode; 4: a verify step with 3 drafts). Pages are scattered.
Two scopes, L attention layers chained in one jitted program (each layer with its own weights and cache,
the cache donated and fed back as the engine does):
  * core: the attention alone, from the roped queries and QSA's block choice to the output (the kernel at
    several tilings, against XLA's gather of the pages and `attend` under the same mask);
  * layer: the whole attention layer (projections, cache writes, QSA's indexer and choice), kernel on and off,
    and the kernel path with QSA's scores in XLA (attention.QSA_SCORES_KERNEL off);
  * qsa: QSA's block choice from the index queries and the cached raw keys: XLA's (block keys pooled from the
    pages, scored, ranked) against attention_prep.block_scores (at --blocks per program) and XLA's ranking.
    Its numerics: the chosen blocks of each (bf16) path that differ from XLA's in bf16 and from XLA's in
    float32 (the same inputs upcast), as a fraction of the blocks chosen.
Per layer: the summed GPU kernel time from a profiler trace, the kernels per layer, the bytes the scope must read
(the KV rows of the sequence's tokens; plus the weights and the indexer keys for the layer) and the fraction of
4.2 TB/s. It first checks the kernel's numerics against XLA's on the device.

    python3 benchmarks/attention_kernel.py --out $OUT                 # on the H200
    python3 benchmarks/attention_kernel.py --preset tiny --layers 2 --cases 1:1:40:64 --tiles 16:32:4:1   # CPU
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_timing import COPY_CEILING, log, Stepper, rel_err, trace_kernels_by_name, wall_us  # noqa: E402
from results_file import write_json  # noqa: E402


CASES = "1:1:112:4096,1:1:4000:4096,1:1:32000:32768,8:1:4000:4096,1:4:4000:4096"
TILES = "64:0:4:2,32:0:4:2,64:64:4:2,64:128:4:2,64:256:4:2,32:0:4:1"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "tiny"])
    ap.add_argument("--layers", type=int, default=12, help="attention layers in one program (the model has 12)")
    ap.add_argument("--cases", default=CASES, help="comma-separated B:T:ctx:span")
    ap.add_argument("--tiles", default=TILES,
                    help="comma-separated kernel tilings block:split:warps:stages for the core scope (split 0: "
                         "the kernel's choice; the layer scope uses the Tiles default)")
    ap.add_argument("--scopes", default="core,layer", help="comma-separated: core, layer, qsa")
    ap.add_argument("--blocks", default="8", help="comma-separated QSA blocks per program of the qsa scope's kernel")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxflash import presets
    from jaxflash.kernels import attention_decode as ad
    from jaxflash.kernels import attention_prep as ap
    from jaxflash.kernels import on_gpu
    from jaxflash.model import attention as attn
    from jaxflash.model import qsa
    from jaxflash.model.base import TokenBatch

    cfg = presets.preset(args.preset)
    dt = jnp.bfloat16
    L = args.layers
    dev = jax.devices()[0]
    nh, nkv, hd, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    ni, di, r = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    page = 16
    log(f"device {dev.device_kind}, jax {jax.__version__}; {args.preset}: {L} attention layers, {nh} heads over "
        f"{nkv} KV heads of {hd}, QSA {ni} x {di} keeping {cfg.block_topk} blocks of {r}; bf16, pages of {page}")
    gpu = on_gpu()

    def rnd(key, shape, scale):
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dt)

    def one_layer(key):
        ks = jax.random.split(key, 9)
        indexer = qsa.Indexer(index_qk_proj=rnd(ks[0], ((ni + 1) * di, h), 0.02), q_norm=1 + rnd(ks[1], (di,), 0.1),
                              k_norm=1 + rnd(ks[2], (di,), 0.1))
        return attn.Attention(qkv_proj=rnd(ks[3], (nh * 2 * hd + 2 * nkv * hd, h), 0.02),
                              o_proj=rnd(ks[6], (h, nh * hd), 0.02),
                              q_norm=1 + rnd(ks[7], (hd,), 0.1), k_norm=1 + rnd(ks[8], (hd,), 0.1), indexer=indexer)

    layers = [one_layer(k) for k in jax.random.split(jax.random.PRNGKey(0), L)]
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(layers[0]))
    res = {"device": str(dev.device_kind), "jax": jax.__version__, "python": platform.python_version(),
           "preset": args.preset, "layers": L, "reps": args.reps, "page": page, "runs": [], "numerics": []}
    tilings = [ad.Tiles(*(int(n) for n in v.split(":"))) for v in args.tiles.split(",")]

    for case in args.cases.split(","):
        b, t, ctx, span = (int(n) for n in case.split(":"))
        n_pages = b * span // page
        key = jax.random.PRNGKey(ctx + b)
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        table = jnp.asarray(np.random.default_rng(ctx).permutation(n_pages).reshape(b, span // page), jnp.int32)

        def cache(key):
            ka, kb, kc = jax.random.split(key, 3)
            return attn.PagedKV(k=rnd(ka, (n_pages, page, nkv, hd), 1.0), v=rnd(kb, (n_pages, page, nkv, hd), 1.0),
                                index_keys=rnd(kc, (n_pages, page, di), 1.0))

        caches0 = [cache(k) for k in jax.random.split(k1, L)]
        fresh = lambda: jax.tree.map(jnp.copy, caches0)  # noqa: E731  (each program donates the caches)
        lengths = jnp.full((b,), ctx - t, jnp.int32)
        batch = TokenBatch.after(lengths, jnp.full((b,), t, jnp.int32), t, table)
        x = rnd(k2, (b, t, h), 1.0)
        kv_bytes = b * ctx * nkv * hd * 2 * 2  # K and V rows of the sequences' tokens
        index_bytes = b * span * di * 2  # the layer's QSA reads the raw indexer keys of the whole bucket
        log(f"case B={b} T={t} context {ctx} (bucket {span}): KV {kv_bytes / 1e6:.2f} MB per layer, weights "
            f"{weight_bytes / 1e6:.1f} MB")

        # core inputs: roped queries and QSA's choice as the layer computes them (one set, shared by the layers)
        q = rnd(k3, (b, t, nh, hd), 1.0)
        n_blocks = span // r
        qi = rnd(k4, (b, t, ni, di), 1.0)
        kbk = rnd(k5, (b, n_blocks, di), 1.0)
        chosen = jax.vmap(lambda qq, kk, pp: qsa.block_choice(cfg, qq, kk, pp))(qi, kbk, batch.positions)

        def core_xla(kv):
            keys = jnp.arange(span)

            def one(q_b, pos_b, row, ch_b):
                mask = (pos_b[:, None] >= keys[None, :]) & qsa.choice_mask(r, ch_b, pos_b, span)
                return attn.attend(q_b, attn.read_pages(kv.k, row), attn.read_pages(kv.v, row), mask)
            return jax.vmap(one)(q, batch.positions, table, chosen)

        def core_program(tiles):
            def run(kvs):
                outs = [core_xla(kv) if tiles is None else
                        ad.paged_attention(q, kv.k, kv.v, table, batch.positions, chosen, r=r, tiles=tiles)
                        for kv in kvs]
                return outs, kvs
            return Stepper(jax.jit(run, donate_argnums=0), fresh())

        def layer_program(kernel, qsa_kernel=True):
            def run(kvs, ps, x):
                new = []
                keep, attn.QSA_SCORES_KERNEL = attn.QSA_SCORES_KERNEL, qsa_kernel  # read while tracing
                try:
                    for i in range(L):
                        y, kv = attn.attention(ps[i], cfg, x, batch, kvs[i], kernel)
                        x = x + y
                        new.append(kv)
                finally:
                    attn.QSA_SCORES_KERNEL = keep
                return x, new
            return Stepper(jax.jit(run, donate_argnums=0), fresh(), layers, x)

        def qsa_choice(p, kv, iq, kernel, blocks=ap.BLOCKS):
            if kernel:
                scores = ap.block_scores(cfg, iq, kv.index_keys, table, p.indexer.k_norm, blocks=blocks)
                return jax.vmap(lambda s_b, pos_b: qsa.choose_blocks(cfg, s_b, pos_b))(scores, batch.positions)
            return jax.vmap(lambda q_b, pos_b, row: qsa.block_choice(cfg, q_b, attn._block_keys(p, cfg, kv, row),
                                                                     pos_b))(iq, batch.positions, table)

        def qsa_program(kernel, blocks=ap.BLOCKS):
            def run(kvs):
                return [qsa_choice(layers[i], kvs[i], qi, kernel, blocks) for i in range(L)], kvs
            return Stepper(jax.jit(run, donate_argnums=0), fresh())

        def up32(tree):  # the same inputs in float32: the numerics' reference
            return jax.tree.map(lambda a: a.astype(jnp.float32), tree)

        programs = []
        if "qsa" in args.scopes.split(","):
            qsa_bytes = index_bytes + b * t * ni * di * 2
            programs += [("qsa", "xla", lambda: qsa_program(False), qsa_bytes)]
            programs += [("qsa", f"kernel-{bl}", lambda bl=int(bl): qsa_program(True, bl), qsa_bytes)
                         for bl in args.blocks.split(",")]
            # numerics: chosen blocks of each path against XLA's in bf16 and in float32 (inputs upcast)
            ref32 = np.asarray(qsa_choice(up32(layers[0]), up32(caches0[0]), up32(qi), False))
            ref16 = np.asarray(qsa_choice(layers[0], caches0[0], qi, False))
            got = np.asarray(qsa_choice(layers[0], caches0[0], qi, True))
            kept = max(1, int(ref32.sum()))
            flips = {"kernel_vs_xla": int((got != ref16).sum()), "kernel_vs_f32": int((got != ref32).sum()),
                     "xla_vs_f32": int((ref16 != ref32).sum()), "chosen_f32": kept}
            res["numerics"].append({"case": case, "scope": "qsa", "variant": "kernel", "choice_flips": flips})
            log(f"  qsa choice: {kept} blocks chosen (float32); differing: kernel vs XLA {flips['kernel_vs_xla']}, "
                f"kernel vs float32 {flips['kernel_vs_f32']}, XLA (bf16) vs float32 {flips['xla_vs_f32']}")
        if "core" in args.scopes.split(","):
            programs += [("core", "xla", lambda: core_program(None), kv_bytes)]
            programs += [("core", "kernel-" + ":".join(str(v) for v in vars(tl).values()),
                          lambda tl=tl: core_program(tl), kv_bytes) for tl in tilings]
        if "layer" in args.scopes.split(","):
            layer_bytes = kv_bytes + weight_bytes + index_bytes
            programs += [("layer", "xla", lambda: layer_program(False), layer_bytes),
                         ("layer", "kernel", lambda: layer_program(True), layer_bytes),
                         ("layer", "kernel-xla-qsa", lambda: layer_program(True, False), layer_bytes)]
        # numerics of one layer on the same input (chained layers would compound both paths' roundings)
        one = jax.jit(lambda p, xx, bt, kv, kernel: attn.attention(p, cfg, xx, bt, kv, kernel)[0], static_argnums=4)
        y_kernel, y_xla = one(layers[0], x, batch, caches0[0], True), one(layers[0], x, batch, caches0[0], False)
        res["numerics"].append({"case": case, "scope": "layer", "variant": "kernel",
                                "rel_err": rel_err(y_kernel, y_xla)})
        # and both against XLA's path in float32 on the same (upcast) input: which rounds further from it
        y32 = one(up32(layers[0]), up32(x), batch, up32(caches0[0]), False)
        res["numerics"] += [{"case": case, "scope": "layer", "variant": "kernel vs float32",
                             "rel_err": rel_err(y_kernel, y32)},
                            {"case": case, "scope": "layer", "variant": "xla vs float32",
                             "rel_err": rel_err(y_xla, y32)}]
        xla_core = None
        for scope, name, make, nbytes in programs:
            try:
                fn = make()
                out = fn()[0]
            except Exception as e:  # a tiling Triton cannot compile (shared memory): say so, go on
                log(f"  {scope:5s} {name:22s}: failed: {str(e).splitlines()[0][:200]}")
                res["runs"].append({"case": case, "scope": scope, "variant": name, "error": str(e)[:500]})
                continue
            if scope == "core" and name == "xla":
                xla_core = out
            elif scope == "core" and xla_core is not None:
                res["numerics"].append({"case": case, "scope": scope, "variant": name,
                                        "rel_err": rel_err(out, xla_core)})
            del out
            wall = wall_us(fn, (), args.reps) / L
            run = {"case": case, "batch": b, "rows": t, "context": ctx, "span": span, "scope": scope,
                   "variant": name, "wall_us_per_layer": wall, "bytes_per_layer": nbytes,
                   "floor_us": nbytes / COPY_CEILING * 1e6}
            line = f"  {scope:5s} {name:22s}: wall {wall:8.2f} us/layer"
            if gpu:
                kus, n, top = trace_kernels_by_name(fn, (), max(2, args.reps // 4),
                                                    top=40 if scope != "core" else 14)
                run.update(kernel_us_per_layer=kus / L, kernels_per_layer=n / L,
                           fraction_of_hbm=nbytes / (kus / L * 1e-6) / COPY_CEILING)
                line += (f", GPU {kus / L:8.2f} us/layer in {n / L:5.1f} kernels; {nbytes / 1e6:7.2f} MB -> floor "
                         f"{run['floor_us']:6.2f} us, {run['fraction_of_hbm']:.1%} of 4.2 TB/s")
                if scope != "core":
                    run["top_kernels_us_per_layer"] = [(k, us / L) for k, us in top]
                    line += "\n      " + ", ".join(f"{k} {us / L:.2f}" for k, us in top)
            log(line)
            res["runs"].append(run)
            del fn
        xla_core = None
        log("  numerics vs XLA (max |diff| / max |XLA|): "
            + ", ".join(f"{n['scope']} {n['variant']} {n['rel_err']:.1e}" for n in res["numerics"]
                        if n["case"] == case and "rel_err" in n))
        del caches0
    write_json(args.out, "attention_kernel.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
