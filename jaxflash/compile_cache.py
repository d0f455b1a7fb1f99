"""JAX's persistent compilation cache for jaxflash's tools: the second start of the same configuration loads
its compiled programs from disk instead of compiling them again (minutes for the full-size model). The engine's
program store (jaxflash.engine.program_store) lives in the same directory and is on when this is.

The tools (scripts/serve.py, generate.py, perplexity.py) turn it on by default. Library users who want it call
`enable_compilation_cache()` themselves: it changes JAX's global configuration, so importing jaxflash does
not do it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("jaxflash")

ENV = "JAXFLASH_COMPILE_CACHE"  # a directory, or "off"


def default_dir() -> Path:
    """$JAXFLASH_COMPILE_CACHE, else $XDG_CACHE_HOME/jaxflash/xla, else ~/.cache/jaxflash/xla."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxflash" / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in `path` (default: default_dir()); "off" leaves the cache off. Returns the
    directory in use, or None. A directory that cannot be created is reported and the cache left off: it only
    saves time, so it never stops a tool."""
    import jax

    spec = str(path) if path is not None else os.environ.get(ENV) or str(default_dir())
    if spec.strip().lower() in ("off", "none", "0", ""):
        return None
    where = Path(spec).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s)", where, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)  # programs, not tiny eager ops
    log.info("compilation cache: %s", where)
    return where
