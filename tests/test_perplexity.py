"""Perplexity (llama.cpp protocol) against a perplexity computed from the reference's logits, on a tiny
checkpoint in the released BF16 layout (read by transformers directly). Windows of 32 tokens stay within the
tiny model's QSA budget: its 2 index heads give many exact zero block scores, whose top-k ties the reference
breaks arbitrarily (QSA selection itself is covered by test_model.py). Measured relative difference of the
PPL: ~1e-7; tolerance 1e-4."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import Qwen4ExpForCausalLM

import jaxflash
from jaxflash.perplexity import perplexity
from jaxflash.synthetic import make_model
from jaxflash.tokenizer import Tokenizer

from hf_reference import near_ties

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ppl") / "tiny")
    make_model("tiny", "bf16", 11, out, progress=False)
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = "the of and to in a is that for it as was with be by on not he this are or his from at".split()
    body = " ".join(rng.choice(words, 900)) + "."
    path = tmp_path_factory.mktemp("text") / "sample.txt"
    path.write_text(body)
    return str(path)


def reference_ppl(hf, tokens, ctx, chunks):
    """The protocol, written out on the reference's float64 logits."""
    first = ctx // 2
    nll = []
    for i in range(chunks):
        window = torch.as_tensor(tokens[i * ctx : (i + 1) * ctx])[None]
        logp = torch.log_softmax(hf(input_ids=window).logits[0].double(), -1)
        nll += [-float(logp[j, window[0, j + 1]]) for j in range(first, ctx - 1)]
    return math.exp(np.mean(nll)), len(nll)


def test_matches_reference(model_dir, text):
    tok = Tokenizer(model_dir)
    tokens = tok.encode(open(text).read())
    chunks = 8
    assert len(tokens) >= chunks * CTX
    hf = Qwen4ExpForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager").eval()
    want, n = reference_ppl(hf, tokens, CTX, chunks)
    assert all(near_ties(hf, tokens[i * CTX : (i + 1) * CTX]) == 0 for i in range(chunks))

    out = io.StringIO()
    got = perplexity(jaxflash.load(model_dir, dtype="float32", progress=False), tokens, ctx=CTX, chunks=chunks,
                     batch=3, out=out)
    assert got.tokens_scored == n == chunks * (CTX // 2 - 1)
    assert abs(got.ppl - want) / want < 1e-4, (got.ppl, want)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("[1]") and lines[1].count(",") == chunks
    assert lines[-1] == f"Final estimate: PPL = {got.ppl:.4f} +/- {got.stderr:.5f}"
    assert got.stderr > 0


def test_cli(model_dir, text):
    # no compilation cache: the tool's default one is the user's (~/.cache/jaxflash), not a test's to fill
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "perplexity.py"), "--model", model_dir,
                          "-f", text, "--ctx", str(CTX), "--chunks", "2"], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, JAXFLASH_COMPILE_CACHE="off"))
    assert res.returncode == 0, res.stderr
    assert "[2]" in res.stdout and "Final estimate: PPL = " in res.stdout


def test_cli_errors(model_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "perplexity.py"), "--model", model_dir,
                          "-f", str(short), "--ctx", "512"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "lower --ctx" in res.stderr
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "perplexity.py"), "-f",
                          str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 2 and "cannot read" in res.stderr
