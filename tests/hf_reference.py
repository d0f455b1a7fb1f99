"""The numerical reference: transformers' qwen4_exp on tiny random configs, run in float64 on the CPU.

Every parameter is randomised (norm weights included, with scales that keep activations O(1)), so a test
fails if any weight is ignored or misplaced.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

torch.set_grad_enabled(False)


def tiny_hf_config(**overrides) -> Qwen4ExpTextConfig:
    kw = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, hc_count=4, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=32,
        ngram_vocab_size_base=200, split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        eos_token_id=3, output_gate_type="sigmoid", max_position_embeddings=4096,
    )
    kw.update(overrides)
    return Qwen4ExpTextConfig(**kw)


def _std(name: str, shape) -> tuple[float, float]:
    """(mean, std) for a parameter, by its role."""
    if name.endswith(("norm.weight", "hc_norm.weight", "norm_key.weight", "norm_query.weight",
                      "norm_conv.weight", "layernorm.weight")):
        if "linear_attn.norm" in name:  # RMSNormGated multiplies by w directly
            return 1.0, 0.2
        return 0.0, 0.2  # (1 + w) norms
    if name.endswith("A_log"):
        return math.log(2.0), 0.5
    if name.endswith("dt_bias"):
        return 0.0, 0.5
    if "conv1d" in name:
        return 0.0, 0.4
    if "ngram_embedding" in name:
        return 0.0, 1.0
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("mlp.gate.weight"):  # router: spread the logits so top-k is well separated
        return 0.0, 2.0 / math.sqrt(shape[-1])
    fan_in = shape[-1]
    return 0.0, 1.0 / math.sqrt(fan_in)


def build_hf_model(cfg: Qwen4ExpTextConfig, seed: int = 0) -> Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    cfg._experts_implementation = "eager"  # the grouped-mm path has no float64 kernel
    model = Qwen4ExpForCausalLM(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        mean, std = _std(name, tuple(p.shape))
        p.copy_(mean + std * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def hf_logits(model: Qwen4ExpForCausalLM, tokens) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)[None]
    return model(input_ids=ids).logits[0].numpy()


def checkpoint_tensors(model: Qwen4ExpForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors under checkpoint names (per-expert projections, sharded n-gram table), without the
    `model.` prefix, as save_pretrained would write them."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        a = t.numpy()
        name = name.removeprefix("model.")
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            inter = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = a[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = a[e, inter:]
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(a.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = a[e]
        elif name.endswith("ngram_embedding.weight"):
            base = name.removesuffix("weight")
            for i, shard in enumerate(np.split(a, cfg.split_ngram_parts)):
                out[f"{base}shard_{i}.weight"] = shard
        else:
            out[name] = a
    return out
