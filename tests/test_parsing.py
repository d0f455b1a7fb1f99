"""The incremental output parser: the same result however the tokens are split into steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxflash
from jaxflash.server.parsing import OutputParser
from jaxflash.server.vocab import Vocab
from jaxflash.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(jaxflash.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def vocab(tok):
    return Vocab(tok, (0, 2))


def run(tok, text, step, vocab=None, **kw):
    """Feed text's tokens `step` at a time; collect text, reasoning and tool calls from the deltas."""
    p = OutputParser(vocab or Vocab(tok), **kw)
    ids = tok.encode(text)
    out = {"text": "", "reasoning": "", "calls": {}}
    deltas = []
    for i in range(0, len(ids), step):
        deltas += p.feed(ids[i : i + step])
    deltas += p.finish()
    for d in deltas:
        if d[0] in ("text", "reasoning"):
            out[d[0]] += d[1]
        elif d[0] == "tool_start":
            out["calls"][d[1]] = {"name": d[3], "args": ""}
        elif d[0] == "tool_args":
            out["calls"][d[1]]["args"] += d[2]
    return out, p


CASES = [
    ("<think>\nplan it\n</think>\n\nDone.", dict(reasoning=True), "Done.", "\nplan it\n", {}),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>\n<tool_call>\n'
     '<function=g>\n<parameter=q>\nhello world\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n'
     '</tool_call>', dict(tools=True), "Sure.\n", "",
     {0: ("f", {"a": 1, "b": "x"}), 1: ("g", {"q": "hello world", "n": 2})}),
    ("a < b and <tool_ not a call", dict(tools=True), "a < b and <tool_ not a call", "", {}),
    ("<tool_call>\nnot json\n</tool_call> after", dict(tools=True), "<tool_call>\nnot json\n</tool_call> after",
     "", {}),
    ("keep this END and not this", dict(stop=["END"]), "keep this ", "", {}),
    ("no markers at all <think> stays", dict(), "no markers at all <think> stays", "", {}),
]


@pytest.mark.parametrize("text,kw,want_text,want_reasoning,want_calls", CASES)
def test_any_split_gives_the_same_output(tok, vocab, text, kw, want_text, want_reasoning, want_calls):
    for step in (1, 2, 3, 7, 1000):
        out, _ = run(tok, text, step, vocab, **kw)
        assert out["text"] == want_text, step
        assert out["reasoning"] == want_reasoning, step
        calls = {i: (c["name"], json.loads(c["args"])) for i, c in out["calls"].items()}
        assert calls == want_calls, step


def test_stop_string_is_held_back_until_decided(tok, vocab):
    p = OutputParser(vocab, stop=["STOP"])
    shown = ""
    for t in tok.encode("abc ST"):
        shown += "".join(d[1] for d in p.feed([t]))
    assert shown == "abc "  # "ST" may begin "STOP": not shown yet
    shown += "".join(d[1] for d in p.feed(tok.encode("ART")))
    assert shown == "abc START"


def test_stop_strings_end_at_the_first_to_complete(tok, vocab):
    """Against a brute-force reference on random text: the output stops where the first stop string completes
    (of two completing at once, the longer), whatever the split into steps and the order of the list."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        text = "".join(rng.choice(list("ab c"), size=int(rng.integers(1, 40))))
        stops = list({"".join(rng.choice(list("abc "), size=int(rng.integers(1, 5)))) for _ in range(3)})
        end, hit = len(text), None
        for j in range(1, len(text) + 1):
            done = [s for s in stops if text[:j].endswith(s)]
            if done:
                end, hit = j, max(done, key=len)
                break
        want = text[: end - len(hit)] if hit else text
        for step in (1, 3, 1000):
            out, p = run(tok, text, step, vocab, stop=stops[::-1] if step == 3 else stops)
            assert (out["text"], p.stop_hit) == (want, hit), (text, stops, step)


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": NaN}}', '{"name": "f", "arguments": {"x": 1e999}}',
    '{"name": "f", "arguments": {"x": "\\ud800"}}', '{"name": "f\\q", "arguments": {}}',
    '{"name": "", "arguments": {}}',
    '{"name": "f", "arguments": [1]}', '["f"]', '<function=f>\n<parameter=x>\n1\n</parameter>\nrest\n</function>',
    '<function=f>\n<parameter=x>\n1\n</function>'])
def test_malformed_calls_are_text(tok, vocab, body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    for step in (1, 1000):
        out, p = run(tok, text, step, vocab, tools=True)
        assert out["text"] == text and not out["calls"] and not p.calls


def test_call_arguments_are_valid_json(tok, vocab):
    """NaN as an XML value is the string "NaN" (json would have made it a float no reply can serialise)."""
    text = "<tool_call>\n<function=f>\n<parameter=x>\nNaN\n</parameter>\n<parameter=y>\n[1, 2]\n</parameter>\n" \
           "</function>\n</tool_call>"
    out, p = run(tok, text, 2, vocab, tools=True)
    assert json.loads(out["calls"][0]["args"]) == {"x": "NaN", "y": [1, 2]}
    assert p.calls[0]["arguments"] == out["calls"][0]["args"]
