"""The checkpoint reader: both layouts, sharding, quantization configs, the n-gram table and every error path."""

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from jaxflash import checkpoint as ck
from jaxflash import quant as q
from jaxflash import synthetic
from jaxflash.checkpoint import Checkpoint, CheckpointError, QuantConfig

SEED = 7


@pytest.fixture(scope="module")
def cfg():
    return synthetic.make_config("tiny")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, cfg):
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for key, kw in {"bf16": dict(quant="bf16"), "nvfp4": dict(quant="nvfp4"),
                    "text": dict(layout="text", shard_bytes=400_000),
                    "bf16_sharded": dict(quant="bf16", shard_bytes=300_000)}.items():
        out[key] = synthetic.write_checkpoint(str(root / key), cfg, seed=SEED, progress=False, **kw)
    return out


def clone(src, dst, mutate=None, config=None):
    """Copy a single-file checkpoint, letting `mutate(tensors)` edit its tensors and `config(raw)` its config."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(src, f), dst)
    if mutate is not None:
        f = ck.SafetensorsFile(os.path.join(src, "model.safetensors"))
        tensors = {n: f.array(i).copy() for n, i in f.tensors.items()}
        mutate(tensors)
        ck.write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    else:
        shutil.copy(os.path.join(src, "model.safetensors"), dst)
    if config is not None:
        path = os.path.join(dst, "config.json")
        raw = json.load(open(path))
        config(raw)
        json.dump(raw, open(path, "w"))
    return dst


# ----- layouts -------------------------------------------------------------------------------------------------
def test_release_layout(dirs, cfg):
    c = Checkpoint.open(dirs["bf16"])
    assert (c.layout, c.prefix) == ("release", "model.language_model.")
    assert c.config == cfg and not c.quant.is_quantized and c.has_mtp
    assert c.has("embed_tokens.weight") and c.has("lm_head.weight") and c.has("mtp.fc_hidden.weight")
    assert c.has("layers.3.self_attn.indexer.index_qk_proj.weight")
    assert not c.has("model.language_model.embed_tokens.weight")
    assert set(c.names()) == set(ck.expected_tensors(cfg))
    # the vision tower is listed but never exposed or read
    assert c.vision_tensors and all(n.startswith("model.visual.") for n in c.vision_tensors)
    assert not any("visual" in n for n in c.names())


def test_text_layout_sharded_matches_release(dirs, cfg):
    t, r = Checkpoint.open(dirs["text"]), Checkpoint.open(dirs["bf16"])
    assert (t.layout, t.prefix) == ("text", "model.") and len(t.files) > 1
    assert not t.has_mtp and not t.vision_tensors  # transformers' save_pretrained layout has neither
    assert set(t.names()) == set(ck.expected_tensors(cfg, mtp=False))
    for name in ("embed_tokens.weight", "layers.1.ple.key_proj.weight", "layers.7.mlp.experts.15.down_proj.weight",
                 "lm_head.weight", "layers.0.linear_attn.A_log"):
        np.testing.assert_array_equal(t.read(name), r.read(name))  # same seed: same bytes whatever the layout


def test_sharded_equals_single_file(dirs):
    s, m = Checkpoint.open(dirs["bf16_sharded"]), Checkpoint.open(dirs["bf16"])
    assert len(s.files) > 2 and len(m.files) == 1
    index = json.load(open(os.path.join(dirs["bf16_sharded"], "model.safetensors.index.json")))
    assert index["metadata"]["total_size"] == sum(os.path.getsize(f) - 8 - struct.unpack(
        "<Q", open(f, "rb").read(8))[0] for f in s.files)
    for name in m.names():
        np.testing.assert_array_equal(s.read(name), m.read(name))


def test_read_is_a_memory_map_and_location_is_exact(dirs):
    c = Checkpoint.open(dirs["bf16_sharded"])
    arr = c.read("layers.2.mlp.experts.3.gate_proj.weight")
    assert arr.dtype == ml_dtypes.bfloat16 and not arr.flags.writeable and not arr.flags.owndata
    path, offset, nbytes, dt, shape = c.location("layers.2.mlp.experts.3.gate_proj.weight")
    assert (dt, shape, nbytes) == ("BF16", arr.shape, arr.nbytes)
    with open(path, "rb") as f:
        assert os.pread(f.fileno(), nbytes, offset) == arr.tobytes()
    with pytest.raises(CheckpointError, match="expected \\[1, 2\\]"):
        c.read("lm_head.weight", shape=(1, 2))
    with pytest.raises(CheckpointError, match="expected F32"):
        c.read("lm_head.weight", dtype=np.float32)
    assert c.read("lm_head.weight", shape=c.info("lm_head.weight").shape, dtype="BF16").shape[1] == 64
    with pytest.raises(CheckpointError, match="no tensor 'model.language_model.nope'"):
        c.read("nope")


def test_transformers_save_pretrained_names_are_expected_tensors(tmp_path, cfg):
    """The single source of truth agrees with the reference's own writer (text layout)."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(0)
    Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**synthetic.hf_text_config(cfg))).save_pretrained(tmp_path)
    c = Checkpoint.open(tmp_path)  # float32 tensors: dense dtypes are interchangeable
    assert c.layout == "text" and set(c.names()) == set(ck.expected_tensors(cfg, mtp=False))
    assert c.info("embed_tokens.weight").dtype == "F32"


