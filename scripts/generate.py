#!/usr/bin/env python3
"""Generate text with jaxflash, streaming it as it comes.

    python scripts/generate.py --prompt "In the beginning"                  # the bundled model, greedy
    python scripts/generate.py --chat --prompt "What is a list?" --temperature 0.7 --seed 1
    python scripts/generate.py --model DIR --prompt TEXT --vram-budget 32GiB --max-new-tokens 200
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


from jaxflash import cli  # noqa: E402 -- light: no JAX import


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--prompt", "-p", required=True, help="prompt text ('-' reads standard input)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ap.add_argument("--max-new-tokens", "-n", type=cli.positive_int, default=128)
    ap.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--expert-residency", choices=["auto", "device", "host"], default="auto")
    ap.add_argument("--vram-budget", type=cli.memory_size, default=None, help="cap on device memory, e.g. 32GiB")
    ap.add_argument("--cache-slots", type=cli.positive_int, default=None,
                    help="expert cache slots per layer (host residency)")
    ap.add_argument("--max-seq-len", type=cli.positive_int, default=None)
    ap.add_argument("--prefill-chunk", type=cli.positive_int, default=None,
                    help="prompt tokens per prefill step (default: the planner's choice)")
    ap.add_argument("--verbose", "-v", action="store_true", help="log the memory plan")
    cli.add_speculative(ap)
    cli.add_compile_cache(ap)
    args = ap.parse_args(argv)
    with cli.errors_exit():
        return generate(args)


def generate(args) -> int:
    import jaxflash
    from jaxflash.checkpoint import Checkpoint
    from jaxflash.engine import SamplingParams
    from jaxflash.tokenizer import Tokenizer

    model_dir = args.model or jaxflash.DEFAULT_MODEL
    Checkpoint.open(model_dir, validate=False)  # a bad path fails here, before anything heavy
    SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed or 0)  # checks the values
    cli.setup("info" if args.verbose else "warning", args.compile_cache)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt

    import jax

    dtype = args.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
    tok = Tokenizer(model_dir)
    t0 = time.perf_counter()
    engine = jaxflash.load(model_dir, dtype=dtype, expert_residency=args.expert_residency,
                           vram_budget=args.vram_budget, cache_slots=args.cache_slots, max_batch=1,
                           max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk, mtp=args.spec == "mtp",
                           **cli.speculative(args))
    print(f"[loaded {model_dir} in {time.perf_counter() - t0:.1f} s: {engine.plan.summary()}]", file=sys.stderr)
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
    ids = tok.encode(text)
    if tok.add_bos and tok.bos_token_id is not None:
        ids = [tok.bos_token_id] + ids
    if not ids:
        raise ValueError("the prompt is empty")
    print("[compiling (the compilation cache makes the next start faster) ...]", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine.warm_up(serving=False)
    print(f"[compiled in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)

    out: list[int] = []
    shown = ""
    t0 = time.perf_counter()
    first = None
    for _, t in engine.generate_stream([ids], args.max_new_tokens, temperature=args.temperature,
                                       top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                       ignore_eos=args.ignore_eos):
        if t is None:
            break
        first = first or time.perf_counter()
        out.append(t)
        now = tok.decode(out, skip_special_tokens=True)
        if not now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(now[len(shown):])
            sys.stdout.flush()
            shown = now
    end = time.perf_counter()
    sys.stdout.write(tok.decode(out, skip_special_tokens=True)[len(shown):] + "\n")
    st = engine.scheduler.stats
    rate = (len(out) - 1) / (end - first) if first and len(out) > 1 else 0.0
    hits = f", expert cache hit rate {st.hit_rate:.1%}" if st.hit_rate is not None else ""
    if st.draft_acceptance is not None:
        hits += (f", {st.drafts_accepted} of {st.drafts_fed} drafts kept ({st.draft_acceptance:.0%}), "
                 f"{st.generated_tokens / max(st.decode_steps, 1):.2f} tokens per step")
    print(f"[{len(ids)} prompt tokens, {len(out)} generated; first token after {(first or end) - t0:.2f} s, "
          f"then {rate:.1f} tok/s{hits}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
