"""Read qwen4_exp checkpoints: safetensors parsed by hand and memory-mapped, both layouts, ModelOpt quantization.

Why not the `safetensors` package: its numpy backend has no float8 dtypes, and the released NVFP4 checkpoint
stores F8_E4M3 scales and an FP8 n-gram table. The format is small (safetensors: "u64 little-endian header length N,
N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}, then the data"), so
we parse it here and hand out read-only numpy views of an mmap of each file. Nothing is copied until the caller
copies it, so loading the 123 GiB checkpoint never holds two copies, and the n-gram table (48 GiB in FP8) is
gathered row by row straight from the page cache.

Names. jaxflash names a tensor WITHOUT the text model's prefix: "embed_tokens.weight",
"layers.3.self_attn.q_proj.weight". Names starting with "lm_head." or "mtp." are top-level in every layout.
The prefix on disk is "model.language_model." in the released multimodal layout (config.json nests the text
model in `text_config`; the vision tower `model.visual.*` is never read) and "model." in the text-only layout
that transformers' `Qwen4ExpForCausalLM.save_pretrained` writes (which drops `mtp.*`).

Quantization (docs/model.md §12) comes from `quantization_config` in config.json (top level or inside
`text_config`) or the legacy `hf_quant_config.json`; `QuantConfig` answers "which algorithm applies to module X".

`expected_tensors(config, quant)` lists every tensor the text model and the MTP head need, with shape and dtype:
the reader validates against it and the synthetic writer (jaxflash.synthetic) writes exactly it.
"""

from __future__ import annotations

import fnmatch
import json
import math
import mmap
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import ml_dtypes
import numpy as np

from .config import (RELEASE_PREFIX, TEXT_PREFIX, ConfigError, ModelConfig, is_release_layout,
                     read_config_json)