# ----- quantized -----------------------------------------------------------------------------------------------
def test_nvfp4_mixed_precision(dirs, cfg):
    n, b = Checkpoint.open(dirs["nvfp4"]), Checkpoint.open(dirs["bf16"])
    assert n.quant.algo == "MIXED_PRECISION" and n.quant.source.endswith("config.json")
    assert n.quant.algo_of("layers.5.mlp.experts.2.up_proj") == "NVFP4"
    assert n.quant.algo_of("mtp.layers.0.mlp.experts.2.up_proj") == "FP8_PB_WO"
    assert n.quant.algo_of("layers.1.ple.ple_embedding.ngram_embedding") == "FP8"
    assert n.quant.algo_of("layers.5.mlp.shared_expert.up_proj") is None
    assert n.quant.algo_of("lm_head") is None
    w = n.read_expert(5, 2, "up_proj")
    assert isinstance(w, q.NVFP4Weight) and len(w) == 3
    assert w.weight.dtype == np.uint8 and w.weight.shape == (32, 32)  # [I, H/2]
    assert w.weight_scale.dtype == ml_dtypes.float8_e4m3fn and w.weight_scale.shape == (32, 4)
    dense = b.read_expert(5, 2, "up_proj").astype(np.float32)  # the same seed: the weights it quantized
    np.testing.assert_array_equal(w.dequantize(), q.quantize_nvfp4(dense).as_weight().dequantize())
    m = n.read_expert("mtp", 1, "down_proj")
    assert isinstance(m, q.FP8BlockWeight) and m.scale.shape == (1, 1)
    dense = b.read_expert("mtp", 1, "down_proj").astype(np.float32)
    assert np.abs(m.dequantize() - dense).max() <= np.abs(dense).max() * 2**-4
    assert isinstance(n.read_linear("layers.0.linear_attn.in_proj_qkv"), np.ndarray)
    with pytest.raises(ValueError):
        n.read_expert(8, 0, "gate_proj")
    with pytest.raises(ValueError):
        n.read_expert(0, 16, "gate_proj")
    with pytest.raises(ValueError):
        n.read_expert(0, 0, "fc1")


def _plain_nvfp4(src, dst, ignore):
    """A plain (non-mixed) NVFP4 checkpoint: every routed expert quantized, the rest BF16."""
    def mutate(t):
        for name in [k for k in t if ".mlp.experts." in k and k.endswith(".weight")]:
            out = q.quantize_nvfp4(t[name].astype(np.float32))
            base = name[: -len(".weight")]
            t[name], t[base + ".weight_scale"] = out.weight, out.weight_scale
            t[base + ".weight_scale_2"], t[base + ".input_scale"] = out.weight_scale_2, out.input_scale
    return clone(src, dst, mutate, config=lambda raw: raw.update(quantization_config={
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ignore}))


IGNORE_ALL_BUT_EXPERTS = ["lm_head", "model.language_model.embed_tokens", "*self_attn*", "*linear_attn*",
                          "*.mlp.gate", "*shared_expert*", "*hyper_connection*", "*.ple.*", "mtp.fc_*",
                          "model.visual*"]


