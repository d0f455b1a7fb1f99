"""What the command-line tools (scripts/) share: argument checks that fail before anything loads, quiet
logging, the compilation cache, and one-line errors.

A tool's main() wraps its work in `errors_exit()`: an expected failure (a bad path, a model that cannot be
planned or loaded, a bad value) prints `error: <message>` and exits with status 2, and Ctrl-C ends the tool at
once with status 130, both without a traceback (JAXFLASH_DEBUG=1 shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

# Failures a user can cause and fix; anything else is a bug and keeps its traceback.
USER_ERRORS = (OSError, ValueError, RuntimeError)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def port(text: str) -> int:
    v = positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def memory_size(text: str) -> str:
    from .engine.planner import parse_bytes

    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_speculative(ap: argparse.ArgumentParser) -> None:
    """--spec and --draft-tokens (jaxflash.load's speculative and draft_tokens)."""
    ap.add_argument("--spec", choices=["none", "ngram", "mtp"], default="none",
                    help="speculative decoding: drafts verified in one step (the output is what plain decoding "
                         "gives), from the text so far (ngram) or from the model's MTP head (mtp); default none")
    ap.add_argument("--draft-tokens", type=int, choices=[1, 2, 3], default=1,
                    help="most drafts per sequence and verify step, with --spec ngram or mtp (default 1: the "
                         "verify step computes them all whatever is fed, and 1 measured best on the H200)")


def speculative(args) -> dict:
    """The jaxflash.load keywords of add_speculative's arguments."""
    return dict(speculative=None if args.spec == "none" else args.spec, draft_tokens=args.draft_tokens)


def add_compile_cache(ap: argparse.ArgumentParser) -> None:
    from .compile_cache import ENV, default_dir

    ap.add_argument("--compile-cache", default=None, metavar="DIR|off",
                    help=f"keep compiled programs here for the next start (default: ${ENV}, else {default_dir()})")


def setup(level: str = "warning", compile_cache: str | None = None) -> None:
    """Logging for jaxflash at `level` (other libraries' chatter, such as JAX probing for absent backends,
    stays at warnings), and the persistent compilation cache."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jaxflash").setLevel(level.upper())
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "Unable to initialize backend 'tpu'"
    from .compile_cache import enable_compilation_cache

    enable_compilation_cache(compile_cache)


def exit_now(status: int):
    """End the process with `status` at once, output flushed. A normal exit would first wait for the engine's
    compilation threads, and an interpreter finalised while a thread is inside XLA can abort ('FATAL: exception
    not rethrown')."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def errors_exit():
    """Turn a user-caused failure into `error: ...` on stderr and exit status 2, Ctrl-C into exit status 130."""
    try:
        yield
    except KeyboardInterrupt:
        if os.environ.get("JAXFLASH_DEBUG"):
            raise
        exit_now(130)
    except USER_ERRORS as e:
        if os.environ.get("JAXFLASH_DEBUG"):
            raise
        msg = str(e) or type(e).__name__
        if isinstance(e, OSError) and e.filename and e.strerror:
            msg = f"{e.filename}: {e.strerror}"
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None
