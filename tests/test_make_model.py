"""scripts/make_model.py and jaxflash.synthetic: the files load in transformers' reference model and in our reader,
activations stay in range, and the tokenizer/chat template work."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxflash import synthetic
from jaxflash.checkpoint import DTYPES, Checkpoint, expected_tensors
from jaxflash.config import FULL_ATTENTION, LINEAR_ATTENTION

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """tiny bf16 and nvfp4 through the CLI, same seed."""
    root = tmp_path_factory.mktemp("made")
    out = {}
    for quant in ("bf16", "nvfp4"):
        out[quant] = str(root / quant)
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_model.py"), "--preset", "tiny",
                        "--quant", quant, "--seed", "3", "--out", out[quant], "--quiet"], check=True)
    return out


def _ids(cfg, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(synthetic.SPECIAL_TOKENS), cfg.vocab_size, (2, T), generator=g)
    ids[0, 20] = synthetic.TOKEN_IDS["<|endoftext|>"]  # an EOS inside the sequence (PLE segments)
    return ids


def _hf_from_dequantized(ckpt):
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**synthetic.hf_text_config(ckpt.config))).float().eval()
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in synthetic.dequantized_state_dict(ckpt).items()}
    model.load_state_dict(sd, strict=True)
    return model


def test_files_and_configs(made):
    for quant, d in made.items():
        files = set(os.listdir(d))
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "model.safetensors"} <= files
        raw = json.load(open(os.path.join(d, "config.json")))
        assert raw["architectures"] == ["Qwen4ExpForConditionalGeneration"] and "vision_config" in raw
        assert "seed" not in raw["text_config"]  # as in the released config.json
        assert raw["text_config"]["layer_types"][3] == "full_attention"
        gen = json.load(open(os.path.join(d, "generation_config.json")))
        assert gen["eos_token_id"] == [0, 2] and gen["do_sample"] is True
        c = Checkpoint.open(d)
        assert c.config.eos_token_ids == (0, 2) and c.layout == "release" and c.has_mtp
        if quant == "nvfp4":
            q = raw["quantization_config"]
            assert q["quant_method"] == "modelopt" and q["quant_algo"] == "MIXED_PRECISION"
            assert q["quantized_layers"]["model.language_model.layers.7.mlp.experts"] == {
                "quant_algo": "NVFP4", "group_size": 16}
            assert q["quantized_layers"]["mtp.layers.0.mlp.experts"] == {"quant_algo": "FP8_PB_WO",
                                                                        "group_size": 128}
            assert q["quantized_layers"]["model.language_model.layers.1.ple.ple_embedding.ngram_embedding"] == {
                "quant_algo": "FP8"}
            assert "model.visual*" in q["ignore"] and "lm_head" in q["ignore"]
            assert os.path.exists(os.path.join(d, "hf_quant_config.json"))


def test_seeded_and_deterministic(made, tmp_path):
    again = synthetic.write_checkpoint(str(tmp_path / "a"), synthetic.make_config("tiny"), seed=3, progress=False,
                                       threads=1, shard_bytes=500_000)  # other sharding, one thread
    other = synthetic.write_checkpoint(str(tmp_path / "b"), synthetic.make_config("tiny"), seed=4, progress=False)
    a, b, o = Checkpoint.open(made["bf16"]), Checkpoint.open(again), Checkpoint.open(other)
    for name in a.names():
        np.testing.assert_array_equal(a.read(name), b.read(name))
    assert not np.array_equal(a.read("layers.0.linear_attn.out_proj.weight"),
                              o.read("layers.0.linear_attn.out_proj.weight"))
    # every parameter is randomised, norms included (no all-zero / all-one tensors except the hash buffers)
    for name in a.names():
        x = np.asarray(a.read(name), np.float64)
        assert x.std() > 0 or x.size == 1, name


def test_bf16_loads_in_transformers_and_matches_reader(made):
    model, info = Qwen4ExpForCausalLM.from_pretrained(made["bf16"], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    c = Checkpoint.open(made["bf16"])
    sd = model.state_dict()
    ref = synthetic.dequantized_state_dict(c)
    assert set(sd) == set(ref)
    for k, v in ref.items():  # fused experts, concatenated n-gram table, every tensor
        np.testing.assert_array_equal(sd[k].numpy(), v, err_msg=k)
    r = synthetic.activation_report(model.eval(), _ids(c.config))
    assert np.isfinite(list(r.values())).all()
    assert all(0.8 < r[f"layer{i}"] < 2.0 for i in range(c.config.num_hidden_layers)), r
    assert 1.0 < r["logits_std"] < 10.0, r


def test_nvfp4_dequantized_matches_bf16_reference(made):
    """transformers cannot load pre-quantized NVFP4: we dequantize into its state dict."""
    bf16 = Qwen4ExpForCausalLM.from_pretrained(made["bf16"], dtype=torch.float32).eval()
    nv = _hf_from_dequantized(Checkpoint.open(made["nvfp4"]))
    ids = _ids(nv.config)
    with torch.no_grad():
        a, b = bf16(input_ids=ids).logits, nv(input_ids=ids).logits
    assert torch.isfinite(b).all()
    # the same seed: nvfp4 holds the quantized bf16 weights, so the logits agree up to FP4/FP8 error
    rel = float((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())
    assert rel < 0.15, rel
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.7


def test_residual_stream_bounded_over_48_layers(tmp_path):
    """Full depth (tiny widths): the residual RMS grows slowly and logits stay finite."""
    n = 48
    c = synthetic.make_config("tiny").replace(
        num_hidden_layers=n, layer_types=tuple(LINEAR_ATTENTION if (i + 1) % 4 else FULL_ATTENTION
                                               for i in range(n)))
    d = synthetic.write_checkpoint(str(tmp_path / "deep"), c, seed=0, progress=False)
    model = Qwen4ExpForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    r = synthetic.activation_report(model, _ids(c, T=32))
    rms = [r[f"layer{i}"] for i in range(n)]
    assert np.isfinite(rms).all() and 0.9 < min(rms) and max(rms) < 2.5, rms
    assert all(b >= a * 0.97 for a, b in zip(rms, rms[1:]))  # no collapse between layers
    assert 1.0 < r["logits_std"] < 10.0


def test_vision_tensors_match_transformers(made):
    from transformers import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    raw = json.load(open(os.path.join(made["bf16"], "config.json")))
    vision = Qwen4ExpVisionModel(Qwen4ExpVisionConfig(**raw["vision_config"]))
    want = {"model.visual." + k: tuple(v.shape) for k, v in vision.state_dict().items()}
    got = {k: s.shape for k, s in synthetic.vision_tensors(raw["vision_config"]).items()}
    assert got == want
    assert sorted(Checkpoint.open(made["bf16"]).vision_tensors) == sorted(want)


def test_tokenizer_and_chat_template(made):
    c = Checkpoint.open(made["bf16"]).config
    tok = AutoTokenizer.from_pretrained(made["bf16"])
    assert len(tok) <= c.vocab_size
    for t, i in synthetic.TOKEN_IDS.items():
        assert tok.convert_tokens_to_ids(t) == i
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id in c.eos_token_ids
    assert tok.convert_tokens_to_ids("<|endoftext|>") == c.eos_token_id
    ids = tok("hi <tool_call> there<|im_end|>").input_ids
    assert ids[-1] == 2 and 5 in ids and tok.decode(ids, skip_special_tokens=True) == "hi <tool_call> there"
    # both files say which added tokens are control tokens, and they agree: markup is text
    spec = json.load(open(os.path.join(made["bf16"], "tokenizer.json")))
    decl = json.load(open(os.path.join(made["bf16"], "tokenizer_config.json")))["added_tokens_decoder"]
    assert {t["content"]: t["special"] for t in spec["added_tokens"]} == dict(synthetic.SPECIAL_TOKENS)
    assert {t["content"]: t["special"] for t in decl.values()} == dict(synthetic.SPECIAL_TOKENS)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "use the tool",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "5 C"}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"name": "get_weather", "parameters": {"type": "object"}}\n</tools>' in text
    assert ('<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n5 C\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # reasoning of turns before the last user message is dropped; enable_thinking=False pre-fills <think></think>
    later = msgs + [{"role": "assistant", "content": "Cold."}, {"role": "user", "content": "Thanks"}]
    assert "use the tool" not in tok.apply_chat_template(later, tools=tools, tokenize=False)
    assert tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
                                   ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_full_preset_plan():
    """`full` has docs/model.md §1's sizes (not written here: ~123 GiB); the n-gram table can be shrunk."""
    c = synthetic.make_config("full")
    assert (c.hidden_size, c.num_hidden_layers, c.num_experts, c.vocab_size) == (2560, 48, 512, 248320)
    assert c.ngram_table_rows() == 320001536 and c.split_ngram_parts == 128
    q = synthetic.release_quant_config(c)
    e = expected_tensors(c, q)
    size = sum(DTYPES[d].itemsize * math.prod(s) for s, d in e.values())
    assert 120 * 2**30 < size < 125 * 2**30  # the ~123 GiB NVFP4 checkpoint
    assert e["layers.47.mlp.experts.511.down_proj.weight"] == ((2560, 320), "U8")
    assert e["layers.47.mlp.experts.511.down_proj.weight_scale"] == ((2560, 40), "F8_E4M3")
    assert e["mtp.layers.0.mlp.experts.0.gate_proj.weight_scale"] == ((5, 20), "F32")
    assert e["layers.1.ple.ple_embedding.ngram_embedding.shard_127.weight"] == ((2500012, 160), "F8_E4M3")
    small = synthetic.make_config("full", ngram_rows_scale=0.01)
    assert small.ngram_table_rows() % 128 == 0 and small.ngram_table_rows() < c.ngram_table_rows() // 50
    assert small.ngram_head_vocab_sizes() != c.ngram_head_vocab_sizes()  # buffers follow the config


