"""PLE host step: n-gram ids against transformers' Qwen4ExpTextNGramEmbedding, rows against the table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

from jaxflash import ffi as F
from jaxflash import presets
from jaxflash.ffi.reference import ngram_ids_reference
from test_ffi_support import SafetensorsIndex

EOS = 7


class _IdsOut(torch.nn.Module):
    """Stands in for the reference's nn.Embedding so its forward returns the n-gram ids themselves."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, ids):
        return ids.unsqueeze(-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = presets.tiny(vocab_size=512, eos_token_id=EOS)
    ref = Qwen4ExpTextNGramEmbedding(Qwen4ExpTextConfig(**cfg.to_text_config_dict()), cfg.ple_embed_dim, 1, 0)
    torch.nn.init.normal_(ref.ngram_embedding.weight)
    ref_ids = Qwen4ExpTextNGramEmbedding(Qwen4ExpTextConfig(**cfg.to_text_config_dict()), cfg.ple_embed_dim, 1, 0)
    ref_ids.ngram_embedding = _IdsOut(ref.ngram_embedding.weight)
    weight = ref.ngram_embedding.weight.detach().numpy()
    path = tmp_path_factory.mktemp("ple") / "ple.safetensors"
    save_file({"layers.1.ple.ple_embedding.ngram_embedding.weight": weight}, str(path))
    table = F.NgramTable.from_checkpoint(SafetensorsIndex([path]), cfg, max_tokens=256)
    yield cfg, ref, ref_ids, weight, table
    table.close()


def _ref_ids(ref_ids, tokens):
    with torch.no_grad():
        return ref_ids(torch.as_tensor(np.asarray(tokens), dtype=torch.long), None).numpy()


def _step(cfg, table, tokens, ctx=None, **kw):
    tokens = jnp.asarray(tokens, jnp.int32)
    if ctx is None:
        ctx = F.ngram_context_init(tokens.shape[0], cfg.eos_token_id)
    return F.ple_step(tokens, ctx, table, F.NgramHash.from_config(cfg), **kw)


def _tokens_with_eos(rng, B, T, vocab, p_eos=0.15):
    t = rng.integers(0, vocab, (B, T)).astype(np.int32)
    t[rng.random((B, T)) < p_eos] = EOS
    return t


def test_ids_and_rows_match_reference(setup):
    cfg, ref, ref_ids, weight, table = setup
    rng = np.random.default_rng(0)
    tokens = _tokens_with_eos(rng, 3, 40, cfg.vocab_size)
    tokens[0, :3] = EOS  # EOS runs, at the start, mid-sequence (random) and at the end
    tokens[1, -1] = EOS
    tokens[2, 10:12] = EOS
    out = _step(cfg, table, tokens)
    np.testing.assert_array_equal(np.asarray(out.ids), _ref_ids(ref_ids, tokens))
    h = F.NgramHash.from_config(cfg)
    py_ids, _ = ngram_ids_reference(tokens, F.ngram_context_init(3, EOS), eos=EOS, multipliers=h.multipliers,
                                    head_sizes=h.head_sizes, head_offsets=h.head_offsets)
    np.testing.assert_array_equal(py_ids, _ref_ids(ref_ids, tokens))  # the Python reference is the spec too
    rows = np.asarray(out.rows)
    assert rows.dtype == np.float32 and rows.shape == (3, 40, 16, 4)
    np.testing.assert_array_equal(rows, weight[np.asarray(out.ids)])
    with torch.no_grad():
        emb = ref(torch.as_tensor(tokens, dtype=torch.long), None).numpy()
    np.testing.assert_array_equal(rows.reshape(3, 40, -1), emb)
    np.testing.assert_array_equal(np.asarray(out.context), tokens[:, -2:])
    assert np.asarray(out.info).tolist() == [0, 0]


@pytest.mark.parametrize("cuts", [[1, 2, 3, 4, 5], [7, 1, 13, 1, 1, 2], [30], [2, 28]])
def test_context_carries_over_calls(setup, cuts):
    """Calls of any sizes (decode steps of 1 token included) give the ids of one long call."""
    cfg, _, ref_ids, _, table = setup
    rng = np.random.default_rng(sum(cuts) + len(cuts))
    tokens = _tokens_with_eos(rng, 2, sum(cuts), cfg.vocab_size)
    whole = _ref_ids(ref_ids, tokens)
    step = jax.jit(lambda t, c: _step(cfg, table, t, c), donate_argnums=1)
    ctx = jnp.asarray(F.ngram_context_init(2, EOS))
    parts, at = [], 0
    for n in cuts:
        out = step(tokens[:, at : at + n], ctx)
        ctx = out.context
        parts.append(np.asarray(out.ids))
        at += n
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_batch_rows_are_independent_and_reset_starts_afresh(setup):
    cfg, _, ref_ids, _, table = setup
    rng = np.random.default_rng(4)
    a = _tokens_with_eos(rng, 1, 12, cfg.vocab_size, p_eos=0.0)
    b = _tokens_with_eos(rng, 1, 12, cfg.vocab_size, p_eos=0.0)
    first = _step(cfg, table, np.concatenate([a[:, :6], b[:, :6]]))
    # Row 0 continues its sequence, row 1 starts a new request.
    c = _tokens_with_eos(rng, 1, 6, cfg.vocab_size, p_eos=0.0)
    second = _step(cfg, table, np.concatenate([a[:, 6:], c]), first.context, reset=np.array([0, 1]))
    np.testing.assert_array_equal(np.asarray(second.ids)[0], _ref_ids(ref_ids, a)[0, 6:])
    np.testing.assert_array_equal(np.asarray(second.ids)[1], _ref_ids(ref_ids, c)[0])
    np.testing.assert_array_equal(np.asarray(second.context), [a[0, -2:], c[0, -2:]])


def test_lengths_pad_with_eos_and_keep_the_true_context(setup):
    cfg, _, ref_ids, _, table = setup
    rng = np.random.default_rng(5)
    tokens = _tokens_with_eos(rng, 3, 10, cfg.vocab_size, p_eos=0.0)
    lengths = np.array([10, 4, 0], np.int32)
    garbage = tokens.copy()
    garbage[1, 4:] = 511
    garbage[2, :] = 3
    out = _step(cfg, table, garbage, lengths=lengths)
    padded = tokens.copy()
    padded[1, 4:] = EOS
    padded[2, :] = EOS
    np.testing.assert_array_equal(np.asarray(out.ids), _ref_ids(ref_ids, padded))
    np.testing.assert_array_equal(np.asarray(out.context), [tokens[0, -2:], tokens[1, 2:4], [EOS, EOS]])
    h = F.NgramHash.from_config(cfg)
    py_ids, py_ctx = ngram_ids_reference(garbage, F.ngram_context_init(3, EOS), eos=EOS, multipliers=h.multipliers,
                                         head_sizes=h.head_sizes, head_offsets=h.head_offsets, lengths=lengths)
    np.testing.assert_array_equal(py_ids, np.asarray(out.ids))
    np.testing.assert_array_equal(py_ctx, np.asarray(out.context))
    # One token: the context shifts by one.
    one = _step(cfg, table, np.array([[9], [8], [6]], np.int32), out.context, lengths=np.array([1, 1, 0]))
    np.testing.assert_array_equal(np.asarray(one.context), [[tokens[0, -1], 9], [tokens[1, 3], 8], [EOS, EOS]])


def test_fp8_sharded_table(tmp_path):
    """The FP8 release layout: shard_{i}.weight F8_E4M3 in several files; rows come back as float8 bytes."""
    cfg = presets.tiny(vocab_size=512, eos_token_id=EOS)
    rows_total, parts = cfg.ngram_table_rows(), cfg.split_ngram_parts
    per = rows_total // parts
    rng = np.random.default_rng(6)
    full = rng.integers(0, 0x7F, (rows_total, cfg.ngram_head_dim), dtype=np.uint8)
    paths = []
    for i in range(parts):
        path = tmp_path / f"shard{i}.safetensors"
        save_file({f"layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight":
                   full[i * per : (i + 1) * per].view(ml_dtypes.float8_e4m3fn)}, str(path))
        paths.append(path)
    with F.NgramTable.from_checkpoint(SafetensorsIndex(paths), cfg) as table:
        assert table.rows == rows_total and table.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
        tokens = rng.integers(0, cfg.vocab_size, (2, 33)).astype(np.int32)
        out = _step(cfg, table, tokens)
        assert out.rows.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(out.rows).view(np.uint8), full[np.asarray(out.ids)])
        np.testing.assert_array_equal(table.lookup(np.asarray(out.ids)[0, :3]).view(np.uint8),
                                      full[np.asarray(out.ids)[0, :3]])