from .quant import FP4_BLOCK, FP8_BLOCK, FP8BlockWeight, FP8Weight, NVFP4Weight, fp8_block_scale_shape


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has a wrong one, is damaged, or uses a format we do not read.
    The message always names the file, and the tensor when one is involved."""


# ---------------------------------------------------------------------------------------------------------------
# safetensors: dtypes, header parsing, writing
# ---------------------------------------------------------------------------------------------------------------
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})  # interchangeable for dense weights (HF saves fp32 or bf16)
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the reference implementation enforces


def dtype_name(dtype) -> str:
    """numpy/ml_dtypes dtype -> safetensors dtype string."""
    try:
        return DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} has no safetensors equivalent") from None


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `offset` is absolute in `file` (header included)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header. Returns ({name: TensorInfo}, __metadata__)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes; the 8-byte header "
                                      f"length is missing)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header: it claims {n} bytes of JSON but the file "
                                      f"has {size} bytes{' (over the 100 MiB limit)' if n > MAX_HEADER_BYTES else ''}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"tensor {name!r} in {path}"
        try:
            dt, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: corrupt header entry {entry!r} (needs dtype, shape, "
                                  f"data_offsets=[begin, end])") from None
        if dt not in DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dt!r} (supported: {sorted(DTYPES)})")
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CheckpointError(f"{where}: corrupt header entry (shape {list(shape)}, offsets [{begin}, {end}])")
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{where}: header says {end - begin} bytes but {dt} {list(shape)} needs {nbytes}")
        if end > data_len:
            raise CheckpointError(f"{where}: data [{begin}, {end}) runs past the end of the file's data "
                                  f"({data_len} bytes): the file is truncated")
        tensors[name] = TensorInfo(name, path, dt, shape, data_start + begin, nbytes)
    return tensors, metadata


class SafetensorsFile:
    """One .safetensors file: its header, and tensors as read-only views of a lazily created mmap."""

    def __init__(self, path: str):
        self.path = path
        self.tensors, self.metadata = read_header(path)
        self._mmap: mmap.mmap | None = None
        self._lock = threading.Lock()

    def array(self, info: TensorInfo) -> np.ndarray:
        with self._lock:  # loaders may read from several threads; map the file once
            if self._mmap is None:
                with open(self.path, "rb") as f:
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if info.offset + info.nbytes > len(self._mmap):  # the file shrank after we read its header
            raise CheckpointError(f"tensor {info.name!r} in {self.path}: the file is truncated")
        count = math.prod(info.shape)
        return np.frombuffer(self._mmap, dtype=DTYPES[info.dtype], count=count, offset=info.offset).reshape(info.shape)


class SafetensorsWriter:
    """Write one .safetensors file whose tensor list is known up front, streaming the data tensor by tensor.

    The header is written first, from the planned (name, dtype, shape) list, so no tensor has to be held in memory
    longer than it takes to write it; `write` must then be called in plan order (a tensor may arrive in several
    row chunks). The JSON is padded with spaces to a multiple of 8 bytes, as the reference writer does.
    """

    def __init__(self, path: str, entries: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = path
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._sizes: list[tuple[str, int]] = []
        pos = 0
        for name, dt, shape in entries:
            nbytes = math.prod(shape) * DTYPES[dt].itemsize
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self._sizes.append((name, nbytes))
            pos += nbytes
        self.data_bytes = pos
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._index, self._left = 0, (self._sizes[0][1] if self._sizes else 0)

    def write(self, name: str, data: np.ndarray) -> None:
        """Append bytes of tensor `name` (the whole tensor or the next chunk of its rows)."""
        while self._index < len(self._sizes) and self._left == 0 and self._sizes[self._index][0] != name:
            self._advance()
        if self._index >= len(self._sizes) or self._sizes[self._index][0] != name:
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of plan order")
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if buf.size > self._left:
            raise CheckpointError(f"{self.path}: tensor {name!r} got {buf.size} bytes, only {self._left} left")
        self._f.write(buf.data)
        self._left -= buf.size

    def _advance(self) -> None:
        self._index += 1
        self._left = self._sizes[self._index][1] if self._index < len(self._sizes) else 0

    def close(self) -> None:
        while self._index < len(self._sizes) and self._left == 0:
            self._advance()
        self._f.close()
        if self._index < len(self._sizes):
            raise CheckpointError(f"{self.path}: tensor {self._sizes[self._index][0]!r} was not fully written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write a dict of arrays (any dtype in DTYPES, including bfloat16 and float8) to one file."""
    entries = [(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    with SafetensorsWriter(path, entries, metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)


# ---------------------------------------------------------------------------------------------------------------
# Quantization config
# ---------------------------------------------------------------------------------------------------------------
QUANT_ALGOS = frozenset({"NVFP4", "W4A16_NVFP4", "FP8", "FP8_PB_WO"})
# Early composed checkpoints spell FP8_PB_WO this way (third-party vLLM patches accept both).
_ALGO_ALIASES = {"FP8_BLOCK_SCALES": "FP8_PB_WO"}
_QUANT_METHODS = frozenset({"modelopt", "modelopt_fp4", "modelopt_mixed"})


class QuantScheme(NamedTuple):
    algo: str  # one of QUANT_ALGOS
    group_size: int  # NVFP4: elements per FP8 scale (16); FP8_PB_WO: tile edge (128); FP8: 0 (per tensor)


def _scheme(algo: Any, group_size: Any, source: str, where: str) -> QuantScheme:
    if not isinstance(algo, str):
        raise CheckpointError(f"{source}: quant_algo {algo!r} for {where} is not a string")
    name = _ALGO_ALIASES.get(algo.upper(), algo.upper())
    if name not in QUANT_ALGOS:
        raise CheckpointError(f"{source}: unknown quant_algo {algo!r} for {where} "
                              f"(jaxflash reads {sorted(QUANT_ALGOS)} and MIXED_PRECISION)")
    default = {"NVFP4": FP4_BLOCK, "W4A16_NVFP4": FP4_BLOCK, "FP8_PB_WO": FP8_BLOCK, "FP8": 0}[name]
    g = default if group_size is None else group_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 0:
        raise CheckpointError(f"{source}: group_size {group_size!r} for {where} must be a non-negative integer")
    if name in ("NVFP4", "W4A16_NVFP4") and g != FP4_BLOCK:
        raise CheckpointError(f"{source}: {name} for {where} with group_size {g}: NVFP4 is defined with 16")
    if name == "FP8_PB_WO" and g <= 0:
        raise CheckpointError(f"{source}: FP8_PB_WO for {where} needs a positive group_size")
    return QuantScheme(name, g)


def _top_level(name: str) -> bool:
    return name.startswith(("lm_head.", "mtp.")) or name in ("lm_head", "mtp")


def full_name(short: str, prefix: str) -> str:
    """jaxflash name -> name on disk."""
    return short if _top_level(short) else prefix + short


@dataclass(frozen=True)
class QuantConfig:
    """ModelOpt quantization of a checkpoint; module names are the on-disk ones (with the text prefix).

    `algo` is the single algorithm of a plain config ("NVFP4", ...), "MIXED_PRECISION" when each module's
    algorithm comes from `quantized_layers`, or None for an unquantized checkpoint. `ignore` holds glob patterns
    (fnmatch) of modules kept in BF16. A module inherits the setting of its nearest listed ancestor, so
    "…layers.3.mlp.experts" covers "…layers.3.mlp.experts.17.down_proj".
    """

    algo: str | None = None
    group_size: int | None = None
    ignore: tuple[str, ...] = ()
    quantized_layers: dict[str, QuantScheme] = field(default_factory=dict)
    kv_cache_quant_algo: str | None = None
    prefix: str = RELEASE_PREFIX  # how jaxflash names map to the names above
    source: str = "<none>"  # the file this came from, for error messages

    def __post_init__(self):
        # The full model asks about ~300k tensors: match all patterns with one compiled regex per kind.
        def compile_globs(patterns):
            return re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None

        object.__setattr__(self, "_ignore_re", compile_globs(self.ignore))
        globs = [p for p in self.quantized_layers if any(c in p for c in "*?[")]
        object.__setattr__(self, "_layer_globs", [(compile_globs([p]), self.quantized_layers[p]) for p in globs])

    @property
    def is_quantized(self) -> bool:
        return self.algo is not None

    # ----- parsing ------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str, prefix: str = RELEASE_PREFIX) -> QuantConfig:
        """`quantization_config` of config.json: {"quant_method": "modelopt", "quant_algo": ..., "ignore": [...],
        "quantized_layers": {...}} (the latter only for MIXED_PRECISION)."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: quantization_config must be an object, got {type(d).__name__}")
        method = d.get("quant_method")
        if not isinstance(method, str) or method.lower() not in _QUANT_METHODS:
            raise CheckpointError(f"{source}: unsupported quantization quant_method {method!r} "
                                  f"(jaxflash reads NVIDIA ModelOpt checkpoints: {sorted(_QUANT_METHODS)})")
        ignore = d.get("ignore", d.get("exclude_modules")) or []
        return cls._build(d.get("quant_algo"), d.get("group_size"), ignore, d.get("quantized_layers"),
                          d.get("kv_cache_quant_algo"), source, prefix)

    @classmethod
    def from_legacy(cls, d: dict, source: str, prefix: str = RELEASE_PREFIX) -> QuantConfig:
        """hf_quant_config.json: {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ...,
        "group_size": 16, "exclude_modules": [...], "quantized_layers": {...}}}."""
        if not isinstance(d, dict) or not isinstance(d.get("quantization"), dict):
            raise CheckpointError(f"{source}: expected {{\"producer\": ..., \"quantization\": {{...}}}}")
        producer = (d.get("producer") or {}).get("name", "modelopt")
        if str(producer).lower() != "modelopt":
            raise CheckpointError(f"{source}: unsupported quantization producer {producer!r} (expected modelopt)")
        q = d["quantization"]
        return cls._build(q.get("quant_algo"), q.get("group_size"), q.get("exclude_modules") or [],
                          q.get("quantized_layers"), q.get("kv_cache_quant_algo"), source, prefix)

    @classmethod
    def _build(cls, algo, group_size, ignore, layers, kv_algo, source, prefix) -> QuantConfig:
        if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
            raise CheckpointError(f"{source}: the ignore/exclude_modules list must be a list of strings")
        if algo is None:
            raise CheckpointError(f"{source}: quantization config has no quant_algo")
        if not isinstance(algo, str):
            raise CheckpointError(f"{source}: quant_algo {algo!r} is not a string")
        if algo.upper() == "MIXED_PRECISION":
            if not isinstance(layers, dict) or not layers:
                raise CheckpointError(f"{source}: MIXED_PRECISION needs a non-empty quantized_layers object")
            parsed = {}
            for module, spec in layers.items():
                if not isinstance(spec, dict):
                    raise CheckpointError(f"{source}: quantized_layers[{module!r}] must be an object")
                parsed[module] = _scheme(spec.get("quant_algo"), spec.get("group_size"), source, module)
            return cls("MIXED_PRECISION", None, tuple(ignore), parsed, kv_algo, prefix, source)
        scheme = _scheme(algo, group_size, source, "the whole model")
        return cls(scheme.algo, scheme.group_size, tuple(ignore), {}, kv_algo, prefix, source)

    @classmethod
    def load(cls, directory: str, raw_config: dict, prefix: str) -> QuantConfig:
        """Find the quantization config of a checkpoint directory; none means unquantized."""
        cfg_path = os.path.join(directory, "config.json")
        for d in (raw_config, raw_config.get("text_config") or {}):
            if isinstance(d, dict) and d.get("quantization_config") is not None:
                return cls.from_dict(d["quantization_config"], cfg_path, prefix)
        legacy = os.path.join(directory, "hf_quant_config.json")
        if os.path.exists(legacy):
            try:
                with open(legacy) as f:
                    d = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{legacy}: cannot parse ({e})") from None
            return cls.from_legacy(d, legacy, prefix)
        return cls(prefix=prefix, source=cfg_path)

    # ----- queries ------------------------------------------------------------------------------------------
    @staticmethod
    def _ancestors(module: str) -> Iterator[str]:
        parts = module.split(".")
        for i in range(len(parts), 0, -1):
            yield ".".join(parts[:i])

    def is_ignored(self, module: str) -> bool:
        """`module` is an on-disk module name."""
        return self._ignore_re is not None and any(self._ignore_re.match(m) for m in self._ancestors(module))

    def scheme_full(self, module: str) -> QuantScheme | None:
        """The scheme of an on-disk module name, or None when it is stored unquantized."""
        if self.algo is None or self.is_ignored(module):
            return None
        if self.algo != "MIXED_PRECISION":
            return QuantScheme(self.algo, self.group_size)
        for m in self._ancestors(module):
            if m in self.quantized_layers:
                return self.quantized_layers[m]
            for regex, scheme in self._layer_globs:
                if regex.match(m):
                    return scheme
        return None

    def scheme(self, module: str) -> QuantScheme | None:
        """The scheme of a module named as jaxflash names it ("layers.3.mlp.experts.5.up_proj", "mtp.…")."""
        return self.scheme_full(full_name(module, self.prefix))

    def algo_of(self, module: str) -> str | None:
        s = self.scheme(module)
        return None if s is None else s.algo

    # ----- writing ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The config.json `quantization_config` form."""
        d: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": self.algo,
                             "kv_cache_quant_algo": self.kv_cache_quant_algo}
        if self.algo == "MIXED_PRECISION":
            d["quantized_layers"] = {m: ({"quant_algo": s.algo, "group_size": s.group_size} if s.group_size
                                         else {"quant_algo": s.algo}) for m, s in self.quantized_layers.items()}
        elif self.group_size:
            d["group_size"] = self.group_size
        d["ignore"] = list(self.ignore)
        return d

    def to_legacy_dict(self, version: str = "0.0.0") -> dict:
        """The hf_quant_config.json form."""
        q = self.to_dict()
        q.pop("quant_method")
        q["exclude_modules"] = q.pop("ignore")
        return {"producer": {"name": "modelopt", "version": version}, "quantization": q}