def test_plain_nvfp4_and_legacy_config(dirs, tmp_path):
    d = _plain_nvfp4(dirs["bf16"], tmp_path / "plain", IGNORE_ALL_BUT_EXPERTS)
    c = Checkpoint.open(d)
    assert c.quant.algo == "NVFP4" and c.quant.group_size == 16
    assert isinstance(c.read_expert(0, 0, "gate_proj"), q.NVFP4Weight)
    assert isinstance(c.read_expert("mtp", 0, "gate_proj"), q.NVFP4Weight)
    assert c.quant.scheme("layers.3.self_attn.q_proj") is None

    # the same quantization declared only in the legacy hf_quant_config.json
    legacy = clone(d, tmp_path / "legacy", config=lambda raw: raw.pop("quantization_config"))
    json.dump({"producer": {"name": "modelopt", "version": "0.37"},
               "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                "exclude_modules": IGNORE_ALL_BUT_EXPERTS}},
              open(os.path.join(legacy, "hf_quant_config.json"), "w"))
    c2 = Checkpoint.open(legacy)
    assert c2.quant.algo == "NVFP4" and c2.quant.source.endswith("hf_quant_config.json")
    np.testing.assert_array_equal(c2.read_expert(0, 0, "gate_proj").dequantize(),
                                  c.read_expert(0, 0, "gate_proj").dequantize())

    # ... or nested in text_config
    nested = clone(d, tmp_path / "nested", config=lambda raw: raw["text_config"].update(
        quantization_config=raw.pop("quantization_config")))
    assert Checkpoint.open(nested).quant.algo == "NVFP4"


def test_quant_config_queries():
    qc = QuantConfig.from_dict({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                "quantized_layers": {
                                    "model.language_model.layers.0.mlp.experts": {"quant_algo": "NVFP4",
                                                                                  "group_size": 16},
                                    "model.language_model.layers.*.mlp.shared_expert.*": {"quant_algo": "FP8"},
                                    "mtp.layers.0.mlp.experts": {"quant_algo": "FP8_BLOCK_SCALES",
                                                                 "group_size": 128}},
                                "ignore": ["model.language_model.layers.0.mlp.experts.3*"]}, "cfg.json")
    assert qc.scheme("layers.0.mlp.experts.1.gate_proj") == ("NVFP4", 16)
    assert qc.scheme("layers.0.mlp.experts.3.gate_proj") is None  # ignored
    assert qc.scheme("layers.1.mlp.experts.1.gate_proj") is None  # not listed
    assert qc.scheme("layers.4.mlp.shared_expert.up_proj") == ("FP8", 0)  # glob key
    assert qc.scheme("mtp.layers.0.mlp.experts.9.down_proj") == ("FP8_PB_WO", 128)  # alias
    assert QuantConfig.from_dict(qc.to_dict(), "x").quantized_layers == qc.quantized_layers
    assert QuantConfig.from_legacy(qc.to_legacy_dict(), "x").ignore == qc.ignore


@pytest.mark.parametrize("bad, match", [
    ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "unknown quant_algo 'INT4_AWQ'"),
    ({"quant_method": "gptq", "bits": 4}, "unsupported quantization quant_method 'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.language_model.layers.0.mlp.experts": {"quant_algo": "MXFP4"}}},
     "unknown quant_algo 'MXFP4' for model.language_model.layers.0.mlp.experts"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "defined with 16"),
])
def test_unknown_quantization_is_a_clear_error(dirs, tmp_path, bad, match):
    d = clone(dirs["bf16"], tmp_path / "q", config=lambda raw: raw.update(quantization_config=bad))
    with pytest.raises(CheckpointError, match=match) as e:
        Checkpoint.open(d)
    assert "config.json" in str(e.value)


def test_weight_scale_inv_is_read_as_the_multiplier(dirs, tmp_path):
    def rename(t):
        for k in [k for k in t if k.startswith("mtp.") and k.endswith(".weight_scale") and "experts" in k]:
            t[k + "_inv"] = t.pop(k)
    d = clone(dirs["nvfp4"], tmp_path / "inv", rename)
    a, b = Checkpoint.open(d).read_expert("mtp", 4, "up_proj"), Checkpoint.open(dirs["nvfp4"]).read_expert(
        "mtp", 4, "up_proj")
    np.testing.assert_array_equal(a.dequantize(), b.dequantize())

    def reciprocal(t):  # the other convention (448 / amax) is refused, not silently misread
        for k in [k for k in t if k.startswith("mtp.") and k.endswith(".weight_scale") and "experts" in k]:
            t[k + "_inv"] = (1 / t.pop(k)).astype(np.float32)
    d = clone(dirs["nvfp4"], tmp_path / "recip", reciprocal)
    with pytest.raises(CheckpointError, match="weight_scale_inv.*dequantization multipliers"):
        Checkpoint.open(d).read_expert("mtp", 4, "up_proj")