def test_fewer_layers(tmp_path):
    """--layers N keeps the first N decoder layers: the 3:1 pattern and the PLE layer stay, the expert tensors
    of later layers are gone, and the checkpoint loads; values out of range are refused before writing."""
    c = synthetic.make_config("full", num_layers=24, ngram_rows_scale=1 / 64)
    assert c.num_hidden_layers == 24 and c.layer_types == synthetic.make_config("full").layer_types[:24]
    e = expected_tensors(c, synthetic.release_quant_config(c))
    assert "layers.23.mlp.experts.511.down_proj.weight" in e and "layers.24.mlp.experts.0.up_proj.weight" not in e
    out = tmp_path / "four"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_model.py"), "--preset", "tiny", "--quant",
                    "nvfp4", "--layers", "4", "--out", str(out), "--quiet"], check=True)
    cfg = Checkpoint.open(str(out)).config
    assert cfg.num_hidden_layers == 4 and cfg.layer_types[3] == FULL_ATTENTION
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_model.py"), "--preset", "tiny",
                          "--quant", "nvfp4", "--layers", "1", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "num_layers must be in [2, 8]" in bad.stderr
    assert not (tmp_path / "bad").exists()
    assert (out / "tokenizer.json").exists()
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_model.py"), "--preset", "tiny", "--quant",
                    "bf16", "--layers", "2", "--no-tokenizer", "--out", str(bare), "--quiet"], check=True)
    assert not (bare / "tokenizer.json").exists() and Checkpoint.open(str(bare)).config.num_hidden_layers == 2


