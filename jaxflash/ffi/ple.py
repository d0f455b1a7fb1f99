"""The PLE host step (docs/model.md §6): n-gram ids of a step's tokens and their rows from the memory-mapped table.

Per sequence b the context ctx[b] = the last two token ids seen (initially [eos, eos]); the step hashes
hist = [ctx[b], tokens[b, :lengths[b]]] exactly as docs/model.md §6.2 says (shift k valid iff no EOS in [t-k, t-1],
invalid shifts and padded positions read as EOS) into 16 ids per token, gathers each id's row from the table
and returns the new context. reset[b] != 0 starts sequence b afresh (context [eos, eos]) -- a new request in
a batch slot. Rows come back in the table's dtype (float8_e4m3fn for the FP8 release: multiply by the global
`weight_scale` in the model).

The table (48 GiB for the real model) is never made resident: each shard file region is mmap'ed read-only with
MADV_RANDOM and only the looked-up rows are faulted in.

On the GPU the step is a host step inside the captured XLA program: the handler enqueues, on XLA's stream,
D2H copies of tokens/lengths/reset/context into a pinned staging area owned by the table, a host node
(cudaLaunchHostFunc) that hashes and copies the rows into staging, and H2D copies of ids, rows, context and
info. The host node runs on every replay of the graph and sees that replay's tokens; nothing waits on the
host. Keep the step's token input at a stable address (e.g. a donated buffer the previous step wrote) so XLA
need not re-record the graph. The staging area is shared by all calls on one table, so use a table from one
device/stream at a time, and at most `max_tokens` tokens per call.

Errors (a token id outside [0, vocab), a length outside [0, T], a corrupt context) raise on the CPU; on the GPU
they set info = (status, detail), keep the context, and point every id at row 0: call `check_ple_info`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _ext
from .cache import ExpertCacheError
from .experts import normalize_dtype


class PleError(ExpertCacheError):
    """A PLE step reported an error through its info output."""


@dataclass(frozen=True)
class NgramHash:
    """The static hash constants of one PLE module (docs/model.md §6.1), as attributes of the custom call."""

    eos: int
    vocab: int
    multipliers: tuple[int, ...]
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]

    @classmethod
    def from_config(cls, config, ple_index: int = 0) -> NgramHash:
        if config.eos_token_id is None:
            raise ValueError("PLE needs config.eos_token_id")
        sizes = config.ngram_head_vocab_sizes(ple_index)
        offsets = config.ngram_head_offsets(ple_index)
        if sizes and offsets[-1] + sizes[-1] >= 2**31:
            raise ValueError("n-gram ids would not fit in int32")
        return cls(config.eos_token_id, config.vocab_size, tuple(config.ngram_multipliers(ple_index)),
                   tuple(sizes), tuple(offsets))

    @property
    def heads(self) -> int:
        return len(self.head_sizes)


class NgramTable:
    """The n-gram embedding table as read-only mappings of its segments [(file_path, byte_offset, rows)],
    concatenated in order, each row `head_dim` elements of `dtype`. `heads` is the number of n-gram heads,
    `max_tokens` the most tokens one GPU step may carry (sizes the pinned staging area; unused on the CPU)."""

    def __init__(self, segments: Sequence[tuple[str, int, int]], *, head_dim: int, dtype, heads: int = 16,
                 max_tokens: int = 8192):
        mod = _ext.module()
        self.dtype = normalize_dtype(dtype)
        self.head_dim = int(head_dim)
        self.heads = int(heads)
        self.row_bytes = self.head_dim * self.dtype.itemsize
        segs = [(os.fspath(p), int(o), int(r)) for p, o, r in segments]
        info = mod.table_create(segs, self.row_bytes, self.heads, int(max_tokens) if mod.has_cuda else 0)
        self.id = int(info["id"])
        self.rows = int(info["rows"])
        self.max_tokens = int(max_tokens)
        self.staging_pinned = bool(info["staging_pinned"])
        self.note = info["note"]

    @classmethod
    def from_checkpoint(cls, ckpt, config, *, ple_index: int = 0, max_tokens: int = 8192) -> NgramTable:
        """The table of PLE module `ple_index` from `ckpt.location(name) -> (path, offset, nbytes, dtype, shape)`:
        the shards `…ngram_embedding.shard_{i}.weight` in order, or one `…ngram_embedding.weight`."""
        layer = config.ple_layers[ple_index]
        base = f"layers.{layer}.ple.ple_embedding.ngram_embedding"
        locs = []
        try:
            locs.append(ckpt.location(f"{base}.shard_0.weight"))
            for i in range(1, config.split_ngram_parts):
                locs.append(ckpt.location(f"{base}.shard_{i}.weight"))
        except (LookupError, ValueError):  # ValueError: jaxflash.checkpoint's CheckpointError
            if locs:
                raise
            locs = [ckpt.location(f"{base}.weight")]
        dtype = normalize_dtype(locs[0][3])
        head_dim = int(locs[0][4][1])
        segments = []
        for path, offset, nbytes, dt, shape in locs:
            if normalize_dtype(dt) != dtype or int(shape[1]) != head_dim or len(shape) != 2:
                raise ValueError(f"n-gram table shards disagree: {dt} {list(shape)} vs {dtype.name} [*, {head_dim}]")
            if int(nbytes) != int(shape[0]) * head_dim * dtype.itemsize:
                raise ValueError(f"n-gram shard in {path}: {nbytes} bytes for shape {list(shape)}")
            segments.append((path, offset, int(shape[0])))
        table = cls(segments, head_dim=head_dim, dtype=dtype, heads=config.num_ngram_heads, max_tokens=max_tokens)
        needed = sum(config.ngram_head_vocab_sizes(ple_index))
        if table.rows < needed:
            table.close()
            raise ValueError(f"the n-gram table has {table.rows} rows; the config's heads need {needed}")
        return table

    def lookup(self, ids) -> np.ndarray:
        """Rows of `ids` (any shape) as a numpy array [..., head_dim] (host-side; for checks and tests)."""
        ids = np.asarray(ids, np.int64)
        raw = _ext.module().table_rows(self.id, np.ascontiguousarray(ids.reshape(-1)))
        return raw.view(self.dtype).reshape(*ids.shape, self.head_dim)

    def close(self) -> None:
        if self.id:
            _ext.module().table_release(self.id)
            self.id = 0

    def __enter__(self) -> NgramTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ngram_context_init(batch: int, eos: int) -> np.ndarray:
    """The context of `batch` fresh sequences: int32 [B, 2] of eos."""
    return np.full((batch, 2), eos, np.int32)


class PleStep(NamedTuple):
    ids: jax.Array  # int32 [B, T, heads]
    rows: jax.Array  # table dtype [B, T, heads, head_dim]
    info: jax.Array  # int32 [2]: status, detail
    context: jax.Array  # int32 [B, 2], aliases the input context


def ple_step(tokens, context, table: NgramTable, hash: NgramHash, *, lengths=None, reset=None) -> PleStep:
    """One PLE step for tokens [B, T] (int32). lengths [B] (default T): valid tokens per row, the rest is
    padding; reset [B] (default 0): nonzero starts that sequence afresh. Donate `context`."""
    _ext.module()
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    if table.id <= 0:
        raise ValueError("ple_step: the n-gram table is closed")
    if hash.heads != table.heads:
        raise ValueError(f"the hash has {hash.heads} heads, the table {table.heads}")
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    reset = jnp.zeros((B,), jnp.int32) if reset is None else jnp.asarray(reset, jnp.int32)
    context = jnp.asarray(context, jnp.int32)
    if lengths.shape != (B,) or reset.shape != (B,) or context.shape != (B, 2):
        raise ValueError(f"lengths and reset must be [{B}] and the context [{B}, 2]")
    H = hash.heads
    out = (
        jax.ShapeDtypeStruct((B, T, H), jnp.int32),
        jax.ShapeDtypeStruct((B, T, H, table.head_dim), table.dtype),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((B, 2), jnp.int32),
    )
    call = jax.ffi.ffi_call("jaxflash_ple_step", out, input_output_aliases={3: 3})
    ids, rows, info, ctx = call(
        tokens, lengths, reset, context,
        table_id=np.int64(table.id), eos=np.int64(hash.eos), vocab=np.int64(hash.vocab),
        multipliers=np.asarray(hash.multipliers, np.int64), head_sizes=np.asarray(hash.head_sizes, np.int64),
        head_offsets=np.asarray(hash.head_offsets, np.int64),
    )
    return PleStep(ids, rows, info, ctx)


def check_ple_info(info) -> None:
    """Raise PleError if a PLE step's info (int32[2]) reports an error."""
    status, detail = (int(x) for x in np.asarray(info).reshape(-1)[:2])
    if status:
        raise PleError("ple_step: " + _ext.module().status_message(status, detail))