def test_full_model_hash_constants():
    """Multipliers and head sizes of the real config (docs/model.md §6.1) reach the handler unchanged."""
    h = F.NgramHash.from_config(presets.full())
    assert h.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert h.head_sizes[0] == 20000003 and h.head_sizes[-1] == 20000171 and h.heads == 16


@pytest.mark.parametrize("bad,msg", [(512, "token id 512 is out of range"), (-3, "token id -3 is out of range")])
def test_bad_tokens_raise(setup, bad, msg):
    cfg, _, _, _, table = setup
    tokens = np.array([[1, 2, bad]], np.int32)
    with pytest.raises(Exception, match=msg):
        jax.block_until_ready(_step(cfg, table, tokens))


def test_bad_lengths_and_context_raise(setup):
    cfg, _, _, _, table = setup
    with pytest.raises(Exception, match="sequence length 5 is out of range"):
        jax.block_until_ready(_step(cfg, table, np.ones((1, 3), np.int32), lengths=np.array([5])))
    with pytest.raises(Exception, match="context holds token id 9999"):
        jax.block_until_ready(_step(cfg, table, np.ones((1, 3), np.int32), np.array([[1, 9999]], np.int32)))
    with pytest.raises(F.PleError, match="token id 600 is out of range"):
        F.check_ple_info(np.array([4, 600]))


def test_closed_table_is_refused(setup, tmp_path):
    cfg, _, _, weight, _ = setup
    path = tmp_path / "t.safetensors"
    save_file({"layers.1.ple.ple_embedding.ngram_embedding.weight": weight}, str(path))
    table = F.NgramTable.from_checkpoint(SafetensorsIndex([path]), cfg)
    table.close()
    with pytest.raises(ValueError, match="table is closed"):
        _step(cfg, table, np.ones((1, 2), np.int32))