# ----- n-gram table --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "nvfp4", "text"])
def test_ngram_gather_across_shards(dirs, cfg, kind):
    c = Checkpoint.open(dirs[kind])
    t = c.read_ngram_table()
    assert t.shape == (cfg.ngram_table_rows(), cfg.ngram_head_dim) and t.parts == cfg.split_ngram_parts
    assert all(not s.flags.owndata for s in t.shards)  # views of the files, never a concatenated copy
    full = np.concatenate([np.asarray(s, np.float32) for s in t.shards])  # fine for the tiny table
    if kind == "nvfp4":
        assert t.dtype == ml_dtypes.float8_e4m3fn
        assert t.scale == pytest.approx(synthetic.NGRAM_CLIP / 448)
        full *= np.float32(t.scale)
    else:
        assert t.scale is None and t.dtype == ml_dtypes.bfloat16
    r = t.rows_per_shard
    ids = np.array([[r - 1, r, 0], [t.rows - 1, 2 * r + 5, r - 1]])
    np.testing.assert_array_equal(t.gather(ids), full[ids])
    assert t.gather_raw(ids).dtype == t.dtype and t[ids].shape == (2, 3, cfg.ngram_head_dim)
    name, offset, nbytes, dt, shape = t.locations[1]
    assert nbytes == r * t.dim * t.dtype.itemsize and shape == (r, t.dim)
    with pytest.raises(IndexError):
        t.gather(np.array([t.rows]))
    if kind == "nvfp4":  # dequantization is fp8 * the one global scale
        np.testing.assert_array_equal(t.gather(ids), t.gather_raw(ids).astype(np.float32) * np.float32(t.scale))


def test_ple_buffer_mismatch(dirs, tmp_path):
    def bump(t):
        t["model.language_model.layers.1.ple.ple_embedding.layer_multipliers"][0] += 2
    d = clone(dirs["bf16"], tmp_path / "ple", bump)
    with pytest.raises(CheckpointError, match="layer_multipliers.*disagree on the n-gram hash"):
        Checkpoint.open(d)


# ----- errors --------------------------------------------------------------------------------------------------
def _expect_error(d, *needles):
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    for n in needles:
        assert str(n) in str(e.value), (n, str(e.value))
    return str(e.value)


def test_missing_tensor(dirs, tmp_path):
    name = "model.language_model.layers.2.linear_attn.in_proj_z.weight"
    d = clone(dirs["bf16"], tmp_path / "m", lambda t: t.pop(name))
    _expect_error(d, f"missing tensor {name!r}", os.path.join(d, "model.safetensors"))


def test_wrong_shape_and_dtype(dirs, tmp_path):
    n1, n2 = "model.language_model.layers.0.linear_attn.out_proj.weight", "mtp.fc_hidden.weight"

    def mutate(t):
        t[n1] = t[n1][:, :-1].copy()
        t[n2] = t[n2].view(np.int16)
    d = clone(dirs["bf16"], tmp_path / "s", mutate)
    msg = _expect_error(d, n1, "has shape [64, 63], expected [64, 64]", n2, "has dtype I16, expected BF16",
                        os.path.join(d, "model.safetensors"))
    assert msg.count("model.safetensors") >= 2


def test_quantized_tensor_with_wrong_dtype(dirs, tmp_path):
    name = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_scale"
    d = clone(dirs["nvfp4"], tmp_path / "q", lambda t: t.__setitem__(name, t[name].view(np.uint8)))
    _expect_error(d, name, "dtype U8, expected F8_E4M3")


def test_truncated_file(dirs, tmp_path):
    d = clone(dirs["bf16"], tmp_path / "t")
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    _expect_error(d, "truncated", path, "tensor ")


