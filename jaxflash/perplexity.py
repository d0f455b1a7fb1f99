"""Perplexity with llama.cpp's llama-perplexity protocol, so figures compare with llama.cpp's.

The token stream is cut into windows of `ctx` tokens (the remainder is dropped); each window is evaluated
from scratch and only its second half is scored: the logits at positions ctx/2 .. ctx-2 predict tokens
ctx/2+1 .. ctx-1. Output: a running "[i]ppl," per window, then
"Final estimate: PPL = X +/- Y" with Y the standard error of the mean NLL propagated to PPL.
The loss is computed inside the jitted program: full-vocabulary logits never leave the device.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .engine import Engine
from .model import transformer


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float  # of the PPL estimate
    tokens_scored: int
    chunks: int
    running: list[float]  # PPL after each window


def _nll_fn(engine: Engine, first: int):
    cfg = engine.config

    @jax.jit
    def nll(params, windows, rows):
        logits = transformer.forward(params, cfg, windows, ple_rows=rows)[:, first:-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, windows[:, first + 1 :, None], axis=-1)[..., 0]

    return nll


def perplexity(engine: Engine, tokens, ctx: int = 512, chunks: int | None = None, batch: int = 1,
               bos_token_id: int | None = None, out=sys.stdout) -> PerplexityResult:
    """Run the protocol over `tokens`. bos_token_id, when given, replaces each window's first token (llama.cpp
    does this for models that add BOS). `batch` windows are evaluated per call."""
    tokens = np.asarray(tokens, np.int32)
    if ctx < 4 or ctx % 2:
        raise ValueError(f"ctx must be an even number >= 4, got {ctx}")
    n_max = len(tokens) // ctx
    if n_max == 0:
        raise ValueError(f"need at least ctx={ctx} tokens, the text has {len(tokens)}; lower --ctx")
    n_chunk = n_max if chunks is None or chunks < 0 else min(chunks, n_max)
    first = ctx // 2
    nll_fn = _nll_fn(engine, first)
    print(f"perplexity: calculating perplexity over {n_chunk} chunks, n_ctx={ctx}, batch={batch}", file=out)

    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    for start in range(0, n_chunk, batch):
        ids = list(range(start, min(start + batch, n_chunk)))
        windows = np.stack([tokens[i * ctx : (i + 1) * ctx] for i in ids])
        if bos_token_id is not None:
            windows[:, 0] = bos_token_id
        if len(ids) < batch:  # keep one compiled shape: pad with copies, ignore their results
            windows = np.concatenate([windows, np.repeat(windows[-1:], batch - len(ids), 0)])
        nll = np.asarray(nll_fn(engine.params, jnp.asarray(windows), engine.ple_rows(windows)), np.float64)
        for row in nll[: len(ids)]:
            nll_sum += row.sum()
            nll2_sum += (row * row).sum()
            count += row.size
            running.append(math.exp(nll_sum / count))
            print(f"[{len(running)}]{running[-1]:.4f},", end="", file=out, flush=True)
    print(file=out)
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    stderr = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    print(f"Final estimate: PPL = {ppl:.4f} +/- {stderr:.5f}", file=out)
    return PerplexityResult(ppl, stderr, count, n_chunk, running)
