"""The incremental output parser: the same result however the tokens are split into steps."""

from __future__ import annotations

import json

import pytest

import jaxflash
from jaxflash.server.parsing import OutputParser
from jaxflash.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(jaxflash.DEFAULT_MODEL)


def run(tok, text, step, **kw):
    """Feed text's tokens `step` at a time; collect text, reasoning and tool calls from the deltas."""
    p = OutputParser(tok, **kw)
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
def test_any_split_gives_the_same_output(tok, text, kw, want_text, want_reasoning, want_calls):
    for step in (1, 2, 3, 7, 1000):
        out, _ = run(tok, text, step, **kw)
        assert out["text"] == want_text, step
        assert out["reasoning"] == want_reasoning, step
        calls = {i: (c["name"], json.loads(c["args"])) for i, c in out["calls"].items()}
        assert calls == want_calls, step


def test_stop_string_is_held_back_until_decided(tok):
    p = OutputParser(tok, stop=["STOP"])
    shown = ""
    for t in tok.encode("abc ST"):
        shown += "".join(d[1] for d in p.feed([t]))
    assert shown == "abc "  # "ST" may begin "STOP": not shown yet
    shown += "".join(d[1] for d in p.feed(tok.encode("ART")))
    assert shown == "abc START"