def test_corrupt_headers(dirs, tmp_path):
    d = clone(dirs["bf16"], tmp_path / "c")
    path = os.path.join(d, "model.safetensors")
    blob = bytearray(open(path, "rb").read())
    (n,) = struct.unpack("<Q", blob[:8])
    open(path, "wb").write(blob[:8] + b"{not json" + blob[17:])
    _expect_error(d, "corrupt safetensors header", path)
    open(path, "wb").write(struct.pack("<Q", 1 << 40) + blob[8:])
    _expect_error(d, "corrupt safetensors header", path)
    open(path, "wb").write(b"\x01\x02")
    _expect_error(d, "truncated", path)
    # a header entry whose offsets disagree with its shape
    header = json.loads(bytes(blob[8:8 + n]))
    key = "model.language_model.embed_tokens.weight"
    header[key]["shape"] = [3, 3]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    _expect_error(d, key, path, "needs 18")


def test_index_naming_a_missing_shard(dirs, tmp_path):
    d = tmp_path / "sh"
    shutil.copytree(dirs["bf16_sharded"], d)
    index = json.load(open(d / "model.safetensors.index.json"))
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(d / victim)
    _expect_error(str(d), "is missing", victim)


def test_index_naming_a_tensor_its_shard_lacks(dirs, tmp_path):
    d = tmp_path / "sh2"
    shutil.copytree(dirs["bf16_sharded"], d)
    index = json.load(open(d / "model.safetensors.index.json"))
    index["weight_map"]["model.language_model.ghost.weight"] = sorted(set(index["weight_map"].values()))[0]
    json.dump(index, open(d / "model.safetensors.index.json", "w"))
    _expect_error(str(d), "ghost", "does not contain it")


def test_layout_mismatch(dirs, tmp_path):
    # a text-layout config.json in front of release-layout tensors
    def flatten(raw):
        text = raw.pop("text_config")
        raw.clear()
        raw.update(text)
    d = clone(dirs["bf16"], tmp_path / "l", config=flatten)
    _expect_error(d, "text layout", "prefix 'model.language_model.'")


def test_no_weights(tmp_path, dirs):
    shutil.copy(os.path.join(dirs["bf16"], "config.json"), tmp_path)
    _expect_error(str(tmp_path), "no model.safetensors")


# ----- writer and progress -------------------------------------------------------------------------------------
def test_safetensors_writer_round_trip_and_checks(tmp_path):
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1.5, -2], ml_dtypes.bfloat16),
         "c": np.array([448, -0.5], np.float32).astype(ml_dtypes.float8_e4m3fn), "s": np.float32(3)[()],
         "i": np.array([1, 2, 3], np.int64)}
    path = str(tmp_path / "x.safetensors")
    ck.write_safetensors(path, {k: np.asarray(v) for k, v in t.items()})
    f = ck.SafetensorsFile(path)
    for k, v in t.items():
        got = f.array(f.tensors[k])
        assert got.dtype == np.asarray(v).dtype and got.shape == np.asarray(v).shape
        np.testing.assert_array_equal(got.astype(np.float64), np.asarray(v).astype(np.float64))
    assert (8 + struct.unpack("<Q", open(path, "rb").read(8))[0]) % 8 == 0  # data starts 8-byte aligned
    w = ck.SafetensorsWriter(str(tmp_path / "y.safetensors"), [("a", "F32", (2,)), ("b", "F32", (1,))])
    with pytest.raises(CheckpointError, match="out of plan order"):
        w.write("b", np.zeros(1, np.float32))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match="not fully written"):
        w.close()


def test_progress_counts_bytes(dirs, capsys):
    c = Checkpoint.open(dirs["bf16"])
    names = c.names()[:5]
    assert list(c.progress(names, disable=True)) == names
    seen = list(ck.progress_bytes([1, 2, 3], lambda x: 10 * x, desc="t", disable=False))
    assert seen == [1, 2, 3] and "60.0/60.0" in capsys.readouterr().err
    list(ck.progress_bytes([1, 2, 3], lambda x: 10 * x, desc="t"))  # default: quiet when stderr is no TTY
    assert capsys.readouterr().err == ""


def test_extra_tensors_are_tolerated(dirs, tmp_path):
    # docs/model.md §11: the MTP mixer may carry a block_inject_weight that nothing uses
    def add(t):
        t["mtp.hyper_connection_mixer.block_inject_weight.weight"] = np.zeros((4, 256), ml_dtypes.bfloat16)
        t["something.else"] = np.zeros(2, np.float32)
    c = Checkpoint.open(clone(dirs["bf16"], tmp_path / "x", add))
    assert sorted(c.extras()) == ["mtp.hyper_connection_mixer.block_inject_weight.weight", "something.else"]
