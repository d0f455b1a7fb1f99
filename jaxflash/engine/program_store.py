"""Compiled programs kept on disk and found again without tracing them.

JAX's persistent compilation cache (jaxflash.compile_cache) saves the compilation, but finding a program in it
still means tracing and lowering that program first: for the full-width model that is most of a second start
(13 programs of 32 unrolled layers, about 49 s on the H200, one at a time under Python's lock). The store keys
a compiled executable by everything that determines it, without tracing:
  * jaxflash's own source (a digest of every .py file of the package), jax's and jaxlib's versions, the
    backend, its platform version and device kind, XLA_FLAGS and every jax configuration value;
  * the program (name, Want, rows), the runner's Setup (the model config, geometry, dtype, the FFI pool's and
    n-gram table's registry ids that the program names, ...);
  * the shapes, dtypes, shardings and tree structures of the weights, the state and the inputs.
Anything it cannot describe by value (an object without a stable description) makes the key unique to this
process, so an unknown input can only cost a miss, never a wrong program. A runner with a RoutingSource
(benchmarks) is not stored. The store lives beside JAX's cache (`<cache dir>/jaxflash_programs`) and is on
exactly when that cache is; a file that fails to load is a miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
from functools import lru_cache
from pathlib import Path

import jax
import jaxlib.version
import numpy as np

log = logging.getLogger("jaxflash")
FORMAT = 1


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over jaxflash's Python source (file names and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def describe(v):
    """A JSON-able description of a setup value. Objects of unknown kind fall back to repr, which for most
    carries their memory address: a key that matches nothing in another process (a miss, never a stale hit)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {"type": type(v).__qualname__, **{f.name: describe(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    if isinstance(v, (list, tuple)):
        return [describe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): describe(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if v is None or isinstance(v, (str, bool, int, float)):
        return v
    if isinstance(getattr(v, "id", None), int):  # an FFI registry object (pool, table): programs name it by id,
        # and its plain attributes (pinned, rows, heads, max_tokens, ...) may choose what a program does
        return {"type": type(v).__qualname__,
                **{k: repr(a) for k, a in sorted(vars(v).items())
                   if not k.startswith("_") and isinstance(a, (int, float, str, bool, np.dtype))}}
    return repr(v)  # stable for dtypes and shape structs


def _leaf(a) -> list:
    return [list(np.shape(a)), str(a.dtype), str(getattr(a, "sharding", "")), bool(getattr(a, "weak_type", False))]


def fingerprint(program: str, setup, params, params_def, state, state_def, inputs) -> str:
    """The store key of one program of a runner (see the module docstring)."""
    dev = jax.devices()[0]
    from ..ffi import _ext

    parts = {
        "format": FORMAT, "jaxflash": source_digest(), "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "backend": jax.default_backend(), "platform_version": dev.client.platform_version,
        "device": dev.device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "config": {k: repr(v) for k, v in sorted(jax.config.values.items())},
        "ffi_module": _ext.module().__name__,
        "program": program, "setup": describe(setup),
        "params": [_leaf(a) for a in params], "params_def": str(params_def),
        "state": [_leaf(a) for a in state], "state_def": str(state_def),
        "inputs": repr(inputs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def directory() -> Path | None:
    """Where the store is: beside JAX's persistent compilation cache, when that is on."""
    cache = jax.config.values.get("jax_compilation_cache_dir")
    return Path(cache) / "jaxflash_programs" if cache else None


def load(key: str):
    """The stored program of `key`, or None (no store, no such file, or one that does not load)."""
    where = directory()
    path = where / f"{key}.bin" if where else None
    if path is None or not path.exists():
        return None
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob, in_tree, out_tree = pickle.load(f)
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 -- a cache: a bad file is a miss
        log.warning("stored program %s did not load (%s: %s); compiling it", path.name, type(e).__name__, e)
        return None


def save(key: str, compiled) -> bool:
    """Store a compiled program (atomically: a reader never sees half a file). False if it cannot be stored."""
    where = directory()
    if where is None:
        return False
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(blob)
        os.replace(tmp, where / f"{key}.bin")
        return True
    except Exception as e:  # noqa: BLE001 -- storing only saves time later
        log.warning("program not stored (%s: %s)", type(e).__name__, e)
        return False
