"""The user-facing model object: load a checkpoint, run full-sequence logits (and MTP drafts) on batches.

    engine = jaxflash.load("path/to/checkpoint", dtype="float32")
    logits = engine.logits([1, 2, 3])               # [T, vocab] float32
    many = engine.logits([[1, 2, 3], [4, 5]])       # one array per sequence

Ragged batches are right-padded to a shared bucket length and run as one batch: every layer is causal, so the
padding never changes the logits of real tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .checkpoint import Checkpoint
from .config import ModelConfig
from .model import mtp as mtp_mod
from .model import ple as ple_mod
from .model import transformer
from .model.weights import load_params

# The model bundled with the package: what every tool uses when given no --model.
DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "default_model"

# A table up to this size goes to the device; a larger one (the real 48 GiB one) stays memory-mapped on the host.
DEVICE_TABLE_MAX_BYTES = 1 << 30


def _bucket(n: int) -> int:
    """Sequence lengths are padded to a few sizes so that ragged inputs reuse compiled programs."""
    return max(16, 1 << (n - 1).bit_length()) if n <= 1024 else -(-n // 1024) * 1024


class Engine:
    def __init__(self, config: ModelConfig, params: transformer.Params, host_table=None,
                 checkpoint: Checkpoint | None = None):
        self.config, self.params, self.host_table, self.checkpoint = config, params, host_table, checkpoint
        self._hidden = jax.jit(lambda p, t, rows: transformer.forward_hidden(p, config, t, ple_rows=rows))
        self._logits = jax.jit(lambda p, t, rows: transformer.forward(p, config, t, ple_rows=rows))
        self._mtp = jax.jit(lambda p, h, nxt: mtp_mod.mtp_forward(p, config, h, nxt))

    @property
    def dtype(self):
        return self.params.dtype

    # ----- inputs -------------------------------------------------------------------------------------------
    def _batch(self, tokens) -> tuple[np.ndarray, list[int], bool]:
        """(padded [B, L] int32 batch, lengths, whether a single sequence was given)."""
        if isinstance(tokens, np.ndarray | jax.Array) and np.ndim(tokens) == 1 or (
                isinstance(tokens, list | tuple) and tokens and np.isscalar(tokens[0])):
            seqs, single = [np.asarray(tokens)], True
        else:
            seqs, single = [np.asarray(s) for s in tokens], False
        if not seqs or any(s.ndim != 1 or s.size == 0 for s in seqs):
            raise ValueError("tokens must be a non-empty sequence of token ids, or a list of such sequences")
        for s in seqs:
            if s.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got dtype {s.dtype}")
            if s.min() < 0 or s.max() >= self.config.vocab_size:
                raise ValueError(f"token id out of range [0, {self.config.vocab_size}): "
                                 f"min {s.min()}, max {s.max()}")
        lengths = [len(s) for s in seqs]
        batch = np.zeros((len(seqs), _bucket(max(lengths))), np.int32)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = s
        return batch, lengths, single

    def ple_rows(self, batch: np.ndarray):
        """Host-side n-gram rows of a [B, T] batch when the table lives on the host; None when it is on the
        device (the model gathers the rows itself)."""
        if self.host_table is None:
            return None
        ids, _ = ple_mod.ngram_ids(self.config, batch)
        return jnp.asarray(self.host_table.gather(ids, np.float32))

    # ----- outputs ------------------------------------------------------------------------------------------
    def logits(self, tokens):
        """float32 logits [T, vocab] for one sequence, or a list of them for a list of sequences."""
        batch, lengths, single = self._batch(tokens)
        out = self._logits(self.params, jnp.asarray(batch), self.ple_rows(batch))
        out = np.asarray(out)
        res = [out[i, :n] for i, n in enumerate(lengths)]
        return res[0] if single else res

    def hidden(self, tokens):
        """The pre-mixer multi-stream state [T, W] float32 (per sequence), what the MTP head reads."""
        batch, lengths, single = self._batch(tokens)
        out = np.asarray(self._hidden(self.params, jnp.asarray(batch), self.ple_rows(batch)))
        res = [out[i, :n] for i, n in enumerate(lengths)]
        return res[0] if single else res

    def mtp_logits(self, tokens):
        """MTP draft logits [T-1, vocab] of one sequence: row t predicts token t+2 from the main model's state at
        t and token t+1 (teacher-forced over the sequence)."""
        if self.params.mtp is None:
            raise ValueError("this checkpoint has no MTP head (no mtp.* tensors)")
        batch, lengths, single = self._batch(tokens)
        if min(lengths) < 2:
            raise ValueError("MTP needs sequences of at least 2 tokens")
        h = self._hidden(self.params, jnp.asarray(batch), self.ple_rows(batch))
        nxt = jnp.asarray(np.concatenate([batch[:, 1:], batch[:, -1:]], axis=1))
        out, _ = self._mtp(self.params, h, nxt)
        out = np.asarray(out)
        res = [out[i, : n - 1] for i, n in enumerate(lengths)]
        return res[0] if single else res


def _weights_bar(ckpt: Checkpoint, show: bool | None):
    """A byte-counting progress bar over the weights load_params reads (the n-gram table is read separately)."""
    from tqdm.auto import tqdm

    total = sum(ckpt.info(n).nbytes for n in ckpt.expected() if "ngram_embedding" not in n)
    return tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if show is None else not show, dynamic_ncols=True)


def load(path: str | os.PathLike | None = None, dtype: str = "float32", *, ple_table: str = "auto",
         device=None, progress: bool | None = None) -> Engine:
    """Open a checkpoint (default: the bundled model) and load it for `dtype` ("float32" or "bfloat16").

    ple_table: "device" puts the n-gram table in device memory; "host" leaves it memory-mapped on the host and
    gathers the rows each call needs; "auto" picks "device" for tables up to 1 GiB.
    Weights go to the device layer by layer, so host memory holds at most one layer at a time.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if ple_table not in ("auto", "device", "host"):
        raise ValueError(f"ple_table must be 'auto', 'device' or 'host', got {ple_table!r}")
    ckpt = Checkpoint.open(DEFAULT_MODEL if path is None else path)
    cfg = ckpt.config
    table = ckpt.read_ngram_table() if cfg.ple_layer_ids else None
    on_device = None
    if table is not None:
        nbytes = table.rows * table.dim * table.dtype.itemsize
        if ple_table == "device" or (ple_table == "auto" and nbytes <= DEVICE_TABLE_MAX_BYTES):
            on_device = (table.gather_raw(np.arange(table.rows)), table.scale)
            table = None
    with _weights_bar(ckpt, progress) as bar:
        params = load_params(ckpt, cfg, dtype, ple_table=on_device, device=device,
                             on_read=lambda name: bar.update(ckpt.info(name).nbytes))
        bar.update(bar.total - bar.n)  # what was not read: input_scale, the PLE hash buffers
    return Engine(cfg, params, host_table=table, checkpoint=ckpt)
