"""Seeded random-weight qwen4_exp checkpoints in the real published layouts (for tests, benchmarks, the bundled model).

`write_checkpoint` writes exactly the tensors `jaxflash.checkpoint.expected_tensors` lists, in one of:
  * "release" + bf16:  `Qwen4ExpForConditionalGeneration` config (text_config + a tiny vision_config), tensors under
    `model.language_model.`, a few `model.visual.*` tensors, `mtp.*`, the n-gram table as BF16 shards;
  * "release" + nvfp4: NVIDIA's ModelOpt MIXED_PRECISION layout (docs/model.md §12): routed experts NVFP4, the
    n-gram table FP8 shards + one global scale, MTP experts FP8 128x128 blocks, everything else BF16;
  * "text": what transformers' `Qwen4ExpForCausalLM.save_pretrained` writes (prefix `model.`, no vision, no MTP).

Memory stays bounded whatever the size: the tensor list is known before any data exists, so each shard's header is
written first and the data is streamed piece by piece (a piece is one small tensor, one quantized module, or a row
chunk of a large tensor), generated on a thread pool with a cap on the bytes in flight. Every piece draws from its
own RNG, seeded by (seed, tensor name, chunk index), so the bytes do not depend on sharding, threads or layout,
and the bf16 and nvfp4 checkpoints of one seed hold the same underlying weights.

Weight scales (see `_init`) keep activations realistic through all 48 layers: hyper-connections normalise each
block's input, so the residual stream only grows by what the blocks inject. Input-side projections use
1/sqrt(fan_in); each block's output projection is scaled so that the block adds roughly BLOCK_OUT_RMS to a
residual stream of RMS ~1 (the embedding), so after 2 x 48 injections the stream RMS stays O(1)
(sqrt(1 + 96 * 0.1^2) ~ 1.4). The gains were calibrated against transformers' reference model; see
tests/test_make_model.py and `activation_report`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from . import presets
from .checkpoint import (DTYPES, RELEASE_PREFIX, TEXT_PREFIX, Checkpoint, CheckpointError, QuantConfig,
                         QuantScheme, SafetensorsWriter, TensorSpec, expected_tensors, full_name)
from .config import FULL_ATTENTION, ModelConfig
from .quant import (FP8_BLOCK, FP8_E4M3_MAX, quantize_fp8_block, quantize_fp8_per_tensor, quantize_nvfp4,
                    synthetic_input_scale)

TRANSFORMERS_VERSION = "5.23.0"  # the reference these files were checked against

# ---------------------------------------------------------------------------------------------------------------
# Weight scales. Activations: the embedding has RMS ~1; hyper-connections feed each block an RMS-normalised,
# sigmoid-gated mix (per-element RMS ~0.5); each block's output should add ~BLOCK_OUT_RMS to the residual.
# ---------------------------------------------------------------------------------------------------------------
EMBED_STD = 1.0
NORM_W_STD = 0.05  # (1 + w) norms: w ~ N(0, 0.05); RMSNormGated: 1 + N(0, 0.05)
HC_DOWN_GAIN = 2.0  # silu((xn @ Wd^T) / 4) then has pre-activations of RMS ~0.5
HC_UP_GAIN = 2.0  # sigmoid gates spread over ~(0.2, 0.8)
HC_INJECT_GAIN = 1.0  # inj = 2 sigmoid(N(0, 0.25^2)) ~ 1 +- 0.12
BLOCK_OUT_RMS = 0.1  # the target the gains below were tuned to (documentation; not read by code)
# Output-projection gains, calibrated with transformers (full widths, 8 layers, 64 tokens) so each block adds
# ~BLOCK_OUT_RMS: measured GDN 0.10, MoE 0.10, attention 0.08 (it averages over the context), PLE 0.15. Over 48
# full-width layers the residual RMS then goes 1.0 -> 1.5 and the logits' std is 3.0 (see the module docstring).
ATTN_OUT_GAIN = 1.0
GDN_OUT_GAIN = 0.22
MOE_OUT_GAIN = 1.0
ROUTER_GAIN = 4.0  # router logits of RMS ~2: peaked but not one-hot top-k weights
LM_HEAD_GAIN = 6.0  # logits RMS ~3 for the mixer's RMS ~0.5 output
GDN_CONV_STD = 0.5
A_RANGE = (1.0, 16.0)  # A = exp(A_log) ~ U(1, 16)
DT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) ~ log-uniform over this range (Mamba's dt init)
NGRAM_STD = 0.015  # the released FP8 table's scale 0.000199 implies |x| <= 0.089 ~ 6 sigma of 0.015
NGRAM_CLIP = 6 * NGRAM_STD  # values are clipped here so the FP8 table's global scale is known before streaming
PLE_VALUE_RMS = 0.2  # the value PLE adds to every stream
PLE_CONV_STD = 0.1

CHUNK_ELEMS = 1 << 23  # large tensors are generated in row chunks of about this many elements (32 MiB in f32)


def _rng(seed: int, name: str, chunk: int = 0) -> np.random.Generator:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    words = [int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")]
    return np.random.default_rng(np.random.SeedSequence([seed, *words, chunk]))


def _normal(rng: np.random.Generator, shape, std: float, mean: float = 0.0) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    if mean:
        x += np.float32(mean)
    return x


def _init(name: str, shape: tuple[int, ...], c: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    """float32 values of text-model tensor `name` (jaxflash naming). Every rule is deliberate: an unknown tensor
    is an error, so a new tensor gets a considered scale."""
    H = c.hidden_size
    leaf = name.rsplit(".", 2)
    last = name.split(".")[-1]
    fan_in = shape[-1] if len(shape) >= 2 else 1

    def std(s):
        return _normal(rng, shape, s)

    if name == "embed_tokens.weight":
        return std(EMBED_STD)
    if name == "lm_head.weight":
        return std(LM_HEAD_GAIN / math.sqrt(H))
    if ".ngram_embedding." in name:
        return np.clip(std(NGRAM_STD), -NGRAM_CLIP, NGRAM_CLIP)
    if last == "A_log":
        return np.log(rng.uniform(*A_RANGE, size=shape)).astype(np.float32)
    if last == "dt_bias":
        dt = np.exp(rng.uniform(np.log(DT_RANGE[0]), np.log(DT_RANGE[1]), size=shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # inverse softplus
    if name.endswith("linear_attn.norm.weight"):
        return _normal(rng, shape, NORM_W_STD, mean=1.0)  # RMSNormGated multiplies by w, not 1 + w
    if last == "weight" and len(shape) == 1:
        return std(NORM_W_STD)  # every other 1-D weight is a zero-centred (1 + w) norm
    if name.endswith("linear_attn.conv1d.weight"):
        return std(GDN_CONV_STD)
    if name.endswith("ple.conv1d.weight"):
        return std(PLE_CONV_STD)
    if len(shape) != 2 or last != "weight":
        raise ValueError(f"synthetic init has no rule for tensor {name!r} {shape}")
    module = leaf[-2] if len(leaf) >= 2 else ""
    if module == "input_mix_weight_down":
        return std(HC_DOWN_GAIN / math.sqrt(fan_in))
    if module == "input_mix_weight_up":
        return std(HC_UP_GAIN / math.sqrt(fan_in))
    if module == "block_inject_weight":
        return std(HC_INJECT_GAIN / math.sqrt(fan_in))
    if name.endswith("self_attn.o_proj.weight"):
        return std(ATTN_OUT_GAIN / math.sqrt(fan_in))
    if name.endswith("linear_attn.out_proj.weight"):
        return std(GDN_OUT_GAIN / math.sqrt(fan_in))
    if module == "down_proj":
        return std(MOE_OUT_GAIN / math.sqrt(fan_in))
    if name.endswith("mlp.gate.weight"):
        return std(ROUTER_GAIN / math.sqrt(fan_in))
    if name.endswith("ple.value_proj.weight"):
        return std(PLE_VALUE_RMS / (NGRAM_STD * math.sqrt(fan_in)))
    return std(1.0 / math.sqrt(fan_in))  # input-side projections preserve the RMS of their input


def _init_vision(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith(".bias"):
        return _normal(rng, shape, 0.02)
    if "norm" in name:
        return _normal(rng, shape, NORM_W_STD, mean=1.0)  # LayerNorm weights multiply by w
    if name.endswith("pos_embed.weight"):
        return _normal(rng, shape, 0.02)
    return _normal(rng, shape, 1.0 / math.sqrt(math.prod(shape[1:])))


def ple_buffer(name: str, c: ModelConfig, ple_index: int = 0) -> np.ndarray:
    """The three I64 hash buffers of a PLE layer, derived from the config (docs/model.md §6.1)."""
    last = name.split(".")[-1]
    values = {"layer_multipliers": c.ngram_multipliers, "ngram_heads_vocab_sizes": c.ngram_head_vocab_sizes,
              "ngram_heads_offsets": c.ngram_head_offsets}[last](ple_index)
    return np.array(values, dtype=np.int64)


# ---------------------------------------------------------------------------------------------------------------
# Configs written beside the weights
# ---------------------------------------------------------------------------------------------------------------
SPECIAL_TOKENS = [  # (content, special): special=False tokens survive decode(skip_special_tokens=True)
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
]
TOKEN_IDS = {tok: i for i, (tok, _) in enumerate(SPECIAL_TOKENS)}  # ids of the tiny/small tokenizer
FULL_VISION_IDS = {"vision_start_token_id": 248053, "vision_end_token_id": 248054, "image_token_id": 248056,
                   "video_token_id": 248057}  # transformers' Qwen4ExpConfig defaults


def release_quant_config(c: ModelConfig) -> QuantConfig:
    """NVIDIA's NVFP4 MIXED_PRECISION config (docs/model.md §12): NVFP4 routed experts, FP8 n-gram table, FP8_PB_WO MTP
    experts; every other linear is listed in `ignore` and stays BF16."""
    P = RELEASE_PREFIX
    layers = {f"{P}layers.{i}.mlp.experts": QuantScheme("NVFP4", 16) for i in range(c.num_hidden_layers)}
    for i in c.ple_layers:
        layers[f"{P}layers.{i}.ple.ple_embedding.ngram_embedding"] = QuantScheme("FP8", 0)
    if c.mtp_num_hidden_layers:
        layers["mtp.layers.0.mlp.experts"] = QuantScheme("FP8_PB_WO", FP8_BLOCK)
    ignore = ["lm_head", f"{P}embed_tokens", f"{P}layers.*.self_attn*", f"{P}layers.*.linear_attn*",
              f"{P}layers.*.mlp.gate", f"{P}layers.*.mlp.shared_expert*", f"{P}layers.*_hyper_connection*",
              f"{P}hyper_connection_mixer*", f"{P}layers.*.ple.key_proj", f"{P}layers.*.ple.value_proj",
              "mtp.fc_*", "mtp.layers.0.self_attn*", "mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert*",
              "mtp.layers.0.*_hyper_connection*", "mtp.hyper_connection_mixer*", "model.visual*"]
    return QuantConfig("MIXED_PRECISION", None, tuple(ignore), layers, None, P, "<synthetic>")


def vision_config_dict(c: ModelConfig) -> dict:
    """A tiny vision tower: present so the release layout is complete; jaxflash never reads it."""
    return {"model_type": "qwen4_exp_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "out_hidden_size": c.hidden_size, "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.02}


def vision_tensors(vc: dict) -> dict[str, TensorSpec]:
    """`model.visual.*` tensors of transformers' Qwen4ExpVisionModel for config `vc` (on-disk names)."""
    d, i, ph, pt = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], vc["temporal_patch_size"]
    m = d * vc["spatial_merge_size"] ** 2
    t = {"patch_embed.proj.weight": (d, vc["in_channels"], pt, ph, ph), "patch_embed.proj.bias": (d,),
         "pos_embed.weight": (vc["num_position_embeddings"], d)}
    for b in range(vc["depth"]):
        p = f"blocks.{b}."
        t.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "norm2.weight": (d,), p + "norm2.bias": (d,),
                  p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                  p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
                  p + "mlp.linear_fc1.weight": (i, d), p + "mlp.linear_fc1.bias": (i,),
                  p + "mlp.linear_fc2.weight": (d, i), p + "mlp.linear_fc2.bias": (d,)})
    t.update({"merger.norm.weight": (d,), "merger.norm.bias": (d,), "merger.linear_fc1.weight": (m, m),
              "merger.linear_fc1.bias": (m,), "merger.linear_fc2.weight": (vc["out_hidden_size"], m),
              "merger.linear_fc2.bias": (vc["out_hidden_size"],)})
    return {"model.visual." + k: TensorSpec(v, "BF16") for k, v in t.items()}


