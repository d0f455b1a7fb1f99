#!/usr/bin/env python3
"""Train the small qwen4_exp model bundled as jaxflash's default, with jaxflash's own functional model and
gradients, on English text from the Debian archive.

    apt-get install bible-kjv python3.11-doc        # the data (any python3.X-doc works)
    python scripts/train_tiny.py                    # ~40 minutes on 2 cores; writes jaxflash/assets/default_model

Data: the King James Bible (`bible "Gen1:1-Rev22:21"`, one document per chapter, verse numbers removed) and
the reStructuredText sources of the Python documentation (one document per file). Documents are joined with
<|endoftext|> (EOS), so PLE sees EOS segments. Held out: every 20th document in name order (`heldout.txt` in
the work directory); the tokenizer (byte-level BPE, `tokenizers`) is trained on the rest.

Model: every block of qwen4_exp at small width (docs/model.md): 6 GDN + 2 attention layers with QSA (a 64-token
budget, so the 256-token training windows select blocks), 16 experts top-4 plus a shared expert, PLE at
layer 1, the 4-stream gated residual and one MTP layer. Loss: next-token cross-entropy + 0.3 x the MTP head's
cross-entropy (token t+2) + 0.01 x a load-balancing term (Switch Transformer's) per MoE layer.

Export: the real NVFP4 MIXED_PRECISION layout (experts NVFP4, n-gram table FP8, MTP experts FP8 blocks), with
the tokenizer and a Qwen chat template. The script then measures held-out perplexity (bf16 and NVFP4 experts),
MTP draft acceptance and the expert-cache hit rate, prints samples, and writes it all to training_report.json
beside the model.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash import presets  # noqa: E402
from jaxflash.checkpoint import expected_tensors  # noqa: E402
from jaxflash.config import ModelConfig  # noqa: E402
from jaxflash.model import hyper_connection as hc  # noqa: E402
from jaxflash.model import ple as ple_mod  # noqa: E402
from jaxflash.model import transformer  # noqa: E402
from jaxflash.model.mtp import mtp_forward  # noqa: E402
from jaxflash.model.weights import DictSource, load_params  # noqa: E402
from jaxflash.synthetic import TOKEN_IDS, _init, _rng, build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = TOKEN_IDS["<|endoftext|>"]
MTP_WEIGHT, BALANCE_WEIGHT = 0.3, 0.01


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def kjv_documents() -> dict[str, str]:
    """One document per chapter: its title line, then one verse per line without the verse number."""
    try:
        text = subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"the King James Bible is not installed ({e}); run: apt-get install bible-kjv") from None
    docs, title, verses = {}, None, []
    for line in text.splitlines():
        if re.fullmatch(r"[1-3]?\s?[A-Z][A-Za-z ]+ \d+", line.strip()) and not line.startswith(" "):
            if title:
                docs[f"kjv/{len(docs):04d} {title}"] = title + "\n\n" + "\n".join(verses) + "\n"
            title, verses = line.strip(), []
        elif m := re.match(r"\s+\d+ (.*)", line):
            verses.append(m.group(1))
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
    if title:
        docs[f"kjv/{len(docs):04d} {title}"] = title + "\n\n" + "\n".join(verses) + "\n"
    return docs


def python_doc_documents() -> dict[str, str]:
    roots = sorted(glob.glob("/usr/share/doc/python3*/html/_sources"))
    if not roots:
        raise SystemExit("the Python documentation is not installed; run: apt-get install python3.11-doc")
    files = sorted(glob.glob(os.path.join(roots[-1], "**", "*.rst.txt"), recursive=True))
    return {"pydoc/" + os.path.relpath(f, roots[-1]): open(f, encoding="utf-8").read() for f in files}


def split_documents(docs: dict[str, str]) -> tuple[list[str], list[str]]:
    """(train, held out): every 20th document in name order is held out."""
    names = sorted(docs)
    held = [docs[n] for i, n in enumerate(names) if i % 20 == 19]
    train = [docs[n] for i, n in enumerate(names) if i % 20 != 19]
    return train, held


def token_stream(tok, docs: list[str]) -> np.ndarray:
    """The documents' tokens, each followed by EOS."""
    out = []
    for d in docs:
        out.extend(tok.encode(d).ids)
        out.append(EOS)
    return np.asarray(out, np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
def model_config(vocab_size: int) -> ModelConfig:
    c = presets.tiny(vocab_size=vocab_size, eos_token_id=EOS)
    return c.replace(
        hidden_size=128, num_hidden_layers=8, layer_types=presets._layer_types(8), eos_token_ids=(EOS, TOKEN_IDS["<|im_end|>"]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        hc_lowrank=32, ple_embed_dim=128, ngram_vocab_size_base=4096,
        indexer_n_heads=4, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
        max_position_embeddings=4096, mtp_num_hidden_layers=1)


def init_params(cfg: ModelConfig, seed: int):
    """Random float32 parameters by the synthetic writer's initialisation rules (the table on the device)."""
    specs = expected_tensors(cfg, None, mtp=True)
    tensors = {n: _init(n, s, cfg, _rng(seed, n)) for n, (s, _) in specs.items()
               if ".ple_embedding." not in n}  # the n-gram table below; the hash buffers are not parameters
    table = np.concatenate([_init(n, s, cfg, _rng(seed, n)) for n, (s, _) in specs.items()
                            if ".ngram_embedding.shard_" in n])
    # start near-uniform over the vocabulary (the writer's lm_head gives logits of std ~3: a loss of ~12)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0.1
    return load_params(DictSource(tensors), cfg, "float32", ple_table=(table, None))


def losses(params, cfg: ModelConfig, toks, ids):
    """(total, (next-token CE, MTP CE, balance)) for windows toks [B, T+2] with n-gram ids [B, T+2, 16]."""
    t = toks.shape[1] - 2
    h, routing = transformer.forward_hidden(params, cfg, toks[:, :t], ngram_ids=ids[:, :t], return_routing=True)
    x, _ = hc.mix(params.mixer, h, cfg.hc_count, cfg.rms_norm_eps)

    def ce(logits, target):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))

    main = ce(transformer.lm_logits(params, x), toks[:, 1 : t + 1])
    mtp_logits, _, mtp_routing = mtp_forward(params, cfg, h, toks[:, 1 : t + 1], return_routing=True)
    mtp = ce(mtp_logits, toks[:, 2 : t + 2])
    e = cfg.num_experts
    balance = jnp.mean(jnp.stack([
        e * jnp.sum(jnp.mean(jax.nn.one_hot(r.ids, e).sum(1), 0) / cfg.num_experts_per_tok * jnp.mean(r.probs, 0))
        for r in (*routing, mtp_routing)]))
    return main + MTP_WEIGHT * mtp + BALANCE_WEIGHT * balance, (main, mtp, balance)