# ---------------------------------------------------------------------------------------------------------------
# The tensors a checkpoint must hold
# ---------------------------------------------------------------------------------------------------------------
class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype; BF16/F16/F32 are accepted for one another when reading


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def _linear_tensors(module: str, out_f: int, in_f: int, scheme: QuantScheme | None, dense: str
                    ) -> dict[str, TensorSpec]:
    """The tensors of one (possibly quantized) linear layer [out_f, in_f]."""
    if scheme is None:
        return {f"{module}.weight": TensorSpec((out_f, in_f), dense)}
    algo, g = scheme
    if algo in ("NVFP4", "W4A16_NVFP4"):
        if in_f % g:
            raise CheckpointError(f"module {module!r}: in_features {in_f} is not a multiple of the NVFP4 group {g}")
        t = {f"{module}.weight": TensorSpec((out_f, in_f // 2), "U8"),
             f"{module}.weight_scale": TensorSpec((out_f, in_f // g), "F8_E4M3"),
             f"{module}.weight_scale_2": TensorSpec((), "F32")}
        if algo == "NVFP4":
            t[f"{module}.input_scale"] = TensorSpec((), "F32")
        return t
    if algo == "FP8":
        return {f"{module}.weight": TensorSpec((out_f, in_f), "F8_E4M3"),
                f"{module}.weight_scale": TensorSpec((), "F32"),
                f"{module}.input_scale": TensorSpec((), "F32")}
    if algo == "FP8_PB_WO":
        return {f"{module}.weight": TensorSpec((out_f, in_f), "F8_E4M3"),
                f"{module}.weight_scale": TensorSpec(fp8_block_scale_shape((out_f, in_f), g), "F32")}
    raise CheckpointError(f"module {module!r}: quant_algo {algo} is not supported for linear layers")


def _hc_tensors(module: str, c: ModelConfig, combine: bool, dense: str) -> dict[str, TensorSpec]:
    w = c.hc_hidden_size
    t = {f"{module}.hc_norm.weight": TensorSpec((w,), dense),
         f"{module}.input_mix_weight_down.weight": TensorSpec((c.hc_lowrank, w), dense),
         f"{module}.input_mix_weight_up.weight": TensorSpec((w, c.hc_lowrank), dense)}
    if combine:
        t[f"{module}.block_inject_weight.weight"] = TensorSpec((c.hc_count, w), dense)
    return t


def _decoder_layer_tensors(p: str, c: ModelConfig, layer_type: str, ple_index: int | None,
                           quant: QuantConfig, dense: str) -> dict[str, TensorSpec]:
    """Tensors of one decoder layer under the jaxflash name prefix `p` ("layers.3." or "mtp.layers.0.")."""
    H, q = c.hidden_size, quant.scheme
    t: dict[str, TensorSpec] = {}

    def linear(module, out_f, in_f):
        t.update(_linear_tensors(p + module, out_f, in_f, q(p + module), dense))

    if ple_index is not None:  # docs/model.md §6
        e = p + "ple.ple_embedding."
        rows, parts, dim = c.ngram_table_rows(ple_index), c.split_ngram_parts, c.ngram_head_dim
        if rows % parts:
            raise CheckpointError(f"n-gram table rows {rows} are not divisible by split_ngram_parts {parts}")
        scheme = q(e + "ngram_embedding")
        if scheme is not None and scheme.algo != "FP8":
            raise CheckpointError(f"{quant.source}: n-gram table quantization {scheme.algo} is not supported "
                                  f"(only per-tensor FP8)")
        for i in range(parts):
            t[f"{e}ngram_embedding.shard_{i}.weight"] = TensorSpec((rows // parts, dim),
                                                                   "F8_E4M3" if scheme else dense)
        if scheme:
            t[f"{e}ngram_embedding.weight_scale"] = TensorSpec((), "F32")
        t[e + "layer_multipliers"] = TensorSpec((c.ngram_size,), "I64")
        t[e + "ngram_heads_vocab_sizes"] = TensorSpec((c.num_ngram_heads,), "I64")
        t[e + "ngram_heads_offsets"] = TensorSpec((c.num_ngram_heads,), "I64")
        W, D = c.hc_hidden_size, c.ple_embed_dim
        linear("ple.key_proj", W, D)
        linear("ple.value_proj", H, D)
        for n in ("norm_key", "norm_query", "norm_conv"):
            t[f"{p}ple.{n}.weight"] = TensorSpec((W,), dense)
        t[p + "ple.conv1d.weight"] = TensorSpec((W, 1, c.ple_conv_kernel_size), dense)

    t.update(_hc_tensors(p + "attn_hyper_connection", c, True, dense))
    if layer_type == "linear_attention":  # docs/model.md §7
        a = "linear_attn."
        linear(a + "in_proj_qkv", c.linear_conv_dim, H)
        linear(a + "in_proj_z", c.linear_value_dim, H)
        linear(a + "in_proj_b", c.linear_num_value_heads, H)
        linear(a + "in_proj_a", c.linear_num_value_heads, H)
        t[p + a + "conv1d.weight"] = TensorSpec((c.linear_conv_dim, 1, c.linear_conv_kernel_dim), dense)
        t[p + a + "dt_bias"] = TensorSpec((c.linear_num_value_heads,), dense)
        t[p + a + "A_log"] = TensorSpec((c.linear_num_value_heads,), dense)
        t[p + a + "norm.weight"] = TensorSpec((c.linear_value_head_dim,), dense)
        linear(a + "out_proj", H, c.linear_value_dim)
    else:  # docs/model.md §8, §9
        a = "self_attn."
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        linear(a + "q_proj", 2 * nh * hd, H)
        linear(a + "k_proj", nkv * hd, H)
        linear(a + "v_proj", nkv * hd, H)
        linear(a + "o_proj", H, nh * hd)
        t[p + a + "q_norm.weight"] = TensorSpec((hd,), dense)
        t[p + a + "k_norm.weight"] = TensorSpec((hd,), dense)
        if c.qsa_enabled:
            linear(a + "indexer.index_qk_proj", (c.indexer_n_heads + c.indexer_kv_heads) * c.indexer_head_dim, H)
            t[p + a + "indexer.q_layernorm.weight"] = TensorSpec((c.indexer_head_dim,), dense)
            t[p + a + "indexer.k_layernorm.weight"] = TensorSpec((c.indexer_head_dim,), dense)

    t.update(_hc_tensors(p + "mlp_hyper_connection", c, True, dense))
    m = "mlp."  # docs/model.md §10
    linear(m + "gate", c.num_experts, H)
    linear(m + "shared_expert_gate", 1, H)
    linear(m + "shared_expert.gate_proj", c.shared_expert_intermediate_size, H)
    linear(m + "shared_expert.up_proj", c.shared_expert_intermediate_size, H)
    linear(m + "shared_expert.down_proj", H, c.shared_expert_intermediate_size)
    I = c.moe_intermediate_size
    for e in range(c.num_experts):
        linear(f"{m}experts.{e}.gate_proj", I, H)
        linear(f"{m}experts.{e}.up_proj", I, H)
        linear(f"{m}experts.{e}.down_proj", H, I)
    return t


def expected_tensors(config: ModelConfig, quant: QuantConfig | None = None, *, mtp: bool | None = None,
                     dense_dtype: str = "BF16") -> dict[str, TensorSpec]:
    """Every tensor the text model (+ MTP head) needs, in checkpoint order, named as jaxflash names them.

    `mtp`: include the MTP head (default: when config.mtp_num_hidden_layers > 0). `dense_dtype` is the dtype the
    synthetic writer uses for unquantized tensors; the reader accepts BF16/F16/F32 for any of them.
    """
    c, quant = config, quant or QuantConfig()
    H, V, W = c.hidden_size, c.vocab_size, c.hc_hidden_size
    t: dict[str, TensorSpec] = {"embed_tokens.weight": TensorSpec((V, H), dense_dtype)}
    for i, lt in enumerate(c.layer_types):
        ple_index = c.ple_layers.index(i) if i in c.ple_layers else None
        t.update(_decoder_layer_tensors(f"layers.{i}.", c, lt, ple_index, quant, dense_dtype))
    t.update(_hc_tensors("hyper_connection_mixer", c, False, dense_dtype))
    t.update(_linear_tensors("lm_head", V, H, quant.scheme("lm_head"), dense_dtype))
    if mtp if mtp is not None else c.mtp_num_hidden_layers > 0:  # docs/model.md §11
        t["mtp.pre_fc_norm_embedding.weight"] = TensorSpec((H,), dense_dtype)
        t["mtp.pre_fc_norm_hidden.weight"] = TensorSpec((W,), dense_dtype)
        t.update(_linear_tensors("mtp.fc_embedding", H, H, quant.scheme("mtp.fc_embedding"), dense_dtype))
        t.update(_linear_tensors("mtp.fc_hidden", H, H, quant.scheme("mtp.fc_hidden"), dense_dtype))
        t.update(_decoder_layer_tensors("mtp.layers.0.", c, "full_attention", None, quant, dense_dtype))
        t.update(_hc_tensors("mtp.hyper_connection_mixer", c, False, dense_dtype))
    return t


# ---------------------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------------------
def progress_bytes(items: Iterable, size_of: Callable[[Any], int], *, desc: str, total: int | None = None,
                   disable: bool | None = None) -> Iterator:
    """Yield `items`, advancing a byte-counting tqdm bar by `size_of(item)` once the caller is done with each.

    `disable=None` shows the bar only when stderr is a terminal (tqdm's rule); True silences it.
    """
    from tqdm.auto import tqdm

    items = list(items)
    if total is None:
        total = sum(size_of(x) for x in items)
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=disable,
              dynamic_ncols=True) as bar:
        for x in items:
            yield x
            bar.update(size_of(x))


# ---------------------------------------------------------------------------------------------------------------
# The n-gram table
# ---------------------------------------------------------------------------------------------------------------
class NGramTable:
    """The PLE n-gram table as `parts` memory-mapped shards [rows/parts, dim]; rows are gathered by global id
    without ever concatenating the table (48 GiB in FP8, 96 GiB in BF16)."""

    def __init__(self, shards: list[np.ndarray], locations: list[tuple], scale: float | None, name: str):
        self.shards, self.locations, self.scale, self.name = shards, locations, scale, name
        self.rows_per_shard, self.dim = shards[0].shape
        self.rows = self.rows_per_shard * len(shards)
        self.dtype = shards[0].dtype  # storage dtype
        self.parts = len(shards)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.dim

    def __len__(self) -> int:
        return self.rows

    def gather_raw(self, ids) -> np.ndarray:
        """Rows in the storage dtype (float8_e4m3fn for the FP8 table), shape ids.shape + (dim,)."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"n-gram ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"n-gram id out of range [0, {self.rows}): min {flat.min()}, max {flat.max()}")
        out = np.empty((flat.size, self.dim), self.dtype)
        shard, local = np.divmod(flat, self.rows_per_shard)
        order = np.argsort(shard, kind="stable")  # group the ids by shard: one fancy-index per shard touched
        bounds = np.searchsorted(shard[order], np.arange(self.parts + 1))
        for s in np.flatnonzero(np.diff(bounds)):
            sel = order[bounds[s]:bounds[s + 1]]
            out[sel] = self.shards[s][local[sel]]
        return out.reshape(ids.shape + (self.dim,))

    def gather(self, ids, dtype=np.float32) -> np.ndarray:
        """Dequantized rows: fp8 * scale for the FP8 table, a cast otherwise."""
        raw = self.gather_raw(ids).astype(np.float32)
        if self.scale is not None:
            raw *= np.float32(self.scale)
        return raw.astype(dtype, copy=False)

    __getitem__ = gather


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------------------------
_VISION_PREFIX = "model.visual."


class Checkpoint:
    """A checkpoint directory, opened and validated. Use `Checkpoint.open(path)`."""

    def __init__(self, directory: str, files: dict[str, SafetensorsFile], tensors: dict[str, TensorInfo],
                 raw_config: dict, config: ModelConfig, quant: QuantConfig, layout: str, prefix: str,
                 vision: list[str], unexpected: list[str]):
        self.directory, self.files, self._tensors = directory, files, tensors
        self.raw_config, self.config, self.quant = raw_config, config, quant
        self.layout, self.prefix = layout, prefix
        self.vision_tensors, self.unexpected = vision, unexpected

    # ----- opening ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, validate: bool = True) -> Checkpoint:
        """Open a checkpoint directory (single `model.safetensors` or shards + `model.safetensors.index.json`).

        Reads only headers and the three tiny PLE buffers; with `validate`, checks every expected tensor's presence,
        shape and dtype (docs/model.md §2, §11, §12) and the PLE hash buffers against the config.
        """
        directory = os.fspath(path)
        if os.path.isfile(directory):
            directory = os.path.dirname(directory) or "."
        if not os.path.exists(directory):
            raise CheckpointError(f"{directory}: no such directory")
        if not os.path.isdir(directory):
            raise CheckpointError(f"{directory}: not a directory")
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise CheckpointError(f"{directory}: not a checkpoint directory (it has no config.json)")
        try:
            raw = read_config_json(directory)  # its errors name the file
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        try:
            config = ModelConfig.from_dict(raw)
        except ConfigError as e:
            raise CheckpointError(f"{os.path.join(directory, 'config.json')}: {e}") from None
        layout = "release" if is_release_layout(raw) else "text"
        prefix = RELEASE_PREFIX if layout == "release" else TEXT_PREFIX
        files = cls._open_files(directory)

        tensors: dict[str, TensorInfo] = {}
        vision, unexpected = [], []
        for f in files.values():
            for disk_name, info in f.tensors.items():
                if disk_name.startswith(_VISION_PREFIX):
                    vision.append(disk_name)  # never read
                    continue
                if disk_name.startswith(prefix):
                    short = disk_name[len(prefix):]
                elif _top_level(disk_name):
                    short = disk_name
                else:
                    unexpected.append(disk_name)
                    continue
                if short in tensors:
                    raise CheckpointError(f"tensor {disk_name!r} appears in both {tensors[short].file} and {f.path}")
                tensors[short] = info
        # The layout comes from config.json; the tensor names must agree with it.
        probe = "embed_tokens.weight"
        if probe not in tensors:
            other = TEXT_PREFIX if layout == "release" else RELEASE_PREFIX
            found = [i.file for f in files.values() for n, i in f.tensors.items() if n == other + probe]
            why = (f"config.json describes the {layout} layout (prefix {prefix!r}) but the tensors use prefix "
                   f"{other!r}" if found else f"tensor {prefix + probe!r} is missing")
            raise CheckpointError(f"{directory}: {why} (files: {sorted(files)})")

        quant = QuantConfig.load(directory, raw, prefix)
        ckpt = cls(directory, files, tensors, raw, config, quant, layout, prefix, vision, unexpected)
        ckpt._alias_inverse_scales()
        if validate:
            ckpt.validate()
            ckpt.check_ple_buffers()
        return ckpt

    @staticmethod
    def _open_files(directory: str) -> dict[str, SafetensorsFile]:
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index (needs a weight_map object): "
                                      f"{e!r}") from None
            by_file: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                by_file.setdefault(fname, []).append(name)
            files = {}
            for fname, names in sorted(by_file.items()):
                path = os.path.join(directory, fname)
                if not os.path.isfile(path):
                    raise CheckpointError(f"{index}: shard {path} is missing (it holds {len(names)} tensors, "
                                          f"e.g. {names[0]!r})")
                files[path] = SafetensorsFile(path)
                for name in names:
                    if name not in files[path].tensors:
                        raise CheckpointError(f"{index}: tensor {name!r} is mapped to {path}, which does not "
                                              f"contain it")
            return files
        if os.path.isfile(single):
            return {single: SafetensorsFile(single)}
        raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")

    def _alias_inverse_scales(self) -> None:
        """FP8 block weights may name their scale `weight_scale_inv` (DeepSeek-V3 / vLLM block-FP8 convention).
        Despite the name it is the dequantization MULTIPLIER there (vLLM and DeepSeek's weight_dequant compute
        fp8 * weight_scale_inv), so we read it as `weight_scale` unchanged."""
        for name in [n for n in self._tensors if n.endswith(".weight_scale_inv")]:
            target = name[: -len("_inv")]
            if target not in self._tensors:
                self._tensors[target] = self._tensors[name]

    # ----- validation ---------------------------------------------------------------------------------------
    def expected(self) -> dict[str, TensorSpec]:
        return expected_tensors(self.config, self.quant, mtp=self.has_mtp)

    def extras(self) -> list[str]:
        """Tensors present but not used by jaxflash (besides the vision tower), e.g. the MTP mixer's injection."""
        expected = self.expected()
        return [n for n in self._tensors if n not in expected and not n.endswith("_inv")] + self.unexpected

    @property
    def has_mtp(self) -> bool:
        """Whether the MTP head is present (the text layout written by transformers drops it)."""
        return self.config.mtp_num_hidden_layers > 0 and any(n.startswith("mtp.") for n in self._tensors)

    def validate(self) -> None:
        """Raise CheckpointError listing every missing tensor and every shape or dtype mismatch."""
        problems = []
        for name, (shape, dt) in self.expected().items():
            info = self._tensors.get(name)
            if info is None:
                problems.append(f"missing tensor {full_name(name, self.prefix)!r}")
                continue
            if not _dtype_ok(dt, info.dtype):
                problems.append(f"tensor {full_name(name, self.prefix)!r} in {info.file} has dtype {info.dtype}, "
                                f"expected {dt}")
            if not _shape_ok(shape, info.shape):
                problems.append(f"tensor {full_name(name, self.prefix)!r} in {info.file} has shape "
                                f"{list(info.shape)}, expected {list(shape)}")
        if problems:
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            files = sorted(self.files) if len(self.files) <= 4 else f"{len(self.files)} shards in {self.directory}"
            raise CheckpointError(f"checkpoint {self.directory} (files: {files}; quantization from "
                                  f"{self.quant.source}) does not match its config:\n  " +
                                  "\n  ".join(problems[:20]) + more)

    def check_ple_buffers(self) -> None:
        """The I64 hash buffers of each PLE layer must equal what the config derives (docs/model.md §6.1)."""
        for k, layer in enumerate(self.config.ple_layers):
            e = f"layers.{layer}.ple.ple_embedding."
            for buf, want in (("layer_multipliers", self.config.ngram_multipliers(k)),
                              ("ngram_heads_vocab_sizes", self.config.ngram_head_vocab_sizes(k)),
                              ("ngram_heads_offsets", self.config.ngram_head_offsets(k))):
                if not self.has(e + buf):
                    continue  # validate() reports it
                got = tuple(int(v) for v in self.read(e + buf).reshape(-1))
                if got != tuple(want):
                    raise CheckpointError(f"tensor {full_name(e + buf, self.prefix)!r} in "
                                          f"{self._tensors[e + buf].file} is {list(got)}, but config.json "
                                          f"(vocab_size, seed, ngram_vocab_size_base, ...) gives {list(want)}: "
                                          f"the checkpoint and its config disagree on the n-gram hash")

    # ----- access -------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"no tensor {full_name(name, self.prefix)!r} (jaxflash name {name!r}) in "
                                  f"checkpoint {self.directory}") from None

    def location(self, name: str) -> tuple[str, int, int, str, tuple[int, ...]]:
        """(file path, absolute byte offset, nbytes, safetensors dtype, shape): for pread-ing straight from disk."""
        i = self.info(name)
        return i.file, i.offset, i.nbytes, i.dtype, i.shape

    def read(self, name: str, shape=None, dtype=None) -> np.ndarray:
        """A read-only, memory-mapped view of a tensor (copy it to keep or modify it).

        `shape` / `dtype` (numpy dtype or safetensors string), when given, are checked, not converted."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(f"tensor {full_name(name, self.prefix)!r} in {info.file} has shape "
                                  f"{list(info.shape)}, expected {list(shape)}")
        if dtype is not None:
            want = dtype if isinstance(dtype, str) else dtype_name(dtype)
            if want != info.dtype:
                raise CheckpointError(f"tensor {full_name(name, self.prefix)!r} in {info.file} has dtype "
                                      f"{info.dtype}, expected {want}")
        return self.files[info.file].array(info)

    def progress(self, names: Iterable[str], *, desc: str = "loading", disable: bool | None = None
                 ) -> Iterator[str]:
        """Wrap a per-tensor loading loop: yields the names, showing bytes read (quiet when stderr is no TTY)."""
        return progress_bytes(names, lambda n: self._tensors[n].nbytes if n in self._tensors else 0,
                              desc=desc, disable=disable)

    # ----- linear layers and experts ------------------------------------------------------------------------
    def read_linear(self, module: str) -> np.ndarray | NVFP4Weight | FP8BlockWeight | FP8Weight:
        """The weight of a linear module as its quantization config says it is stored: a dense [N, K] array
        (BF16/F16/F32 as on disk), an NVFP4Weight triple, an FP8BlockWeight or an FP8Weight."""
        scheme = self.quant.scheme(module)
        w = module + ".weight"
        if scheme is None:
            arr = self.read(w)
            if self.info(w).dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {full_name(w, self.prefix)!r} in {self.info(w).file} is "
                                      f"{self.info(w).dtype}, but {self.quant.source} does not quantize module "
                                      f"{full_name(module, self.prefix)!r}")
            return arr
        where = f"module {full_name(module, self.prefix)!r} ({scheme.algo} per {self.quant.source})"

        def get(suffix, dt):
            name = f"{module}.{suffix}"
            if not self.has(name):
                raise CheckpointError(f"{where}: tensor {full_name(name, self.prefix)!r} is missing")
            info = self.info(name)
            if not _dtype_ok(dt, info.dtype):
                raise CheckpointError(f"{where}: tensor {full_name(name, self.prefix)!r} in {info.file} has dtype "
                                      f"{info.dtype}, expected {dt}")
            return self.read(name)

        if scheme.algo in ("NVFP4", "W4A16_NVFP4"):
            q, s, s2 = get("weight", "U8"), get("weight_scale", "F8_E4M3"), get("weight_scale_2", "F32")
            if s.shape != (q.shape[0], 2 * q.shape[1] // scheme.group_size) or s2.size != 1:
                raise CheckpointError(f"{where}: inconsistent shapes weight {list(q.shape)}, weight_scale "
                                      f"{list(s.shape)}, weight_scale_2 {list(s2.shape)} in {self.info(w).file}")
            return NVFP4Weight(q, s, s2.astype(np.float32).reshape(()))
        if scheme.algo == "FP8_PB_WO":
            q, s = get("weight", "F8_E4M3"), get("weight_scale", "F32")
            if s.shape != fp8_block_scale_shape(q.shape, scheme.group_size):
                raise CheckpointError(f"{where}: weight_scale shape {list(s.shape)} does not tile weight "
                                      f"{list(q.shape)} in {scheme.group_size}-blocks ({self.info(w).file})")
            if s.size and float(np.max(s)) > 1.0:
                # A multiplier above 1 would mean weights beyond +-448: the file must hold reciprocal scales
                # (448 / amax), a convention we refuse to guess at.
                raise CheckpointError(f"{where}: tensor {self.info(module + '.weight_scale').name!r} in "
                                      f"{self.info(w).file} has block scales up to {float(np.max(s)):.4g}; "
                                      f"jaxflash expects dequantization multipliers (amax / 448, all <= 1)")
            return FP8BlockWeight(q, s.astype(np.float32), scheme.group_size)
        if scheme.algo == "FP8":
            q, s = get("weight", "F8_E4M3"), get("weight_scale", "F32")
            return FP8Weight(q, s.astype(np.float32).reshape(()))
        raise CheckpointError(f"{where}: unsupported")

    def expert_module(self, layer: int | str, e: int, proj: str) -> str:
        """jaxflash module name of a routed expert projection; `layer` is a decoder index or "mtp"."""
        if proj not in EXPERT_PROJS:
            raise ValueError(f"proj must be one of {EXPERT_PROJS}, got {proj!r}")
        if not 0 <= e < self.config.num_experts:
            raise ValueError(f"expert {e} out of range [0, {self.config.num_experts})")
        if layer == "mtp" or layer == "mtp.layers.0":
            return f"mtp.layers.0.mlp.experts.{e}.{proj}"
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.config.num_hidden_layers:
            raise ValueError(f"layer must be a decoder index in [0, {self.config.num_hidden_layers}) or 'mtp', "
                             f"got {layer!r}")
        return f"layers.{layer}.mlp.experts.{e}.{proj}"

    def read_expert(self, layer: int | str, e: int, proj: str):
        """Expert `e`'s `proj` ("gate_proj" | "up_proj" | "down_proj") of decoder `layer` (or "mtp"): a dense
        array, or NVFP4Weight(packed u8, fp8 scale, f32 scale_2), or FP8BlockWeight for the MTP experts."""
        return self.read_linear(self.expert_module(layer, e, proj))

    # ----- PLE ----------------------------------------------------------------------------------------------
    def read_ngram_table(self, ple_index: int = 0) -> NGramTable:
        """The n-gram table of PLE module `ple_index` as a lazy, memory-mapped NGramTable."""
        if not self.config.ple_layers:
            raise CheckpointError(f"{self.directory}: the config has no PLE layer")
        layer = self.config.ple_layers[ple_index]
        base = f"layers.{layer}.ple.ple_embedding.ngram_embedding"
        self.check_ple_buffers()
        parts = self.config.split_ngram_parts
        names = [f"{base}.shard_{i}.weight" for i in range(parts)]
        if not self.has(names[0]) and self.has(base + ".weight"):
            names = [base + ".weight"]  # an unsharded table (some conversions write one tensor)
        shards = []
        for n in names:
            arr = self.read(n)
            if arr.ndim != 2 or (shards and arr.shape != shards[0].shape) or arr.dtype != (
                    shards[0].dtype if shards else arr.dtype):
                raise CheckpointError(f"tensor {full_name(n, self.prefix)!r} in {self.info(n).file}: n-gram shards "
                                      f"must all have one 2-D shape and dtype, got {arr.dtype} {list(arr.shape)}")
            shards.append(arr)
        rows = shards[0].shape[0] * len(shards)
        if rows != self.config.ngram_table_rows(ple_index) or shards[0].shape[1] != self.config.ngram_head_dim:
            raise CheckpointError(f"n-gram table {full_name(base, self.prefix)!r} ({self.info(names[0]).file}) is "
                                  f"[{rows}, {shards[0].shape[1]}], config gives [{self.config.ngram_table_rows()}, "
                                  f"{self.config.ngram_head_dim}]")
        scale = None
        scheme = self.quant.scheme(base)
        if shards[0].dtype == DTYPES["F8_E4M3"] or scheme is not None:
            if scheme is None or scheme.algo != "FP8" or shards[0].dtype != DTYPES["F8_E4M3"]:
                raise CheckpointError(f"n-gram table {full_name(base, self.prefix)!r} in {self.info(names[0]).file} "
                                      f"is {dtype_name(shards[0].dtype)} but {self.quant.source} says "
                                      f"{scheme.algo if scheme else 'unquantized'}: only per-tensor FP8 is read")
            s = self.read(base + ".weight_scale")
            if s.size != 1:
                raise CheckpointError(f"tensor {full_name(base + '.weight_scale', self.prefix)!r} in "
                                      f"{self.info(base + '.weight_scale').file} must hold one global scale, "
                                      f"has shape {list(s.shape)}")
            scale = float(s.astype(np.float32).reshape(()))
        return NGramTable(shards, [self.location(n) for n in names], scale, full_name(base, self.prefix))


def _dtype_ok(expected: str, actual: str) -> bool:
    return actual == expected or (expected in FLOAT_DTYPES and actual in FLOAT_DTYPES)


def _shape_ok(expected: tuple[int, ...], actual: tuple[int, ...]) -> bool:
    return tuple(actual) == tuple(expected) or (expected == () and tuple(actual) == (1,))