def test_full_preset_with_the_synthetic_tokenizer():
    """A full-width checkpoint that can be served: with the synthetic tokenizer its eos ids are that
    tokenizer's special tokens (the published ids lie past its vocabulary); without, the published ids stay."""
    published = synthetic.make_config("full")
    assert published.eos_token_ids == (248044, 248046)
    c = synthetic.make_config("full", tokenizer=True)
    tok = synthetic.build_tokenizer(c.vocab_size)
    assert set(c.eos_token_ids) == {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    assert c.replace(eos_token_id=published.eos_token_id, eos_token_ids=published.eos_token_ids) == published


def test_synthetic_source_in_memory(made):
    """The in-memory source (full-size benchmarks) has every tensor of the NVFP4 layout, its dense tensors equal
    the written checkpoint's, and the model it builds runs."""
    import jax.numpy as jnp

    import jaxflash
    from jaxflash.model.weights import load_params

    ckpt = Checkpoint.open(made["nvfp4"])
    src = synthetic.SyntheticSource(ckpt.config, seed=3, threads=2)
    for name, (shape, dt) in ckpt.expected().items():
        a = src.read(name)
        assert a.shape == tuple(shape) and a.dtype == DTYPES[dt], name
    for name in ("embed_tokens.weight", "layers.3.self_attn.q_proj.weight", "layers.1.ple.key_proj.weight"):
        np.testing.assert_array_equal(src.read(name), ckpt.read(name))
    table = src.ngram_table()
    assert table.shape == ckpt.read_ngram_table().shape
    engine = jaxflash.Engine(ckpt.config, load_params(src, ckpt.config, "float32"), host_table=table)
    logits = engine.logits(np.arange(40) % ckpt.config.vocab_size)
    assert np.isfinite(logits).all() and 0.3 < float(jnp.std(logits)) < 30