def windows(stream: np.ndarray, starts, length: int) -> np.ndarray:
    return np.stack([stream[s : s + length] for s in starts])


# ---------------------------------------------------------------------------------------------------------------
# Evaluation of the exported model
# ---------------------------------------------------------------------------------------------------------------
def mtp_acceptance(engine, seqs) -> float:
    """Greedy draft acceptance: the MTP head's top token for t+2 equals the main model's top token there."""
    hits = total = 0
    for s in seqs:
        main = engine.logits(s).argmax(-1)  # row t predicts token t+1
        draft = engine.mtp_logits(s).argmax(-1)  # row t predicts token t+2
        hits += int((draft[:-1] == main[1:-1]).sum())
        total += len(draft) - 1
    return hits / total


def cache_hit_rates(engine, seqs, slot_counts) -> dict[int, float]:
    """LRU expert-cache hit rate per slot count, replaying the held-out text token by token through each
    layer's cache (jaxflash.ffi.reference.LruModel: the FFI cache's rules)."""
    from jaxflash.ffi.reference import LruModel

    cfg = engine.config

    @jax.jit
    def route_ids(params, toks, rows):
        _, routing = transformer.forward_hidden(params, cfg, toks, ple_rows=rows, return_routing=True)
        return [r.ids for r in routing]

    traces = [[] for _ in range(cfg.num_hidden_layers)]
    for s in seqs:
        batch, _, _ = engine._batch(s)
        ids = route_ids(engine.params, jnp.asarray(batch), engine.ple_rows(batch))
        for layer, idx in enumerate(ids):
            traces[layer].append(np.asarray(idx)[: len(s)])
    rates = {}
    for slots in slot_counts:
        hits = misses = 0
        for trace in traces:
            lru = LruModel(slots, cfg.num_experts)
            for step in np.concatenate(trace):
                lru.resolve(step)
            hits, misses = hits + lru.hits, misses + lru.misses
        rates[slots] = hits / (hits + misses)
    return rates


def sample(engine, tok, prompt: str, n: int, temperature: float, top_k: int, seed: int) -> str:
    """Temperature / top-k sampling by re-running the full sequence per token (fine for a model this small)."""
    rng = np.random.default_rng(seed)
    ids = tok.encode(prompt).ids
    for _ in range(n):
        logits = engine.logits(ids)[-1] / temperature
        top = np.argsort(logits)[-top_k:]
        p = np.exp(logits[top] - logits[top].max())
        nxt = int(rng.choice(top, p=p / p.sum()))
        if nxt == EOS:
            break
        ids.append(nxt)
    return tok.decode(ids)


# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "jaxflash", "assets", "default_model"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "train_tiny"), help="held-out text, bf16 export")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (the LR schedule spans them)")
    ap.add_argument("--minutes", type=float, default=120.0, help="stop early after this long")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args(argv)

    import optax

    from jaxflash.engine import load
    from jaxflash.export import save_checkpoint
    from jaxflash.perplexity import perplexity

    t_start = time.perf_counter()
    docs = kjv_documents() | python_doc_documents()
    train_docs, held_docs = split_documents(docs)
    os.makedirs(args.work, exist_ok=True)
    held_path = os.path.join(args.work, "heldout.txt")
    with open(held_path, "w", encoding="utf-8") as f:
        f.write("\n".join(held_docs))
    tok = build_tokenizer(args.vocab, train_docs)
    train = token_stream(tok, train_docs)
    held = token_stream(tok, held_docs)
    print(f"data: {len(train_docs)} training documents ({len(train):,} tokens), {len(held_docs)} held out "
          f"({len(held):,} tokens); vocab {tok.get_vocab_size()}", flush=True)

    cfg = model_config(args.vocab)
    params = init_params(cfg, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))
    print(f"model: {n_params / 1e6:.2f} M parameters (n-gram table included)", flush=True)

    warmup = 100
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1),
                                                  end_value=args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.95, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, toks, ids):
        (loss, parts), grads = jax.value_and_grad(lambda p: losses(p, cfg, toks, ids), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, parts

    eval_loss = jax.jit(lambda p, toks, ids: losses(p, cfg, toks, ids)[1])
    rng = np.random.default_rng(args.seed)
    span = args.seq + 2
    eval_toks = windows(held, rng.integers(0, len(held) - span, 16), span)
    eval_ids = ple_mod.ngram_ids(cfg, eval_toks)[0]

    deadline = time.perf_counter() + args.minutes * 60
    step, history = 0, []
    t0 = time.perf_counter()
    while step < args.steps and time.perf_counter() < deadline:
        toks = windows(train, rng.integers(0, len(train) - span, args.batch), span)
        ids = ple_mod.ngram_ids(cfg, toks)[0]
        params, opt_state, loss, (main, mtp, bal) = train_step(params, opt_state, toks, ids)
        step += 1
        if step % args.eval_every == 0 or step == 1:
            ev = [float(x) for x in eval_loss(params, eval_toks, eval_ids)]
            rate = step * args.batch * args.seq / (time.perf_counter() - t0)
            history.append({"step": step, "train_loss": float(main), "heldout_loss": ev[0], "heldout_mtp": ev[1],
                            "balance": ev[2], "minutes": (time.perf_counter() - t0) / 60})
            print(f"step {step:5d}  train {float(main):.3f}  held-out {ev[0]:.3f} (ppl {math.exp(ev[0]):.1f})  "
                  f"mtp {ev[1]:.3f}  balance {ev[2]:.3f}  {rate:.0f} tok/s", flush=True)
    tokens_seen = step * args.batch * args.seq
    print(f"trained {step} steps, {tokens_seen:,} tokens, in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)

    # ----- export and evaluate -----
    bf16_dir = os.path.join(args.work, "bf16")
    save_checkpoint(bf16_dir, cfg, params, quant="bf16", tokenizer=tok, seed=args.seed)
    save_checkpoint(args.out, cfg, params, quant="nvfp4", tokenizer=tok, seed=args.seed)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    report = {"command": "python scripts/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "steps": step, "tokens": tokens_seen, "batch": args.batch, "seq": args.seq,
              "parameters": int(n_params), "checkpoint_bytes": size, "history": history,
              "data": {"train_documents": len(train_docs), "heldout_documents": len(held_docs),
                       "train_tokens": int(len(train)), "heldout_tokens": int(len(held)),
                       "heldout_rule": "every 20th document in name order"}}
    ctx = 256
    for name, path in (("bf16", bf16_dir), ("nvfp4", args.out)):
        eng = load(path, dtype="bfloat16", progress=False)
        with open(os.devnull, "w") as quiet:
            r = perplexity(eng, held, ctx=ctx, chunks=200, batch=8, out=quiet)
        report[f"heldout_ppl_{name}"] = {"ppl": r.ppl, "stderr": r.stderr, "tokens_scored": r.tokens_scored,
                                         "ctx": ctx}
        print(f"held-out PPL ({name} checkpoint, bf16 compute, ctx {ctx}): {r.ppl:.3f} +/- {r.stderr:.3f} "
              f"over {r.tokens_scored} tokens", flush=True)
    eng = load(args.out, dtype="float32", progress=False)
    seqs = [held[s : s + 256] for s in range(0, min(len(held) - 256, 256 * 16), 256)]
    report["mtp_acceptance"] = mtp_acceptance(eng, seqs)
    report["cache_hit_rate"] = cache_hit_rates(eng, seqs, (4, 6, 8, 12))
    print(f"MTP greedy draft acceptance: {report['mtp_acceptance']:.3f}", flush=True)
    print(f"expert LRU cache hit rate by slots/layer ({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}): "
          f"{report['cache_hit_rate']}", flush=True)
    prompts = ["In the beginning", "And Jesus said unto them,", "The Python interpreter", "A list is"]
    report["samples"] = {p: sample(eng, tok, p, 48, 0.8, 40, args.seed) for p in prompts}
    for p, s in report["samples"].items():
        print(f"--- {p!r}\n{s}", flush=True)
    report["minutes_total"] = (time.perf_counter() - t_start) / 60
    with open(os.path.join(args.out, "training_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB of weights)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
