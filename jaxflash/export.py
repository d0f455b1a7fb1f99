"""Model parameters -> a checkpoint in the real published layouts (the inverse of jaxflash.model.weights).

    save_checkpoint(out, config, params, quant="nvfp4", tokenizer=tok)

`quant="bf16"` writes the BF16 release layout; `quant="nvfp4"` writes NVIDIA's MIXED_PRECISION layout: routed
experts NVFP4 (ModelOpt's quantisation of the bf16-rounded weights), the n-gram table FP8 with one global scale,
the MTP experts FP8 in 128x128 blocks, everything else BF16. A tiny random vision tower is written too, so the
release layout is complete (jaxflash and the text model never read it).
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np

from .checkpoint import RELEASE_PREFIX, QuantConfig, expected_tensors, full_name, write_safetensors
from .config import ModelConfig
from .model import moe as moe_mod
from .model.attention import Attention
from .model.transformer import DecoderLayer, Params
from .quant import quantize_fp8_block, quantize_fp8_per_tensor, quantize_nvfp4
from .synthetic import (_init_vision, _rng, config_json, generation_config_json, ple_buffer, release_quant_config,
                        tokenizer_config_json, vision_config_dict, vision_tensors)


def _np(x) -> np.ndarray:
    x = np.asarray(jax.device_get(x))
    return x.astype(np.float32) if x.dtype.kind == "f" and x.dtype != np.float32 else x


def _hc(prefix: str, p) -> dict:
    out = {f"{prefix}.hc_norm.weight": p.norm, f"{prefix}.input_mix_weight_down.weight": p.down,
           f"{prefix}.input_mix_weight_up.weight": p.up}
    if p.inject is not None:
        out[f"{prefix}.block_inject_weight.weight"] = p.inject
    return out


def _layer(prefix: str, layer: DecoderLayer, cfg: ModelConfig) -> dict:
    t = {**_hc(f"{prefix}.attn_hyper_connection", layer.attn_hc), **_hc(f"{prefix}.mlp_hyper_connection", layer.mlp_hc)}
    m = layer.mixer
    if isinstance(m, Attention):
        a = f"{prefix}.self_attn"
        t.update({f"{a}.q_proj.weight": m.q_proj, f"{a}.k_proj.weight": m.k_proj, f"{a}.v_proj.weight": m.v_proj,
                  f"{a}.o_proj.weight": m.o_proj, f"{a}.q_norm.weight": m.q_norm, f"{a}.k_norm.weight": m.k_norm})
        if m.indexer is not None:
            t.update({f"{a}.indexer.index_qk_proj.weight": m.indexer.index_qk_proj,
                      f"{a}.indexer.q_layernorm.weight": m.indexer.q_norm,
                      f"{a}.indexer.k_layernorm.weight": m.indexer.k_norm})
    else:
        g = f"{prefix}.linear_attn"
        t.update({f"{g}.in_proj_qkv.weight": m.in_proj_qkv, f"{g}.in_proj_z.weight": m.in_proj_z,
                  f"{g}.in_proj_b.weight": m.in_proj_b, f"{g}.in_proj_a.weight": m.in_proj_a,
                  f"{g}.conv1d.weight": _np(m.conv1d)[:, None, :], f"{g}.dt_bias": m.dt_bias,
                  f"{g}.A_log": m.A_log, f"{g}.norm.weight": m.norm, f"{g}.out_proj.weight": m.out_proj})
    e = layer.moe
    p = f"{prefix}.mlp"
    t.update({f"{p}.gate.weight": e.router, f"{p}.shared_expert.gate_proj.weight": e.shared_gate_proj,
              f"{p}.shared_expert.up_proj.weight": e.shared_up_proj,
              f"{p}.shared_expert.down_proj.weight": e.shared_down_proj,
              f"{p}.shared_expert_gate.weight": e.shared_expert_gate})
    for proj, w in (("gate_proj", e.experts.gate), ("up_proj", e.experts.up), ("down_proj", e.experts.down)):
        dense = _np(moe_mod.as_dense(w, np.float32))
        for i in range(dense.shape[0]):
            t[f"{p}.experts.{i}.{proj}.weight"] = dense[i]
    if layer.ple is not None:
        q = f"{prefix}.ple"
        t.update({f"{q}.key_proj.weight": layer.ple.key_proj, f"{q}.value_proj.weight": layer.ple.value_proj,
                  f"{q}.norm_key.weight": layer.ple.norm_key, f"{q}.norm_query.weight": layer.ple.norm_query,
                  f"{q}.norm_conv.weight": layer.ple.norm_conv,
                  f"{q}.conv1d.weight": _np(layer.ple.conv1d)[:, None, :]})
    return t


def params_to_tensors(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """float32 arrays under checkpoint names (text prefix removed; experts per expert; the n-gram table whole,
    under `...ngram_embedding.weight`, dequantised if it was FP8)."""
    t = {"embed_tokens.weight": params.embed, "lm_head.weight": params.lm_head,
         **_hc("hyper_connection_mixer", params.mixer)}
    for i, layer in enumerate(params.layers):
        t.update(_layer(f"layers.{i}", layer, cfg))
        if layer.ple is not None:
            if layer.ple.table is None:
                raise ValueError("the n-gram table is on the host; export needs it in the parameters")
            table = _np(layer.ple.table).astype(np.float32)
            if layer.ple.table_scale is not None:
                table = table * np.float32(_np(layer.ple.table_scale))
            t[f"layers.{i}.ple.ple_embedding.ngram_embedding.weight"] = table
    if params.mtp is not None:
        m = params.mtp
        t.update({"mtp.pre_fc_norm_embedding.weight": m.pre_fc_norm_embedding,
                  "mtp.pre_fc_norm_hidden.weight": m.pre_fc_norm_hidden,
                  "mtp.fc_embedding.weight": m.fc_embedding, "mtp.fc_hidden.weight": m.fc_hidden,
                  **_layer("mtp.layers.0", m.layer, cfg), **_hc("mtp.hyper_connection_mixer", m.mixer)})
    return {k: _np(v) for k, v in t.items()}


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def quantized_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig, quant: QuantConfig) -> dict[str, np.ndarray]:
    """Checkpoint tensors (short names) as the quantization config stores them."""
    out = {}
    for name, x in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith("ngram_embedding.weight"):
            shards = np.split(x, cfg.split_ngram_parts)
            if quant.algo_of(module) == "FP8":
                q, scale = quantize_fp8_per_tensor(x)  # one global scale over the whole table
                shards = np.split(q, cfg.split_ngram_parts)
                out[f"{module}.weight_scale"] = np.asarray(scale, np.float32)
            else:
                shards = [_bf16(s) for s in shards]
            for i, s in enumerate(shards):
                out[f"{module}.shard_{i}.weight"] = s
            continue
        scheme = quant.scheme(module) if name.endswith(".weight") else None
        w = np.asarray(_bf16(x), np.float32)  # quantisers start from the bf16 model, as ModelOpt does
        if scheme is not None and scheme.algo == "NVFP4":
            q = quantize_nvfp4(w, scheme.group_size)
            out.update({f"{module}.weight": q.weight, f"{module}.weight_scale": q.weight_scale,
                        f"{module}.weight_scale_2": q.weight_scale_2, f"{module}.input_scale": q.input_scale})
        elif scheme is not None and scheme.algo == "FP8_PB_WO":
            qw, s = quantize_fp8_block(w, scheme.group_size)
            out.update({f"{module}.weight": qw, f"{module}.weight_scale": s})
        else:
            out[name] = _bf16(x)
    for k, layer in enumerate(cfg.ple_layers):
        for buf in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            name = f"layers.{layer}.ple.ple_embedding.{buf}"
            out[name] = ple_buffer(name, cfg, k)
    return out


def save_checkpoint(out: str, cfg: ModelConfig, params: Params, *, quant: str = "nvfp4", tokenizer=None,
                    seed: int = 0) -> str:
    """Write `params` as a release-layout checkpoint (single file) in directory `out`; returns `out`.

    tokenizer: a `tokenizers.Tokenizer` whose special tokens are jaxflash.synthetic.SPECIAL_TOKENS (written
    with the chat template), or None."""
    if quant not in ("bf16", "nvfp4"):
        raise ValueError(f"quant must be 'bf16' or 'nvfp4', got {quant!r}")
    qcfg = release_quant_config(cfg) if quant == "nvfp4" else QuantConfig(prefix=RELEASE_PREFIX)
    tensors = quantized_tensors(params_to_tensors(params, cfg), cfg, qcfg)
    expected = expected_tensors(cfg, qcfg, mtp=params.mtp is not None)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - {n for n in tensors if n.endswith("block_inject_weight.weight")})
    if missing or extra:
        raise ValueError(f"export does not match the checkpoint layout: missing {missing[:5]}, extra {extra[:5]}")
    vision = vision_config_dict(cfg)
    disk = {full_name(n, RELEASE_PREFIX): tensors[n] for n in expected}
    for name, (shape, _) in vision_tensors(vision).items():
        disk[name] = _bf16(_init_vision(name, shape, _rng(seed, name)))
    os.makedirs(out, exist_ok=True)

    def dump(fname, obj):
        with open(os.path.join(out, fname), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")

    write_safetensors(os.path.join(out, "model.safetensors"), disk, {"format": "pt"})
    dump("config.json", config_json(cfg, "release", qcfg, vision, tokenizer is not None))
    dump("generation_config.json", generation_config_json(cfg))
    if quant == "nvfp4":
        dump("hf_quant_config.json", qcfg.to_legacy_dict())
    if tokenizer is not None:
        tokenizer.save(os.path.join(out, "tokenizer.json"))
        dump("tokenizer_config.json", tokenizer_config_json(cfg))
    return out
