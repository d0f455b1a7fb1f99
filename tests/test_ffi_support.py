"""Shared helpers of the FFI tests (no tests here): a minimal safetensors locator with the checkpoint reader's
`location` signature, and routing traces."""

from __future__ import annotations

import json
import os
import struct

import numpy as np

class SafetensorsIndex:
    """`location(name) -> (file_path, byte_offset, nbytes, dtype, shape)` over some .safetensors files."""

    def __init__(self, paths):
        self.entries = {}
        for path in paths:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                lo, hi = meta["data_offsets"]
                self.entries[name] = (os.fspath(path), 8 + n + lo, hi - lo, meta["dtype"], tuple(meta["shape"]))

    def location(self, name):
        return self.entries[name]


def zipf_trace(rng, steps: int, tokens: int, k: int, num_experts: int, a: float = 1.1) -> np.ndarray:
    """[steps, tokens, k] routed ids, each token's k experts distinct, drawn with Zipf-like popularity over a
    random permutation of the experts."""
    p = 1.0 / np.arange(1, num_experts + 1) ** a
    p /= p.sum()
    perm = rng.permutation(num_experts)
    out = np.empty((steps, tokens, k), np.int32)
    for s in range(steps):
        for t in range(tokens):
            out[s, t] = perm[rng.choice(num_experts, k, replace=False, p=p)]
    return out


def uniform_trace(rng, steps: int, tokens: int, k: int, num_experts: int) -> np.ndarray:
    out = np.empty((steps, tokens, k), np.int32)
    for s in range(steps):
        for t in range(tokens):
            out[s, t] = rng.choice(num_experts, k, replace=False)
    return out


def random_pool(num_layers: int, num_experts: int, record_bytes: int, *, pin: bool = False, seed: int = 0):
    """A raw expert pool of random records (any record size: no expert layout needed); returns (id, view).
    With pin=True the pool must come out pinned (the GPU tests' zero-copy gather needs it)."""
    from jaxflash import ffi

    mod = ffi.module()
    info = mod.pool_create(num_layers, num_experts, record_bytes, pin)
    assert info["pinned"] or not pin, info["note"]
    arr = mod.pool_array(info["id"])
    arr[...] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return info["id"], arr
