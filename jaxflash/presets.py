"""Model sizes: the real model (`full`, docs/model.md §1) and two small ones for tests, benchmarks and the
bundled default model. Every preset has every block of the real model: GDN and attention layers in the 3:1
pattern, QSA, PLE at decoder layer 1, shared + routed experts and an MTP layer."""

from __future__ import annotations

from .config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig, validate


def _layer_types(n: int) -> tuple[str, ...]:
    return tuple(LINEAR_ATTENTION if (i + 1) % 4 else FULL_ATTENTION for i in range(n))


def full() -> ModelConfig:
    return ModelConfig(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=48, layer_types=_layer_types(48),
        eos_token_id=248044, eos_token_ids=(248044, 248046), max_position_embeddings=262144,
        num_attention_heads=24, num_key_value_heads=2, head_dim=256, rope_theta=1e7, partial_rotary_factor=0.25,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        hc_count=4, hc_lowrank=320, ple_layer_ids=(2,), ple_embed_dim=2560, split_ngram_parts=128,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        mtp_num_hidden_layers=1,
    )


def small(vocab_size: int = 1024, eos_token_id: int = 0) -> ModelConfig:
    """~100 MB in bf16: big enough that kernels and the expert cache see real shapes, small enough for CI."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=512, num_hidden_layers=8, layer_types=_layer_types(8),
        eos_token_id=eos_token_id, max_position_embeddings=65536,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=1e7, partial_rotary_factor=0.25,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        hc_count=4, hc_lowrank=64, ple_layer_ids=(2,), ple_embed_dim=512, ngram_vocab_size_base=100_000,
        split_ngram_parts=8, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=256,
        indexer_compress_ratio=4, mtp_num_hidden_layers=1,
    )


def tiny(vocab_size: int = 512, eos_token_id: int = 0) -> ModelConfig:
    """A few MB: unit tests and the bundled default model. QSA's budget (32 tokens) is small so that short
    inputs already exercise block selection."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=8, layer_types=_layer_types(8),
        eos_token_id=eos_token_id, max_position_embeddings=32768,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e7, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        hc_count=4, hc_lowrank=16, ple_layer_ids=(2,), ple_embed_dim=64, ngram_vocab_size_base=4096,
        split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32,
        indexer_compress_ratio=4, mtp_num_hidden_layers=1,
    )


PRESETS = {"tiny": tiny, "small": small, "full": full}


def preset(name: str, **kw) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name](**kw)
    validate(cfg)
    return cfg
