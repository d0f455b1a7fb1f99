"""Model configuration: read config.json in either published layout and validate it.

Two layouts exist (docs/model.md §2):
  * the released multimodal checkpoint: `Qwen4ExpForConditionalGeneration`, the text model's fields nested in
    `text_config`, tensors under `model.language_model.`, plus `model.visual.*` and `mtp.*`;
  * the text-only checkpoint that transformers' `Qwen4ExpForCausalLM.save_pretrained` writes: fields at the top
    level, tensors under `model.`.

`ModelConfig` is frozen and hashable, so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

# Names under which checkpoints and implementations spell the (indexed) full-attention layer type.
ATTENTION_LAYER_NAMES = frozenset(
    {"full_attention", "indexed_attention", "deepseek_sparse_attention", "hybrid_indexed", "qwen_sparse_attention"}
)
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

TEXT_PREFIX = "model."
RELEASE_PREFIX = "model.language_model."


class ConfigError(ValueError):
    """config.json is missing a field, or a field has a value this model cannot have."""


def _field_error(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config field {name!r} = {value!r}: {why}")


# ---------------------------------------------------------------------------------------------------------------
# PLE hash constants (docs/model.md §6.1). They depend only on the config, so they live here.
# ---------------------------------------------------------------------------------------------------------------
MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15


def splitmix64(v: int) -> int:
    v = (v + SPLITMIX_GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & MASK64
    return v ^ (v >> 31)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_after(start: int, count: int) -> list[int]:
    out, p = [], start
    while len(out) < count:
        p += 1
        if _is_prime(p):
            out.append(p)
    return out


@dataclass(frozen=True)
class ModelConfig:
    """The text model of qwen4_exp. Field names are config.json's; a field config.json leaves out takes
    transformers' `Qwen4ExpTextConfig` default (the real model's values are in `jaxflash.presets`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    eos_token_id: int | None  # the first eos id: drives PLE padding and EOS segments
    # attention (docs/model.md §8)
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # Gated DeltaNet (docs/model.md §7)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    output_gate_type: str = "sigmoid"
    # MoE (docs/model.md §10)
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    # gated residual (docs/model.md §5)
    hc_count: int = 4
    hc_lowrank: int = 320
    # PLE (docs/model.md §6); ple_layer_ids are 1-indexed as in config.json
    ple_layer_ids: tuple[int, ...] = ()
    ple_embed_dim: int | None = None  # None: hidden_size
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    split_ngram_parts: int = 512
    seed: int = 1234
    # QSA indexer (docs/model.md §9); all None means QSA is off
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    # MTP (docs/model.md §11)
    mtp_num_hidden_layers: int = 0
    # every id that ends generation (config's eos list); eos_token_id is its first element
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.ple_embed_dim is None:
            object.__setattr__(self, "ple_embed_dim", self.hidden_size)
        if not self.eos_token_ids and self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))

    # ----- derived sizes ------------------------------------------------------------------------------------
    @property
    def hc_hidden_size(self) -> int:  # W = S*H
        return self.hc_count * self.hidden_size

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qsa_enabled(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-based decoder indices of the PLE layers."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def num_ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        return self.ple_embed_dim // self.num_ngram_heads

    @property
    def ple_conv_dilation(self) -> int:
        return self.ngram_size

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ple_conv_dilation

    def ngram_multipliers(self, ple_index: int = 0) -> tuple[int, ...]:
        """The odd hash multipliers m_k of PLE module `ple_index` (docs/model.md §6.1)."""
        half_bound = max(1, ((1 << 63) - 1) // max(self.vocab_size, 1) // 2)
        base = self.seed + 10007 * ple_index
        return tuple(
            2 * (splitmix64((base + SPLITMIX_GAMMA * (k + 1)) & MASK64) % half_bound) + 1
            for k in range(self.ngram_size)
        )

    def ngram_head_vocab_sizes(self, ple_index: int = 0) -> tuple[int, ...]:
        """Head j of PLE module `ple_index` takes the (global head index + 1)-th prime after base - 1."""
        n = self.num_ngram_heads
        primes = _primes_after(self.ngram_vocab_size_base - 1, (ple_index + 1) * n)
        return tuple(primes[ple_index * n :])

    def ngram_head_offsets(self, ple_index: int = 0) -> tuple[int, ...]:
        sizes = self.ngram_head_vocab_sizes(ple_index)
        return tuple(sum(sizes[:j]) for j in range(len(sizes)))

    def ngram_table_rows(self, ple_index: int = 0) -> int:
        total = sum(self.ngram_head_vocab_sizes(ple_index))
        d = self.make_ngram_vocab_size_divisible_by
        return -(-total // d) * d

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ----- reading and writing ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Build from config.json's dict in either layout (see `text_fields`)."""
        return _parse_text_config(text_fields(raw))

    def to_text_config_dict(self) -> dict:
        """The text model's fields as transformers' `Qwen4ExpTextConfig` spells them."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("rope_theta", "partial_rotary_factor", "eos_token_ids"):
            d.pop(name)
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
        d["layer_types"] = list(self.layer_types)
        d["ple_layer_ids"] = list(self.ple_layer_ids)
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        }
        d["attention_bias"] = False
        return d


def text_fields(raw: dict) -> dict:
    """The text model's fields of config.json, in either layout.

    Release layout: fields nested in `text_config`; top-level values (eos ids) fill what text_config lacks.
    """
    if "text_config" in raw:
        text = raw["text_config"]
        if not isinstance(text, dict):
            raise _field_error("text_config", type(text).__name__, "must be an object")
        merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        merged.update(text)
        return merged
    return dict(raw)


def is_release_layout(raw: dict) -> bool:
    return "text_config" in raw


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers")
_INT_FIELDS = {
    f.name
    for f in dataclasses.fields(ModelConfig)
    if f.type in ("int", "int | None")
}


def _parse_text_config(d: dict) -> ModelConfig:
    for name in _REQUIRED:
        if name not in d:
            raise ConfigError(f"config field {name!r} is missing")

    kw: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in names - {"layer_types", "eos_token_id", "eos_token_ids", "ple_layer_ids"}:
        if name in d and d[name] is not None:
            kw[name] = d[name]
        elif name in d and name.startswith("indexer_"):
            kw[name] = None  # an explicit null switches QSA off
    # QSA fields absent altogether also mean QSA off (the reference's default).
    if not any(k in d for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                                "indexer_compress_ratio")):
        for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                  "indexer_compress_ratio"):
            kw[k] = None

    for name in _INT_FIELDS:
        v = kw.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise _field_error(name, v, "must be an integer")

    # rope: transformers 5 writes rope_parameters; older configs put rope_theta at the top level
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _field_error("rope_parameters", rope, "must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _field_error("rope_parameters.rope_type", rope_type, "only 'default' RoPE is supported")
    kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 1e7)))
    kw["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))

    n_layers = d["num_hidden_layers"]
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise _field_error("num_hidden_layers", n_layers, "must be a positive integer")
    raw_types = d.get("layer_types")
    if raw_types is None:
        interval = d.get("full_attention_interval", 4)
        raw_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n_layers)]
    if not isinstance(raw_types, list) or len(raw_types) != n_layers:
        raise _field_error("layer_types", raw_types, f"must be a list of num_hidden_layers={n_layers} entries")
    types = []
    for i, t in enumerate(raw_types):
        if t == LINEAR_ATTENTION:
            types.append(LINEAR_ATTENTION)
        elif t in ATTENTION_LAYER_NAMES:
            types.append(FULL_ATTENTION)
        else:
            raise _field_error(f"layer_types[{i}]", t,
                               f"unsupported layer type; expected {LINEAR_ATTENTION!r} or one of "
                               f"{sorted(ATTENTION_LAYER_NAMES)}")
    kw["layer_types"] = tuple(types)

    ple_ids = d.get("ple_layer_ids")
    kw["ple_layer_ids"] = tuple(sorted(set(ple_ids))) if ple_ids else ()
    if d.get("ple_embed_dim") is None:
        kw["ple_embed_dim"] = d["hidden_size"]
    if d.get("output_gate_type") is None:
        kw["output_gate_type"] = d.get("hidden_act", "silu")

    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        if not all(isinstance(e, int) for e in eos):
            raise _field_error("eos_token_id", eos, "must be an integer or a list of integers")
        kw["eos_token_ids"] = tuple(eos)
        kw["eos_token_id"] = eos[0] if eos else None
    elif isinstance(eos, int) and not isinstance(eos, bool):
        kw["eos_token_ids"] = (eos,)
        kw["eos_token_id"] = eos
    elif eos is None:
        kw["eos_token_ids"] = ()
        kw["eos_token_id"] = None
    else:
        raise _field_error("eos_token_id", eos, "must be an integer or a list of integers")

    cfg = ModelConfig(**kw)
    validate(cfg)
    return cfg


def validate(c: ModelConfig) -> None:
    """The invariants the reference config checks, plus those this implementation relies on."""

    def positive(*names):
        for n in names:
            v = getattr(c, n)
            if not isinstance(v, int) or v <= 0:
                raise _field_error(n, v, "must be a positive integer")

    positive("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "moe_intermediate_size",
             "shared_expert_intermediate_size", "hc_lowrank")
    if c.output_gate_type not in ("sigmoid", "silu"):
        raise _field_error("output_gate_type", c.output_gate_type, "must be 'sigmoid' or 'silu'")
    if c.hidden_act != "silu":
        raise _field_error("hidden_act", c.hidden_act, "only 'silu' is supported")
    if c.hc_count <= 1:
        raise _field_error("hc_count", c.hc_count, "must be > 1")
    if not 0 < c.num_experts_per_tok <= c.num_experts:
        raise _field_error("num_experts_per_tok", c.num_experts_per_tok,
                           f"must be in [1, num_experts={c.num_experts}]")
    if c.num_attention_heads % c.num_key_value_heads:
        raise _field_error("num_key_value_heads", c.num_key_value_heads,
                           f"must divide num_attention_heads={c.num_attention_heads}")
    if c.linear_num_value_heads % c.linear_num_key_heads:
        raise _field_error("linear_num_key_heads", c.linear_num_key_heads,
                           f"must divide linear_num_value_heads={c.linear_num_value_heads}")
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise _field_error("rope_parameters.partial_rotary_factor", c.partial_rotary_factor,
                           f"gives rotary_dim={c.rotary_dim}, which must be even and in (0, head_dim={c.head_dim}]")
    if c.tie_word_embeddings:
        raise _field_error("tie_word_embeddings", True, "qwen4_exp has an untied lm_head")
    if c.mtp_num_hidden_layers not in (0, 1):
        raise _field_error("mtp_num_hidden_layers", c.mtp_num_hidden_layers, "only 0 or 1 MTP layer is supported")

    qsa = {n: getattr(c, n) for n in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim",
                                       "indexer_budget", "indexer_compress_ratio")}
    if any(v is not None for v in qsa.values()):
        missing = [n for n, v in qsa.items() if v is None]
        if missing:
            raise ConfigError(f"QSA config is incomplete: fields {missing} are missing (set: "
                              f"{ {n: v for n, v in qsa.items() if v is not None} })")
        for n, v in qsa.items():
            if v <= 0:
                raise _field_error(n, v, "must be positive")
        if c.indexer_kv_heads != 1:
            raise _field_error("indexer_kv_heads", c.indexer_kv_heads, "qwen4_exp QSA requires exactly 1")
        if c.indexer_budget % c.indexer_compress_ratio:
            raise _field_error("indexer_budget", c.indexer_budget,
                               f"must be divisible by indexer_compress_ratio={c.indexer_compress_ratio}")
        if c.rotary_dim > c.indexer_head_dim:
            raise _field_error("indexer_head_dim", c.indexer_head_dim,
                               f"must be >= the attention rotary_dim={c.rotary_dim}")

    if c.ple_layer_ids:
        heads = c.num_ngram_heads
        if heads <= 0 or c.ple_embed_dim <= 0 or c.ple_embed_dim % heads:
            raise _field_error("ple_embed_dim", c.ple_embed_dim,
                               f"must be a positive multiple of the n-gram head count {heads} "
                               f"((ngram_size-1)*heads_per_ngram)")
        bad = [i for i in c.ple_layer_ids if not 1 <= i <= c.num_hidden_layers]
        if bad:
            raise _field_error("ple_layer_ids", list(c.ple_layer_ids),
                               f"ids are 1-indexed and must lie in [1, {c.num_hidden_layers}]; bad: {bad}")
        not_linear = [i for i in c.ple_layer_ids if c.layer_types[i - 1] != LINEAR_ATTENTION]
        if not_linear:
            raise _field_error("ple_layer_ids", list(c.ple_layer_ids),
                               f"PLE is only supported on linear_attention layers; layers {not_linear} are not")
        if len(c.ple_layer_ids) != 1:
            raise _field_error("ple_layer_ids", list(c.ple_layer_ids), "exactly one PLE layer is supported")
        if c.eos_token_id is None:
            raise _field_error("eos_token_id", None, "must be set when PLE layers are enabled")
        positive("ple_conv_kernel_size", "make_ngram_vocab_size_divisible_by", "split_ngram_parts")
        if c.ngram_size != 3:
            raise _field_error("ngram_size", c.ngram_size, "only trigram PLE (ngram_size=3) is supported")
    if c.eos_token_id is not None and not 0 <= c.eos_token_id < c.vocab_size:
        raise _field_error("eos_token_id", c.eos_token_id, f"must be a token id in [0, vocab_size={c.vocab_size})")


def read_config_json(path: str | os.PathLike) -> dict:
    """config.json of a checkpoint directory (or the file itself) as a dict, with a clear error if unreadable."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    return raw


def load_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig of a checkpoint directory or config.json file."""
    raw = read_config_json(path)
    try:
        return ModelConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
