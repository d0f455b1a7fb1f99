"""config.json in both layouts, and validation errors that name the field and the value."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

from jaxflash import presets
from jaxflash.config import ConfigError, ModelConfig, load_config

from hf_reference import tiny_hf_config


def test_text_layout_from_transformers():
    hcfg = tiny_hf_config(num_hidden_layers=8, eos_token_id=[3, 5])
    c = ModelConfig.from_dict(hcfg.to_dict())
    assert c.layer_types == tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8))
    assert c.attention_layers == (3, 7) and c.ple_layers == (1,)
    assert c.eos_token_id == 3 and c.eos_token_ids == (3, 5)
    assert c.rotary_dim == 8 and c.block_topk == 2 and c.qsa_enabled
    assert c.ngram_head_dim == 2 and c.num_ngram_heads == 16
    # the hash constants the reference derives
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding
    ref = Qwen4ExpTextNGramEmbedding(hcfg, hcfg.ple_embed_dim, layer_idx=1)
    assert list(c.ngram_multipliers()) == ref.layer_multipliers.tolist()
    assert list(c.ngram_head_vocab_sizes()) == ref.ngram_heads_vocab_sizes.tolist()
    assert list(c.ngram_head_offsets()) == ref.ngram_heads_offsets.tolist()
    assert c.ngram_table_rows() == ref.ngram_embedding.weight.shape[0]


def test_release_layout_nested_text_config():
    text = tiny_hf_config().to_dict()
    raw = Qwen4ExpConfig(text_config=text).to_dict()
    eos = raw["text_config"].pop("eos_token_id")
    raw["eos_token_id"] = eos  # top-level values fill what text_config lacks
    raw["architectures"] = ["Qwen4ExpForConditionalGeneration"]
    c = ModelConfig.from_dict(raw)
    assert c.hidden_size == text["hidden_size"] and c.eos_token_id == eos


def test_full_preset_matches_spec_and_round_trips_through_transformers():
    c = presets.full()
    assert c.ngram_multipliers() == (23703573157769, 20109073645365, 8052911324071)
    assert sum(c.ngram_head_vocab_sizes()) == 320001446 and c.ngram_table_rows() == 320001536
    assert c.ngram_table_rows() // c.split_ngram_parts == 2500012
    assert len(c.linear_layers) == 36 and len(c.attention_layers) == 12 and c.block_topk == 512
    hf = Qwen4ExpTextConfig(**c.to_text_config_dict())  # the reference accepts what we write
    assert ModelConfig.from_dict(hf.to_dict()) == c


def test_layer_type_aliases():
    d = tiny_hf_config().to_dict()
    for name in ("full_attention", "indexed_attention", "deepseek_sparse_attention", "hybrid_indexed"):
        d["layer_types"] = ["linear_attention"] * 3 + [name]
        assert ModelConfig.from_dict(d).layer_types[3] == "full_attention"
    del d["layer_types"]  # default: every 4th layer is attention
    assert ModelConfig.from_dict(d).attention_layers == (3,)


def test_qsa_off_when_fields_absent():
    d = tiny_hf_config().to_dict()
    for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"):
        d.pop(k)
    assert not ModelConfig.from_dict(d).qsa_enabled


@pytest.mark.parametrize("change, field, value", [
    ({"layer_types": ["linear_attention", "linear_attention", "linear_attention", "mamba"]}, "layer_types[3]",
     "'mamba'"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types", "linear_attention"),
    ({"indexer_kv_heads": 2}, "indexer_kv_heads", "2"),
    ({"indexer_budget": 10}, "indexer_budget", "10"),
    ({"indexer_head_dim": None}, "indexer_head_dim", "missing"),
    ({"indexer_n_heads": 0}, "indexer_n_heads", "0"),
    ({"ple_embed_dim": 30}, "ple_embed_dim", "30"),
    ({"ple_layer_ids": [9]}, "ple_layer_ids", "[9]"),
    ({"ple_layer_ids": [4]}, "ple_layer_ids", "[4]"),
    ({"eos_token_id": None}, "eos_token_id", "None"),
    ({"eos_token_id": 1000}, "eos_token_id", "1000"),
    ({"eos_token_id": "x"}, "eos_token_id", "'x'"),
    ({"hc_count": 1}, "hc_count", "1"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "9"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "3"),
    ({"output_gate_type": "tanh"}, "output_gate_type", "'tanh'"),
    ({"hidden_size": "64"}, "hidden_size", "'64'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type", "'yarn'"),
])
def test_invalid_configs_name_field_and_value(change, field, value):
    d = tiny_hf_config().to_dict()
    d.update(change)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(d)
    assert field in str(e.value) and value in str(e.value), str(e.value)


def test_missing_required_field_and_bad_file(tmp_path):
    d = tiny_hf_config().to_dict()
    del d["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path / "nowhere")
