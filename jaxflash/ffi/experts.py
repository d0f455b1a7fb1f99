"""The expert store: every routed expert of a checkpoint in one host pool, one fixed-size record per expert.

Record layout (one expert; sections in this order, each starting at a multiple of 256 bytes, the record size a
multiple of 256 so 16-byte vector copies always line up). H = hidden_size, I = moe_intermediate_size.

  NVFP4 (docs/model.md §12; bytes exactly as on disk, scales still linear/unswizzled):
    gate_up_weight  uint8          [2I, H/2]   gate rows, then up rows; two E2M1 codes per byte, low nibble first
    down_weight     uint8          [H, I/2]
    gate_up_scale   float8_e4m3fn  [2I, H/16]  gate rows, then up rows
    down_scale      float8_e4m3fn  [H, I/16]
    scale_2         float32        [3]         weight_scale_2 of gate, up, down
  BF16 (unquantised):
    gate_up_weight  bfloat16       [2I, H]
    down_weight     bfloat16       [H, I]

At H=2560, I=640 an NVFP4 record is 2,765,056 bytes. The pool is [layers, experts, record_bytes] bytes; a VRAM
cache slot holds one record in the same layout, so one gather copies one contiguous block and each slot keeps
its scales next to its weights. `ExpertLayout.view` turns records back into typed arrays.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable, Sequence

import ml_dtypes
import numpy as np

from . import _ext
from .memory import HostMemory, pinning_fits, read_host_memory

ALIGN = 256
KINDS = ("nvfp4", "bf16")

# Spellings of the dtypes a checkpoint reader may report (safetensors' and numpy's names).
_DTYPES = {
    "u8": np.dtype(np.uint8),
    "uint8": np.dtype(np.uint8),
    "f8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "f32": np.dtype(np.float32),
    "float32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def normalize_dtype(name: Any) -> np.dtype:
    """The numpy dtype of a checkpoint dtype name ('U8', 'F8_E4M3', 'F32', 'BF16' or numpy's names)."""
    if isinstance(name, np.dtype):
        return name
    key = str(name).strip().lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unsupported expert tensor dtype {name!r}; expected one of U8, F8_E4M3, F32, BF16")
    return _DTYPES[key]


class PinningWarning(UserWarning):
    """The expert pool could not be pinned and lives in ordinary (pageable) memory."""


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorSlot:
    """Where one checkpoint tensor lands inside a record."""

    suffix: str  # e.g. "gate_proj.weight_scale"
    offset: int  # byte offset inside the record
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertLayout:
    kind: str  # "nvfp4" or "bf16"
    hidden_size: int
    intermediate_size: int
    group_size: int = 16  # NVFP4 block-scale group along K

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"expert layout kind {self.kind!r}: expected one of {KINDS}")
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size
        if H <= 0 or I <= 0:
            raise ValueError(f"hidden_size={H} and intermediate_size={I} must be positive")
        if self.kind == "nvfp4" and (H % g or I % g or g % 2):
            raise ValueError(f"NVFP4 needs hidden_size={H} and intermediate_size={I} divisible by group_size={g}")

    @classmethod
    def from_config(cls, config, kind: str = "nvfp4") -> ExpertLayout:
        return cls(kind, config.hidden_size, config.moe_intermediate_size)

    @cached_property
    def sections(self) -> dict[str, Section]:
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size
        f8, u8 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)
        if self.kind == "nvfp4":
            spec = [
                ("gate_up_weight", u8, (2 * I, H // 2)),
                ("down_weight", u8, (H, I // 2)),
                ("gate_up_scale", f8, (2 * I, H // g)),
                ("down_scale", f8, (H, I // g)),
                ("scale_2", np.dtype(np.float32), (3,)),
            ]
        else:
            bf = np.dtype(ml_dtypes.bfloat16)
            spec = [("gate_up_weight", bf, (2 * I, H)), ("down_weight", bf, (H, I))]
        out, at = {}, 0
        for name, dt, shape in spec:
            nbytes = math.prod(shape) * dt.itemsize
            out[name] = Section(name, at, nbytes, dt, shape)
            at += -(-nbytes // ALIGN) * ALIGN
        return out

    @cached_property
    def record_bytes(self) -> int:
        last = list(self.sections.values())[-1]
        return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN

    @cached_property
    def tensors(self) -> tuple[TensorSlot, ...]:
        """Each per-expert checkpoint tensor (name suffix after `experts.{e}.`) and where it lands."""
        H, I, g = self.hidden_size, self.intermediate_size, self.group_size
        s = self.sections
        u8, f8 = np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn)
        if self.kind == "nvfp4":
            gw, dw, gs, ds, s2 = (s[k].offset for k in
                                  ("gate_up_weight", "down_weight", "gate_up_scale", "down_scale", "scale_2"))
            f32 = np.dtype(np.float32)
            return (
                TensorSlot("gate_proj.weight", gw, u8, (I, H // 2)),
                TensorSlot("up_proj.weight", gw + I * H // 2, u8, (I, H // 2)),
                TensorSlot("down_proj.weight", dw, u8, (H, I // 2)),
                TensorSlot("gate_proj.weight_scale", gs, f8, (I, H // g)),
                TensorSlot("up_proj.weight_scale", gs + I * H // g, f8, (I, H // g)),
                TensorSlot("down_proj.weight_scale", ds, f8, (H, I // g)),
                TensorSlot("gate_proj.weight_scale_2", s2, f32, ()),
                TensorSlot("up_proj.weight_scale_2", s2 + 4, f32, ()),
                TensorSlot("down_proj.weight_scale_2", s2 + 8, f32, ()),
            )
        bf = np.dtype(ml_dtypes.bfloat16)
        gw, dw = s["gate_up_weight"].offset, s["down_weight"].offset
        return (
            TensorSlot("gate_proj.weight", gw, bf, (I, H)),
            TensorSlot("up_proj.weight", gw + I * H * 2, bf, (I, H)),
            TensorSlot("down_proj.weight", dw, bf, (H, I)),
        )

    def view(self, records, name: str):
        """Section `name` of records (uint8 [..., record_bytes], numpy or JAX) as a typed array [..., *shape]."""
        sec = self.sections[name]
        raw = records[..., sec.offset : sec.offset + sec.nbytes]
        lead = raw.shape[:-1]
        if isinstance(records, np.ndarray):
            return raw.view(sec.dtype).reshape(*lead, *sec.shape)
        import jax

        size = sec.dtype.itemsize
        if size == 1:
            typed = jax.lax.bitcast_convert_type(raw, sec.dtype)
        else:
            typed = jax.lax.bitcast_convert_type(raw.reshape(*lead, sec.nbytes // size, size), sec.dtype)
        return typed.reshape(*lead, *sec.shape)

    def pack(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """One record (uint8 [record_bytes]) from per-expert tensors keyed by suffix (see `tensors`)."""
        rec = np.zeros(self.record_bytes, np.uint8)
        for slot in self.tensors:
            if slot.suffix not in tensors:
                raise KeyError(f"missing expert tensor {slot.suffix!r}")
            arr = np.ascontiguousarray(np.asarray(tensors[slot.suffix], dtype=slot.dtype)).reshape(slot.shape)
            rec[slot.offset : slot.offset + slot.nbytes] = arr.reshape(-1).view(np.uint8)
        return rec


# ----- the load plan -------------------------------------------------------------------------------------------
Locate = Callable[[str], tuple]  # name -> (file_path, byte_offset, nbytes, dtype_str, shape)


def layer_prefixes(layers: Iterable[int]) -> list[str]:
    """Checkpoint name prefixes of the routed experts of decoder layers `layers`."""
    return [f"layers.{i}.mlp.experts" for i in layers]


def _check(name: str, loc: tuple, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[str, int, int]:
    if len(loc) != 5:
        raise ValueError(f"{name}: location() must return (file_path, byte_offset, nbytes, dtype, shape); got {loc!r}")
    path, offset, nbytes, dt, shp = loc
    got_dt, got_shape = normalize_dtype(dt), tuple(int(x) for x in shp)
    # A scalar may be stored as [] or [1].
    if got_dt != dtype or (got_shape != shape and not (shape == () and got_shape == (1,))):
        raise ValueError(f"{name}: checkpoint has {dt} {list(got_shape)}, the expert layout expects "
                         f"{dtype.name} {list(shape)}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if int(nbytes) != expected:
        raise ValueError(f"{name}: {nbytes} bytes on disk, expected {expected}")
    return os.fspath(path), int(offset), int(nbytes)


def expert_plan(locate: Locate, layout: ExpertLayout, prefixes: Sequence[str],
                num_experts: int) -> list[tuple[str, int, int, int]]:
    """The load plan [(file_path, byte_offset, nbytes, pool_offset)] for pool layer j = prefixes[j].

    Per-expert names (`{prefix}.{e}.gate_proj.weight`, ...) are looked up first; a BF16 layer stored fused as
    transformers saves it (`{prefix}.gate_up_proj` [E, 2I, H], `{prefix}.down_proj` [E, H, I]) is accepted too.
    Every tensor's dtype, shape and size are checked against the layout."""
    R = layout.record_bytes
    plan = []
    for j, prefix in enumerate(prefixes):
        base = j * num_experts * R
        if layout.kind == "bf16" and not _has(locate, f"{prefix}.0.{layout.tensors[0].suffix}"):
            plan.extend(_fused_bf16_plan(locate, layout, prefix, num_experts, base))
            continue
        for e in range(num_experts):
            for slot in layout.tensors:
                name = f"{prefix}.{e}.{slot.suffix}"
                try:
                    loc = locate(name)
                except _MISSING as e:
                    raise KeyError(f"expert tensor {name!r} is not in the checkpoint ({e})") from None
                path, off, n = _check(name, loc, slot.dtype, slot.shape)
                plan.append((path, off, n, base + e * R + slot.offset))
    return plan


# How a locator says "no such tensor": KeyError/LookupError, or jaxflash.checkpoint's CheckpointError (a ValueError).
_MISSING = (LookupError, ValueError)


def _has(locate: Locate, name: str) -> bool:
    try:
        locate(name)
    except _MISSING:
        return False
    return True


def _fused_bf16_plan(locate: Locate, layout: ExpertLayout, prefix: str, num_experts: int,
                     base: int) -> list[tuple[str, int, int, int]]:
    H, I, R = layout.hidden_size, layout.intermediate_size, layout.record_bytes
    bf = np.dtype(ml_dtypes.bfloat16)
    gu = _check(f"{prefix}.gate_up_proj", locate(f"{prefix}.gate_up_proj"), bf, (num_experts, 2 * I, H))
    dn = _check(f"{prefix}.down_proj", locate(f"{prefix}.down_proj"), bf, (num_experts, H, I))
    s = layout.sections
    out = []
    for e in range(num_experts):
        n_gu, n_dn = 2 * I * H * 2, H * I * 2  # each expert's slice is contiguous: gate rows, then up rows
        out.append((gu[0], gu[1] + e * n_gu, n_gu, base + e * R + s["gate_up_weight"].offset))
        out.append((dn[0], dn[1] + e * n_dn, n_dn, base + e * R + s["down_weight"].offset))
    return out


# ----- the pool ------------------------------------------------------------------------------------------------
@dataclass
class LoadStats:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class ExpertPool:
    """A [num_layers, num_experts, record_bytes] host pool held by the native registry under `id`.

    pin: "auto" pins (cudaHostAlloc, mapped + portable) when a CUDA device is in use and the pool fits the
    host's memory limits (cgroup-aware, see memory.py); True pins regardless of those limits; False never
    pins. A pool that cannot be pinned falls back to ordinary memory with a PinningWarning: gathers then
    take the memcpy path. Close it (or use it as a context manager) to free it, but only once no compiled
    step that gathers from it can run again: a recorded CUDA graph keeps the pool's address. (Numpy views
    from `array` keep the memory alive on their own.)"""

    layout: ExpertLayout
    num_layers: int
    num_experts: int
    pin: Any = "auto"
    memory: HostMemory | None = None
    id: int = field(init=False, default=0)
    pinned: bool = field(init=False, default=False)
    note: str = field(init=False, default="")

    def __post_init__(self):
        mod = _ext.module()
        nbytes = self.num_layers * self.num_experts * self.layout.record_bytes
        want = self.pin
        if want not in ("auto", True, False):
            raise ValueError(f"pin={want!r}: expected 'auto', True or False")
        reason = ""
        if want == "auto":
            want = bool(mod.has_cuda and mod.cuda_device_count() > 0)
            if want:
                fits, reason = pinning_fits(nbytes, self.memory or read_host_memory())
                want = fits
        info = mod.pool_create(self.num_layers, self.num_experts, self.layout.record_bytes, bool(want))
        self.id, self.pinned, self.note = int(info["id"]), bool(info["pinned"]), info["note"] or reason
        if (self.pin is True or reason) and not self.pinned:
            warnings.warn(f"expert pool of {nbytes / 2**30:.2f} GiB is not pinned: {self.note}; it lives in "
                          "pageable memory and gathers use the slower memcpy path", PinningWarning, stacklevel=3)

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.layout.record_bytes

    @property
    def array(self) -> np.ndarray:
        """A writable numpy view of the pool, uint8 [num_layers, num_experts, record_bytes]."""
        return _ext.module().pool_array(self.id)

    def load(self, plan: Sequence[tuple[str, int, int, int]], threads: int = 8) -> LoadStats:
        """pread every (file_path, byte_offset, nbytes, pool_offset) of `plan` with `threads` threads."""
        t0 = time.perf_counter()
        n = _ext.module().pool_load(self.id, [(os.fspath(p), int(o), int(n), int(d)) for p, o, n, d in plan],
                                    int(threads))
        return LoadStats(int(n), time.perf_counter() - t0)

    @classmethod
    def from_checkpoint(cls, ckpt, layout: ExpertLayout, layers: Sequence[int], num_experts: int, *,
                        pin: Any = "auto", threads: int = 8) -> ExpertPool:
        """A pool of the routed experts of decoder `layers` (pool layer j = layers[j]) read from `ckpt`, any
        object with `location(name) -> (file_path, byte_offset, nbytes, dtype_str, shape)`."""
        plan = expert_plan(ckpt.location, layout, layer_prefixes(layers), num_experts)
        pool = cls(layout, len(layers), num_experts, pin=pin)
        try:
            pool.load(plan, threads)
        except BaseException:
            pool.close()
            raise
        return pool

    def close(self) -> None:
        if self.id:
            _ext.module().pool_release(self.id)
            self.id = 0

    def __enter__(self) -> ExpertPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
