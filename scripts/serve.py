#!/usr/bin/env python3
"""Serve a model over HTTP, OpenAI- and Anthropic-compatible.

    python scripts/serve.py                                   # the bundled model on 127.0.0.1:8000
    python scripts/serve.py --model DIR --vram-budget 32GiB --port 8080 --api-key SECRET

Endpoints: /v1/models[/{id}] /v1/chat/completions /v1/completions /v1/messages /v1/messages/count_tokens
/health /metrics /tokenize /detokenize /tokenizer_info. The server listens at once, loads the model in the
background and compiles every program it serves with (or reads them from the compilation cache); /health
answers 503 ("loading", then "warming up") until then. If the model cannot be loaded, the server says why and
exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxflash import cli  # noqa: E402 -- light: no JAX import


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=cli.port, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("JAXFLASH_API_KEY"),
                    help="require this key (Authorization: Bearer or x-api-key); default $JAXFLASH_API_KEY. "
                         "Without one, any key a client sends is accepted")
    ap.add_argument("--served-model-name", default=None, help="model id in the API (default: the directory name)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    ap.add_argument("--expert-residency", choices=["auto", "device", "host"], default="auto")
    ap.add_argument("--vram-budget", type=cli.memory_size, default=None, help="cap on device memory, e.g. 32GiB")
    ap.add_argument("--cache-slots", type=cli.positive_int, default=None,
                    help="expert cache slots per layer (host residency)")
    ap.add_argument("--max-batch", type=cli.positive_int, default=8, help="sequences decoded together (concurrency)")
    ap.add_argument("--max-seq-len", type=cli.positive_int, default=None, help="context length (default: what fits)")
    ap.add_argument("--prefill-chunk", type=cli.positive_int, default=None,
                    help="prompt tokens per prefill step (default: the planner's choice, logged)")
    ap.add_argument("--max-waiting", type=cli.positive_int, default=256, help="queued requests before answering 503")
    ap.add_argument("--max-body-mb", type=cli.positive_float, default=8.0, help="request body size limit")
    ap.add_argument("--header-timeout", type=cli.positive_float, default=10.0,
                    help="seconds a request's headers may take to arrive (slow clients are disconnected)")
    ap.add_argument("--body-timeout", type=cli.positive_float, default=30.0,
                    help="seconds a request's body may take to arrive")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    cli.add_speculative(ap)
    cli.add_compile_cache(ap)
    args = ap.parse_args(argv)

    import jaxflash
    from jaxflash.checkpoint import Checkpoint

    model_dir = args.model or str(jaxflash.DEFAULT_MODEL)
    with cli.errors_exit():
        Checkpoint.open(model_dir, validate=False)  # a path that is no checkpoint fails now, not in the background
    cli.setup(args.log_level, args.compile_cache)
    name = args.served_model_name or os.path.basename(os.path.normpath(model_dir))

    import uvicorn

    from jaxflash.server import create_app, uvicorn_config
    from jaxflash.tokenizer import Tokenizer

    def load():
        import jax

        dtype = args.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
        tok = Tokenizer(model_dir)
        engine = jaxflash.load(model_dir, dtype=dtype, expert_residency=args.expert_residency,
                               vram_budget=args.vram_budget, cache_slots=args.cache_slots, max_batch=args.max_batch,
                               max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk,
                               mtp=args.spec == "mtp", progress=True,
                               **cli.speculative(args))
        plan = engine.plan
        print(f"\njaxflash serving {name!r} ({dtype}) on http://{args.host}:{args.port}\n"
              f"  experts: {plan.residency}" + (f", {plan.cache_slots} cache slots/layer" if plan.residency == "host"
                                               else "") +
              f"\n  concurrency: {plan.max_batch} sequences, context {plan.max_seq_len} tokens, "
              + (f"{engine.draft_tokens} {engine.speculative} drafts per step, " if engine.draft_tokens else "") +
              f"KV cache {plan.kv_tokens} tokens, prefill chunks of {plan.prefill_chunk} tokens\n"
              "  compiling the programs (the compilation cache makes the next start faster) ...", flush=True)
        return engine, tok

    failed: list[str] = []

    def stop(message: str) -> None:  # the model cannot be served: say why and end, rather than answer 503 forever
        failed.append(message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        server.should_exit = True

    app = create_app(load, model_name=name, api_key=args.api_key, max_body_bytes=int(args.max_body_mb * 2**20),
                     max_waiting=args.max_waiting, body_timeout=args.body_timeout, on_load_error=stop)
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, header_timeout=args.header_timeout,
                                           log_level=args.log_level))
    try:
        server.run()
        status = 1 if failed or not server.started else 0
    except KeyboardInterrupt:  # Ctrl-C or SIGINT: uvicorn has shut down and re-raises it; no traceback
        status = 130
    if app.state.jaxflash.worker is None:  # still loading or compiling (or failed to): see cli.exit_now. Also
        cli.exit_now(status)  # where a SIGINT inherited as ignored stopped uvicorn: then no KeyboardInterrupt comes
    return status


if __name__ == "__main__":
    sys.exit(main())
