#!/usr/bin/env python3
"""Perplexity of a text file, llama.cpp llama-perplexity protocol (see jaxflash/perplexity.py).

    python scripts/perplexity.py -f text.txt                 # the bundled default model
    python scripts/perplexity.py --model DIR -f text.txt --ctx 512 --chunks 20
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
    ap.add_argument("-f", "--file", required=True, help="text file to score")
    ap.add_argument("--ctx", "-c", type=cli.positive_int, default=512, help="window length in tokens (default 512)")
    ap.add_argument("--chunks", type=int, default=-1, help="windows to score (default: all)")
    ap.add_argument("--batch", type=cli.positive_int, default=1, help="windows per device call (default 1)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    cli.add_compile_cache(ap)
    args = ap.parse_args(argv)
    with cli.errors_exit():
        return score(args)


def score(args) -> int:
    import jaxflash
    from jaxflash.checkpoint import Checkpoint
    from jaxflash.perplexity import perplexity
    from jaxflash.tokenizer import Tokenizer

    try:
        with open(args.file, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {args.file}: {e.strerror}") from None
    model_dir = args.model or jaxflash.DEFAULT_MODEL
    Checkpoint.open(model_dir, validate=False)  # a bad path fails here, before anything heavy
    cli.setup("warning", args.compile_cache)
    t0 = time.perf_counter()
    engine = jaxflash.load(model_dir, dtype=args.dtype)
    tok = Tokenizer(model_dir)
    tokens = tok.encode(text)
    print(f"loaded {model_dir} ({args.dtype}) in {time.perf_counter() - t0:.1f} s; {len(tokens)} tokens "
          f"from {args.file}")
    perplexity(engine, tokens, ctx=args.ctx, chunks=args.chunks, batch=args.batch,
               bos_token_id=tok.bos_token_id if tok.add_bos else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
