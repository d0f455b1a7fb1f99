"""jaxflash.export: parameters back to the real checkpoint layouts. Loading a synthetic BF16 checkpoint and
exporting it must give the same tensors; exporting it as NVFP4 must give exactly what the synthetic NVFP4
writer produces from the same weights."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jaxflash
from jaxflash.checkpoint import Checkpoint
from jaxflash.export import save_checkpoint
from jaxflash.synthetic import make_model
from jaxflash.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return {q: make_model("tiny", q, 5, str(root / q), progress=False) for q in ("bf16", "nvfp4")}


def test_bf16_round_trip(made, tmp_path):
    src = jaxflash.load(made["bf16"], dtype="float32", ple_table="device", progress=False)
    out = save_checkpoint(str(tmp_path / "bf16"), src.config, src.params, quant="bf16")
    a, b = Checkpoint.open(made["bf16"]), Checkpoint.open(out)
    assert b.layout == "release" and b.has_mtp
    for name in a.expected():
        np.testing.assert_array_equal(np.asarray(a.read(name)), np.asarray(b.read(name)), err_msg=name)
    s = np.arange(50) % src.config.vocab_size
    np.testing.assert_array_equal(src.logits(s), jaxflash.load(out, progress=False).logits(s))


def test_nvfp4_matches_the_synthetic_writer(made, tmp_path):
    from tokenizers import Tokenizer as HFTok

    src = jaxflash.load(made["bf16"], dtype="float32", ple_table="device", progress=False)
    tok = HFTok.from_file(f"{made['bf16']}/tokenizer.json")
    out = save_checkpoint(str(tmp_path / "nv"), src.config, src.params, quant="nvfp4", tokenizer=tok)
    a, b = Checkpoint.open(made["nvfp4"]), Checkpoint.open(out)
    assert b.quant.algo_of("layers.0.mlp.experts") == "NVFP4"
    for name in a.expected():
        if "ngram_embedding" in name:
            continue  # the writer uses a preset FP8 scale, export the table's amax (both ModelOpt-valid)
        x, y = np.asarray(a.read(name)), np.asarray(b.read(name))
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    exact = Checkpoint.open(made["bf16"]).read_ngram_table()
    ids = np.arange(exact.rows)
    tb = b.read_ngram_table()
    assert tb.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    # e4m3 has 3 mantissa bits: within half a step (1/16 relative) of the bf16 table, or of subnormal size
    np.testing.assert_allclose(tb.gather(ids), exact.gather(ids), rtol=1 / 16, atol=2.0**-9 * tb.scale)
    assert Tokenizer(out).encode("hello world") == Tokenizer(made["bf16"]).encode("hello world")