def text_config_dict(c: ModelConfig, layout: str) -> dict:
    d = c.to_text_config_dict()
    d["model_type"] = "qwen4_exp_text"
    if d.get("seed") == 1234:
        del d["seed"]  # the released config.json leaves the hash seed at its default (docs/model.md §1)
    if layout == "release":
        # The released config spells the indexed attention layers "full_attention" (transformers maps them).
        d["layer_types"] = ["full_attention" if t == FULL_ATTENTION else t for t in c.layer_types]
    else:
        d["layer_types"] = ["indexed_attention" if t == FULL_ATTENTION else t for t in c.layer_types]
    d["dtype"] = "bfloat16"
    return d


def config_json(c: ModelConfig, layout: str, quant: QuantConfig | None, vision: dict | None,
                with_tokenizer: bool) -> dict:
    if layout == "text":
        return {"architectures": ["Qwen4ExpForCausalLM"], **text_config_dict(c, layout),
                "transformers_version": TRANSFORMERS_VERSION}
    ids = ({k: TOKEN_IDS[t] for k, t in (("vision_start_token_id", "<|vision_start|>"),
                                          ("vision_end_token_id", "<|vision_end|>"),
                                          ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
           if with_tokenizer else dict(FULL_VISION_IDS))
    d = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
         "text_config": text_config_dict(c, layout), "vision_config": vision, **ids,
         "tie_word_embeddings": False, "transformers_version": TRANSFORMERS_VERSION}
    if quant is not None and quant.is_quantized:
        d["quantization_config"] = quant.to_dict()
    return d


def generation_config_json(c: ModelConfig) -> dict:
    """Qwen's sampling defaults; generation ends at any of the config's eos ids."""
    return {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": c.bos_token_id,
            "eos_token_id": list(c.eos_token_ids), "pad_token_id": c.eos_token_id,
            "transformers_version": TRANSFORMERS_VERSION}


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer (tiny and small presets)
# ---------------------------------------------------------------------------------------------------------------
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model is trained on a small amount of text, and a
tokenizer learns which pieces of words appear together most often. Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
10, 42, 100 and 2048 appear in code and prose alike. The engine reads the weights from the checkpoint, copies
the experts to the host, and keeps a cache of the experts that the router chooses most often on the device.
When the user asks a question, the assistant thinks about the answer, calls a tool if it needs more information,
reads the tool response, and then writes a short and helpful reply. The weather in Paris is sunny today, with a
temperature of 21 degrees; tomorrow it will rain in the morning and clear up in the evening.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {}}}
Once upon a time there was a little village at the edge of a great forest. The people of the village were
farmers and weavers, and every evening they gathered around the fire to tell stories about the old days.
Mathematics is the study of numbers, shapes and patterns: the sum of the angles of a triangle is 180 degrees,
and the square of the hypotenuse equals the sum of the squares of the other two sides.
"""


def build_tokenizer(vocab_size: int, corpus: list[str] | None = None):
    """A byte-level BPE `tokenizers.Tokenizer` with Qwen's chat special tokens at ids 0..12 and at most
    `vocab_size` tokens. Trained on a small built-in text (deterministic), or on `corpus`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or _CORPUS.splitlines(keepends=True), trainer)
    # The trainer marks every token it was given special; the markup (<think>, <tool_call>, ...) is ordinary
    # output text, as tokenizer_config.json says, so tokenizer.json must say so too (grammars name it as text,
    # decoding that skips special tokens keeps it). Matching it as one token in text is unchanged.
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        t["special"] = dict(SPECIAL_TOKENS)[t["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    for t, _ in SPECIAL_TOKENS:
        assert tok.token_to_id(t) == TOKEN_IDS[t], t
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size {vocab_size}")
    return tok


# Qwen-style ChatML. Tools are announced in the system turn; assistant tool calls are JSON objects inside
# <tool_call> tags; tool results come back as a user turn of <tool_response> blocks; reasoning is kept (inside
# <think>) only for assistant turns after the last real user message, and `enable_thinking=false` pre-fills an
# empty think block.
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- elif content is not none -%}{{- content -}}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' and not text(m.content).startswith('<tool_response>') -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) -}}{%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}{{- '\n\n' -}}{%- endif -%}
        {{- '# Tools\n\nFunctions you can call are listed below, one JSON signature per line, ' -}}
        {{- 'between <tools> and </tools>:\n<tools>' -}}
        {%- for tool in tools -%}
            {{- '\n' + ((tool.function if tool.function is defined else tool) | tojson) -}}
        {%- endfor -%}
        {{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments ' -}}
        {{- 'between <tool_call> and </tool_call>:\n' -}}
        {{- '<tool_call>\n{"name": "function-name", "arguments": {"argument": "value"}}\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'system' and loop.first -%}
    {%- elif m.role == 'user' or m.role == 'system' -%}
        {{- '<|im_start|>' + m.role + '\n' + text(m.content) + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set body = text(m.content) -%}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
        {%- if '</think>' in body -%}
            {%- set reasoning = reasoning or body.split('</think>')[0].split('<think>')[-1] -%}
            {%- set body = body.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set body = body.strip() -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user and reasoning.strip() -%}
            {{- '<think>\n' + reasoning.strip() + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- body -}}
        {%- for call in (m.tool_calls or []) -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if body or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""


def tokenizer_config_json(c: ModelConfig) -> dict:
    added = {str(TOKEN_IDS[t]): {"content": t, "special": s, "normalized": False, "lstrip": False,
                                 "rstrip": False, "single_word": False} for t, s in SPECIAL_TOKENS}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
            "model_max_length": c.max_position_embeddings, "added_tokens_decoder": added,
            "chat_template": CHAT_TEMPLATE}


# ---------------------------------------------------------------------------------------------------------------
# Planning: pieces of work, grouped into shards
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Piece:
    """Produces the bytes of consecutive tensors (or of a row chunk of one tensor), in file order."""

    names: tuple[str, ...]  # on-disk names, one per array `run` returns
    nbytes: int
    run: Callable[[], list[np.ndarray]]


@dataclass
class _Unit:
    """Tensors that must share a shard: one tensor, or all parts of one quantized module."""

    entries: list[tuple[str, str, tuple[int, ...]]]  # (on-disk name, dtype, shape)
    pieces: list[_Piece]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in self.entries)


def _cast(x: np.ndarray, dt: str) -> np.ndarray:
    return x.astype(DTYPES[dt])


def _as_bf16_f32(x: np.ndarray) -> np.ndarray:
    """What a BF16 model holds: quantization starts from the bf16-rounded weights, as ModelOpt's does."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _plan_units(c: ModelConfig, quant: QuantConfig, seed: int, prefix: str, mtp: bool,
                vision: dict | None) -> list[_Unit]:
    specs = expected_tensors(c, quant, mtp=mtp)
    ple_of_layer = {layer: k for k, layer in enumerate(c.ple_layers)}
    units: list[_Unit] = []
    done: set[str] = set()
    names = list(specs)
    for idx, name in enumerate(names):
        if name in done:
            continue
        shape, dt = specs[name]
        disk = full_name(name, prefix)
        module = name.rsplit(".", 1)[0]
        scheme = quant.scheme(module) if name.endswith(".weight") else None
        if ".ngram_embedding." in name:
            scheme = None  # the table is handled per shard below (its FP8 scale is one global tensor)

        if scheme is not None and scheme.algo in ("NVFP4", "FP8_PB_WO"):
            parts = [n for n in names[idx:idx + 4] if n.rsplit(".", 1)[0] == module]
            done.update(parts)
            out_f, in_f = specs[module + ".weight"].shape[0], (
                specs[module + ".weight"].shape[1] * (2 if scheme.algo == "NVFP4" else 1))
            entries = [(full_name(n, prefix), specs[n].dtype, specs[n].shape) for n in parts]

            def run(name=name, shape=(out_f, in_f), scheme=scheme, parts=parts):
                w = _as_bf16_f32(_init(name, shape, c, _rng(seed, name)))
                if scheme.algo == "NVFP4":
                    q = quantize_nvfp4(w, scheme.group_size)
                    got = {"weight": q.weight, "weight_scale": q.weight_scale,
                           "weight_scale_2": q.weight_scale_2, "input_scale": q.input_scale}
                else:
                    qw, s = quantize_fp8_block(w, scheme.group_size)
                    got = {"weight": qw, "weight_scale": s}
                return [got[n.rsplit(".", 1)[1]] for n in parts]

            units.append(_Unit(entries, [_Piece(tuple(e[0] for e in entries),
                                                sum(math.prod(s) * DTYPES[d].itemsize for _, d, s in entries), run)]))
            continue
        if scheme is not None:
            raise CheckpointError(f"the synthetic writer does not produce {scheme.algo} for {module!r}")

        done.add(name)
        if name.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            layer = int(name.split(".")[1])
            arr = ple_buffer(name, c, ple_of_layer[layer])
            units.append(_Unit([(disk, dt, shape)], [_Piece((disk,), arr.nbytes, lambda arr=arr: [arr])]))
            continue
        if name.endswith("ngram_embedding.weight_scale"):  # the FP8 table's one global scale
            s = np.asarray(np.float32(NGRAM_CLIP) / np.float32(FP8_E4M3_MAX), np.float32)
            units.append(_Unit([(disk, dt, shape)], [_Piece((disk,), 4, lambda s=s: [s])]))
            continue
        units.append(_dense_unit(name, disk, shape, dt, c, seed, _init))
    if vision:
        for disk, (shape, dt) in vision_tensors(vision).items():
            units.append(_dense_unit(disk, disk, shape, dt, c, seed, lambda n, s, _c, r: _init_vision(n, s, r)))
    return units


def _dense_unit(name, disk, shape, dt, c, seed, init) -> _Unit:
    """One tensor, generated in row chunks when large; FP8 tensors (the n-gram table) use the fixed global scale."""
    rows = shape[0] if shape else 1
    row_elems = math.prod(shape[1:]) if len(shape) > 1 else 1
    chunk_rows = max(1, CHUNK_ELEMS // max(row_elems, 1)) if len(shape) > 1 else rows
    itemsize = DTYPES[dt].itemsize
    pieces = []
    for k, r0 in enumerate(range(0, max(rows, 1), chunk_rows)):
        r1 = min(rows, r0 + chunk_rows)
        sub = (r1 - r0, *shape[1:]) if shape else ()

        def run(k=k, sub=sub):
            x = init(name, sub, c, _rng(seed, name, k))
            if dt == "F8_E4M3":
                return [quantize_fp8_per_tensor(x, np.float32(NGRAM_CLIP) / np.float32(FP8_E4M3_MAX))[0]]
            return [_cast(x, dt)]

        pieces.append(_Piece((disk,), math.prod(sub) * itemsize, run))
    return _Unit([(disk, dt, tuple(shape))], pieces)


def _shards(units: list[_Unit], max_bytes: int) -> list[list[_Unit]]:
    shards, cur, size = [], [], 0
    for u in units:
        if cur and size + u.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += u.nbytes
    if cur:
        shards.append(cur)
    return shards


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------
def write_checkpoint(out: str, config: ModelConfig, *, quant: str = "bf16", seed: int = 0, layout: str = "release",
                     shard_bytes: int = 4 << 30, threads: int | None = None, tokenizer: bool | None = None,
                     mtp: bool | None = None, progress: bool | None = None, inflight_bytes: int = 512 << 20) -> str:
    """Write a random-weight checkpoint of `config` to directory `out` and return `out`.

    quant: "bf16" | "nvfp4" (nvfp4 needs layout "release"). layout: "release" | "text". tokenizer: write
    tokenizer.json + tokenizer_config.json (default: when vocab_size <= 4096). mtp: write `mtp.*` (default: release
    layout and config.mtp_num_hidden_layers > 0). progress: None shows a bar when stderr is a terminal.
    """
    if quant not in ("bf16", "nvfp4"):
        raise ValueError(f"quant must be 'bf16' or 'nvfp4', got {quant!r}")
    if layout not in ("release", "text"):
        raise ValueError(f"layout must be 'release' or 'text', got {layout!r}")
    if quant == "nvfp4" and layout != "release":
        raise ValueError("the NVFP4 checkpoint exists only in the release layout")
    c = config
    with_tok = c.vocab_size <= 4096 if tokenizer is None else tokenizer
    mtp = (layout == "release" and c.mtp_num_hidden_layers > 0) if mtp is None else mtp
    prefix = RELEASE_PREFIX if layout == "release" else TEXT_PREFIX
    qcfg = release_quant_config(c) if quant == "nvfp4" else QuantConfig(prefix=prefix)
    vision = vision_config_dict(c) if layout == "release" else None
    os.makedirs(out, exist_ok=True)

    def dump(fname, obj):
        with open(os.path.join(out, fname), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    if with_tok:
        tok = build_tokenizer(c.vocab_size)
        tok.save(os.path.join(out, "tokenizer.json"))
        dump("tokenizer_config.json", tokenizer_config_json(c))
        ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}
        if c.eos_token_id != ids["<|endoftext|>"] or not set(c.eos_token_ids) <= set(TOKEN_IDS.values()):
            raise ValueError(f"eos ids {c.eos_token_ids} are not special tokens of the synthetic tokenizer {ids}; "
                             f"use jaxflash.synthetic.make_config")
    dump("config.json", config_json(c, layout, qcfg, vision, with_tok))
    dump("generation_config.json", generation_config_json(c))
    if quant == "nvfp4":
        dump("hf_quant_config.json", qcfg.to_legacy_dict())

    units = _plan_units(c, qcfg, seed, prefix, mtp, vision)
    shards = _shards(units, shard_bytes)
    n = len(shards)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(u.nbytes for u in units)
    if n > 1:
        dump("model.safetensors.index.json", {
            "metadata": {"total_size": total},
            "weight_map": {e[0]: fnames[i] for i, shard in enumerate(shards) for u in shard for e in u.entries}})
    _stream(out, fnames, shards, total, threads, inflight_bytes, progress)
    return out


def _stream(out, fnames, shards, total, threads, inflight_bytes, progress) -> None:
    """Generate pieces on a thread pool (bounded bytes in flight) and write them in file order."""
    from tqdm.auto import tqdm

    threads = threads or min(16, os.cpu_count() or 1)
    jobs = [(i, p) for i, shard in enumerate(shards) for u in shard for p in u.pieces]
    with ThreadPoolExecutor(threads) as pool, tqdm(total=total, desc="writing", unit="B", unit_scale=True,
                                                   unit_divisor=1024, disable=None if progress is None else
                                                   not progress, dynamic_ncols=True) as bar:
        pending: deque = deque()
        inflight, nxt, writer, cur = 0, 0, None, -1
        while nxt < len(jobs) or pending:
            while nxt < len(jobs) and (not pending or (inflight < inflight_bytes and len(pending) < 4 * threads)):
                shard, piece = jobs[nxt]
                pending.append((shard, piece, pool.submit(piece.run)))
                inflight += piece.nbytes
                nxt += 1
            shard, piece, fut = pending.popleft()
            arrays = fut.result()
            if shard != cur:
                if writer is not None:
                    writer.close()
                cur = shard
                entries = [e for u in shards[shard] for e in u.entries]
                writer = SafetensorsWriter(os.path.join(out, fnames[shard]), entries, {"format": "pt"})
            for name, arr in zip(piece.names, arrays):
                writer.write(name, arr)
            inflight -= piece.nbytes
            bar.update(piece.nbytes)
        if writer is not None:
            writer.close()


# ---------------------------------------------------------------------------------------------------------------
# Presets and the CLI's entry point
# ---------------------------------------------------------------------------------------------------------------
def _writes_tokenizer(preset: str, tokenizer: bool | None) -> bool:
    """The synthetic tokenizer by default for tiny and small; the full preset keeps the published ids."""
    return preset != "full" if tokenizer is None else tokenizer


def make_config(preset: str, *, ngram_rows_scale: float = 1.0, num_layers: int | None = None,
                tokenizer: bool | None = None) -> ModelConfig:
    """The preset's config with eos ids that are special tokens of the synthetic tokenizer (tokenizer: default
    for tiny and small; the full preset keeps the published ids unless asked), and the n-gram table optionally
    shrunk: `ngram_rows_scale` scales `ngram_vocab_size_base`, so config.json, the table
    and the three PLE hash buffers stay consistent (the hash then uses the smaller primes). num_layers: keep the
    first decoder layers only (the 3:1 GDN/attention pattern and the PLE layer stay), e.g. to fit a
    full-width checkpoint on a small disk."""
    c = presets.preset(preset)
    tokenizer = _writes_tokenizer(preset, tokenizer)
    if num_layers is not None:
        need = max(c.ple_layer_ids, default=1)
        if not need <= num_layers <= c.num_hidden_layers:
            raise ValueError(f"num_layers must be in [{need}, {c.num_hidden_layers}] for preset {preset!r} (the "
                             f"PLE layer is decoder layer {need}), got {num_layers}")
        c = c.replace(num_hidden_layers=num_layers, layer_types=c.layer_types[:num_layers])
    if tokenizer:
        c = c.replace(eos_token_id=TOKEN_IDS["<|endoftext|>"],
                      eos_token_ids=(TOKEN_IDS["<|endoftext|>"], TOKEN_IDS["<|im_end|>"]))
    if ngram_rows_scale != 1.0:
        if not 0 < ngram_rows_scale <= 1:
            raise ValueError(f"ngram_rows_scale must be in (0, 1], got {ngram_rows_scale}")
        c = c.replace(ngram_vocab_size_base=max(c.split_ngram_parts, round(c.ngram_vocab_size_base * ngram_rows_scale)))
    if c.ngram_table_rows() % c.split_ngram_parts:
        raise ValueError(f"n-gram table rows {c.ngram_table_rows()} not divisible by {c.split_ngram_parts} parts")
    return c


def make_model(preset: str, quant: str, seed: int, out: str, *, ngram_rows_scale: float = 1.0,
               num_layers: int | None = None, shard_size_gb: float = 4.0, threads: int | None = None,
               progress: bool | None = None, tokenizer: bool | None = None) -> str:
    """tokenizer: write the synthetic tokenizer (default: tiny and small). With the full preset's vocabulary most
    ids have no token and decode to nothing, but the checkpoint can then be served and generated from."""
    tok = _writes_tokenizer(preset, tokenizer)
    c = make_config(preset, ngram_rows_scale=ngram_rows_scale, num_layers=num_layers, tokenizer=tok)
    return write_checkpoint(out, c, quant=quant, seed=seed, shard_bytes=max(1, int(shard_size_gb * (1 << 30))),
                            threads=threads, tokenizer=tok, progress=progress)


# ---------------------------------------------------------------------------------------------------------------
# transformers interop (tests and reference comparisons)
# ---------------------------------------------------------------------------------------------------------------
def hf_text_config(c: ModelConfig) -> dict:
    """kwargs for transformers' `Qwen4ExpTextConfig`."""
    d = text_config_dict(c, "text")
    d.pop("dtype")
    return d


def dequantized_state_dict(ckpt: Checkpoint, dtype=np.float32) -> dict[str, np.ndarray]:
    """The state dict of transformers' `Qwen4ExpForCausalLM` for a checkpoint of any quantization: experts
    dequantized and fused (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]),
    the n-gram table dequantized and concatenated. Materialises everything in `dtype`: for tiny/small models."""
    c = ckpt.config
    sd: dict[str, np.ndarray] = {}
    for name in ckpt.expected():
        if name.startswith("mtp.") or ".mlp.experts." in name or ".ngram_embedding." in name:
            continue
        arr = ckpt.read(name)
        sd[full_name(name, TEXT_PREFIX)] = arr.copy() if arr.dtype == np.int64 else arr.astype(dtype)
    for i in range(c.num_hidden_layers):
        def dense(e, p):
            w = ckpt.read_expert(i, e, p)
            return w.dequantize(dtype) if hasattr(w, "dequantize") else np.asarray(w, dtype)
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([dense(e, "gate_proj"), dense(e, "up_proj")]) for e in range(c.num_experts)])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack(
            [dense(e, "down_proj") for e in range(c.num_experts)])
    for k, layer in enumerate(c.ple_layers):
        table = ckpt.read_ngram_table(k)
        sd[f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"] = table.gather(
            np.arange(table.rows), dtype)
    return sd


def activation_report(model, input_ids) -> dict[str, float]:
    """RMS of the residual stream after each decoder layer and of the logits, from a transformers model
    (a diagnostic for the weight scales; needs torch)."""
    import torch

    rms = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: rms.__setitem__(
        f"layer{i}", float(out.float().pow(2).mean().sqrt()))) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        for h in hooks:
            h.remove()
    rms["logits"] = float(logits.float().pow(2).mean().sqrt())
    rms["logits_std"] = float(logits.float().std(-1).mean())
    return rms


# ---------------------------------------------------------------------------------------------------------------
# In memory: a full-size model without writing ~123 GB to disk (benchmarks)
# ---------------------------------------------------------------------------------------------------------------
NGRAM_SCALE = np.float32(NGRAM_CLIP) / np.float32(FP8_E4M3_MAX)  # the FP8 table's global scale
E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of uniformly random codes


class SyntheticSource:
    """A tensor source (`has`, `read`, see jaxflash.model.weights) that generates a seeded random model on demand,
    in NVIDIA's NVFP4 layout: what `write_checkpoint(quant="nvfp4")` would write, without the disk.

    Dense tensors follow the same initialisation rules as the writer. NVFP4 experts are NOT quantized from
    Gaussian weights (that takes an hour at full size on a few cores): their E2M1 codes are uniformly random
    bytes, their block scales 1.0, and their per-tensor scales give each projection the writer's RMS. A layer's experts are
    generated together, on several threads, when the first of them is read.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, threads: int | None = None):
        self.config, self.seed = config, seed
        self.quant = release_quant_config(config)
        self.specs = expected_tensors(config, self.quant, mtp=config.mtp_num_hidden_layers > 0)
        self.threads = threads or min(16, os.cpu_count() or 1)
        self._experts: tuple[str, dict[str, np.ndarray]] | None = None  # (module prefix, name -> stacked array)

    def has(self, name: str) -> bool:
        return name in self.specs

    def read(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise KeyError(f"synthetic model has no tensor {name!r}")
        shape, dt = self.specs[name]
        if ".mlp.experts." in name:
            return self._expert_tensor(name)
        if name.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            return ple_buffer(name, self.config, self.config.ple_layers.index(int(name.split(".")[1])))
        if name.endswith(".input_scale"):
            return np.asarray(synthetic_input_scale(), np.float32)
        if name.endswith("ngram_embedding.weight_scale"):
            return np.asarray(NGRAM_SCALE, np.float32)
        if ".ngram_embedding.shard_" in name:
            layer, shard = int(name.split(".")[1]), int(name.split(".shard_")[1].split(".")[0])
            return self._ngram_shard(self.config.ple_layers.index(layer), shard)
        return _cast(self._dense(name, shape), dt)

    def _dense(self, name: str, shape) -> np.ndarray:
        """float32 values by the writer's rules, generated in row chunks on several threads."""
        rows = shape[0] if shape else 1
        row_elems = math.prod(shape[1:]) if len(shape) > 1 else 1
        step = max(1, CHUNK_ELEMS // max(row_elems, 1)) if len(shape) > 1 else rows
        starts = list(range(0, rows, step))
        out = np.empty(shape, np.float32)

        def fill(k):
            r0 = starts[k]
            r1 = min(rows, r0 + step)
            sub = (r1 - r0, *shape[1:]) if shape else ()
            out[r0:r1] = _init(name, sub, self.config, _rng(self.seed, name, k))

        if len(starts) == 1:
            fill(0)
        else:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(fill, range(len(starts))))
        return out

    def expert_stack(self, layer: int, proj: str) -> dict[str, np.ndarray]:
        """All experts of decoder layer `layer`'s `proj` (gate_proj, up_proj, down_proj) at once:
        {"weight": [E, ...], "weight_scale": [E, ...], "weight_scale_2": [E], ...}."""
        return self._generate_experts(f"layers.{layer}.mlp.experts", proj)

    def _expert_tensor(self, name: str) -> np.ndarray:
        """One expert's tensor, from the stacked arrays of its layer (generated on the first request)."""
        module, suffix = name.rsplit(".", 1)  # ...mlp.experts.{e}.{proj}, weight|weight_scale|...
        head, e, proj = module.rsplit(".", 2)
        key = f"{head}.{proj}"
        if self._experts is None or self._experts[0] != key:
            self._experts = (key, self._generate_experts(head, proj))
        return self._experts[1][suffix][int(e)]

    def _generate_experts(self, head: str, proj: str) -> dict[str, np.ndarray]:
        n = self.config.num_experts
        shape, dt = self.specs[f"{head}.0.{proj}.weight"]
        out_f = shape[0]
        scheme = self.quant.scheme(f"{head}.0.{proj}")
        in_f = shape[1] * (2 if scheme and scheme.algo == "NVFP4" else 1)
        target_rms = (MOE_OUT_GAIN if proj == "down_proj" else 1.0) / math.sqrt(in_f)
        rng = _rng(self.seed, f"{head}.{proj}")
        if scheme is None:  # BF16 experts
            return {"weight": np.stack([self._dense(f"{head}.{e}.{proj}.weight", (out_f, in_f)).astype(DTYPES[dt])
                                        for e in range(n)])}
        if scheme.algo == "FP8_PB_WO":  # the MTP layer's experts
            return self._fp8_block(head, proj, n)
        packed = np.empty((n, out_f, in_f // 2), np.uint8)
        seeds = rng.integers(0, 2**63, n)

        def fill(e):
            packed[e] = np.frombuffer(np.random.default_rng(seeds[e]).bytes(packed[e].size), np.uint8).reshape(
                packed[e].shape)

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(fill, range(n)))
        # block scales of 1.0 (FP8 bits 0x38); each expert's magnitude varies through its per-tensor scale
        scale = np.full((n, out_f, in_f // 16), 0x38, np.uint8).view(ml_dtypes.float8_e4m3fn)
        scale2 = (target_rms / E2M1_RMS * rng.uniform(0.75, 1.25, n)).astype(np.float32)
        return {"weight": packed, "weight_scale": scale, "weight_scale_2": scale2,
                "input_scale": np.full(n, synthetic_input_scale(), np.float32)}

    def _fp8_block(self, head: str, proj: str, n: int) -> dict[str, np.ndarray]:
        ws, ss = [], []
        for e in range(n):
            shape = self.specs[f"{head}.{e}.{proj}.weight"][0]
            q, s = quantize_fp8_block(self._dense(f"{head}.{e}.{proj}.weight", shape), FP8_BLOCK)
            ws.append(q)
            ss.append(s)
        return {"weight": np.stack(ws), "weight_scale": np.stack(ss)}

    def ngram_table(self, ple_index: int = 0):
        """The FP8 n-gram table as memory shards (an NGramTable, like Checkpoint.read_ngram_table)."""
        from .checkpoint import NGramTable

        with ThreadPoolExecutor(self.threads) as pool:
            shards = list(pool.map(lambda i: self._ngram_shard(ple_index, i), range(self.config.split_ngram_parts)))
        return NGramTable(shards, [], float(NGRAM_SCALE), "synthetic n-gram table")

    def _ngram_shard(self, ple_index: int, i: int) -> np.ndarray:
        c = self.config
        rows = c.ngram_table_rows(ple_index) // c.split_ngram_parts
        x = _normal(_rng(self.seed, f"ngram.{ple_index}", i), (rows, c.ngram_head_dim), NGRAM_STD)
        return quantize_fp8_per_tensor(np.clip(x, -NGRAM_CLIP, NGRAM_CLIP), NGRAM_SCALE)[0]
