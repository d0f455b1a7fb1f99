"""Turning generated tokens into API output, incrementally: text, `<think>` reasoning, Qwen tool calls, stop
strings.

The parser is fed token ids as they come (any number per step) and returns deltas:
    ("text", s) | ("reasoning", s) | ("tool_start", index, id, name) | ("tool_args", index, s) | ("tool_end", index)
Text that could still be the start of a marker (`<think>`, `</think>`, `<tool_call>`) or of a stop string is
held back until it is decided, so a stop string never leaks partially. Tool calls come in both Qwen styles:
    <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
    <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>
A call is announced only once its block has closed and parsed (a client must never start a call that turns out
to be malformed): then tool_start, its arguments (one delta per parameter in the XML style, whole in the JSON
style) and tool_end come together. A block that does not parse is passed through as text.

The cost per token is linear in the new text: tokens are decoded from their bytes incrementally, and markers
and stop strings are found by one Aho-Corasick automaton per mode, fed each character once. Whatever the split
into steps, the output is the same; the first stop string to complete in the text ends it (`stop_hit`).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import uuid
from collections import deque

THINK, END_THINK, TOOL, END_TOOL = "<think>", "</think>", "<tool_call>", "</tool_call>"
_XML_FUNC = re.compile(r"<function=([^>\n]+)>")


class _Markers:
    """An Aho-Corasick automaton over a few strings. Its state after a character is the longest suffix of the
    text so far that begins some marker (its length: what must be held back); `hit[state]` is the longest marker
    ending right there, if any."""

    def __init__(self, markers):
        self.next: list[dict[str, int]] = [{}]
        self.depth, self.fail, self.hit = [0], [0], [None]
        for m in markers:
            s = 0
            for c in m:
                t = self.next[s].get(c)
                if t is None:
                    t = len(self.next)
                    self.next[s][c] = t
                    self.next.append({})
                    self.depth.append(self.depth[s] + 1)
                    self.fail.append(0)
                    self.hit.append(None)
                s = t
            self.hit[s] = m
        todo = deque(self.next[0].values())
        while todo:  # breadth first: a state's fallback is shallower, so already complete
            s = todo.popleft()
            if self.hit[s] is None:
                self.hit[s] = self.hit[self.fail[s]]
            for c, t in self.next[s].items():
                f = self.fail[s]
                while f and c not in self.next[f]:
                    f = self.fail[f]
                self.fail[t] = self.next[f].get(c, 0)
                todo.append(t)

    def step(self, s: int, c: str) -> int:
        while s and c not in self.next[s]:
            s = self.fail[s]
        return self.next[s].get(c, 0)


def strict_json(text: str):
    """json.loads, refusing what JSON has not got (NaN, Infinity, numbers that overflow to infinity) and text
    that cannot be encoded (lone surrogates): model output must not become a response that fails to serialise."""

    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    def finite(s):
        x = float(s)
        if not math.isfinite(x):
            raise ValueError(f"{s} overflows")
        return x

    value = json.loads(text, parse_constant=no_constant, parse_float=finite)
    json.dumps(value, ensure_ascii=False).encode()  # raises on a lone surrogate
    return value


def _xml_value(raw: str):
    """A parameter's value: JSON when it parses strictly (numbers, objects, ...), else the string itself."""
    try:
        return strict_json(raw)
    except ValueError:
        return raw


def _json_call(body: str) -> tuple[str, dict] | None:
    try:
        obj = strict_json(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = strict_json(args)
        except ValueError:
            return None
    return (obj["name"].strip(), args) if isinstance(args, dict) else None


def _xml_call(body: str) -> tuple[str, dict] | None:
    """<function=f> then <parameter=p>value</parameter>... then </function>, nothing else; one left-to-right
    pass."""
    m = _XML_FUNC.match(body)
    end = "</function>"
    if not m or not body.endswith(end):
        return None
    inner, at, args = body[m.end() : len(body) - len(end)], 0, {}
    while True:
        while at < len(inner) and inner[at].isspace():
            at += 1
        if at == len(inner):
            return m.group(1).strip(), args
        if not inner.startswith("<parameter=", at):
            return None
        close = inner.find(">", at)
        stop = inner.find("</parameter>", close)
        if close < 0 or stop < 0 or "\n" in inner[at:close]:
            return None
        raw = inner[close + 1 : stop]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        args[inner[at + len("<parameter=") : close].strip()] = _xml_value(raw)
        at = stop + len("</parameter>")


class OutputParser:
    def __init__(self, vocab, *, stop: list[str] = (), tools: bool = False, reasoning: bool = False,
                 in_reasoning: bool = False):
        """vocab: a Vocab (the tokens' bytes); stop: stop strings; tools: parse <tool_call> blocks; reasoning:
        split <think> blocks (in_reasoning: the prompt already opened one)."""
        self.token_bytes = vocab.token_bytes
        self.stop = [s for s in stop if s]
        self.tools, self.reasoning = tools, reasoning
        self.mode = "reasoning" if (reasoning and in_reasoning) else "text"
        self.stopped = False  # a stop string was hit: nothing more is emitted
        self.stop_hit: str | None = None  # which one
        self.calls: list[dict] = []  # parsed tool calls: {"id", "name", "arguments"(str)}
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._automata: dict[str, _Markers] = {}
        self._state = 0  # the automaton's state; the text it holds back is the last depth[state] characters
        self._held = ""
        self._body: list[str] = []  # the open tool call's text
        self._strip = False  # drop the newlines that follow a closed block, however the text is split

    # ----- input --------------------------------------------------------------------------------------------
    def feed(self, ids: list[int]) -> list[tuple]:
        if self.stopped:
            return []
        return self._scan("".join(self._utf8.decode(self.token_bytes[t]) for t in ids))

    def finish(self) -> list[tuple]:
        """Flush what was held back at the end of generation."""
        if self.stopped:
            return []
        out = self._scan(self._utf8.decode(b"", final=True))
        if self.stopped:
            return out
        held, self._held, self._state = self._held, "", 0
        if self.mode == "tool":
            out.extend(self._close_call("".join(self._body) + held, closed=False))
        elif held:
            self._emit(out, held)
        return out

    # ----- the state machine ----------------------------------------------------------------------------------
    def _automaton(self) -> _Markers:
        a = self._automata.get(self.mode)
        if a is None:
            if self.mode == "tool":
                markers = [END_TOOL]
            elif self.mode == "reasoning":
                markers = [*self.stop, END_THINK]
            else:
                markers = [*self.stop, *([THINK] if self.reasoning else []), *([TOOL] if self.tools else [])]
            a = self._automata[self.mode] = _Markers(markers)
        return a

    def _emit(self, out: list, s: str) -> None:
        if not s:
            return
        if self.mode == "tool":
            self._body.append(s)
        else:
            out.append(("reasoning" if self.mode == "reasoning" else "text", s))

    def _scan(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        i, n = 0, len(text)
        while i < n and not self.stopped:
            if self._strip:
                while i < n and text[i] == "\n":
                    i += 1
                if i == n:
                    break
                self._strip = False
            auto, s, start = self._automaton(), self._state, i
            hit = None
            while i < n:
                s = auto.step(s, text[i])
                i += 1
                if auto.hit[s] is not None:
                    hit = auto.hit[s]
                    break
            run = self._held + text[start:i]
            if hit is None:
                keep = auto.depth[s]
                self._emit(out, run[: len(run) - keep])
                self._held, self._state = run[len(run) - keep :], s
                break
            self._emit(out, run[: len(run) - len(hit)])
            self._held, self._state = "", 0
            self._marker(hit, out)
        return out

    def _marker(self, m: str, out: list) -> None:
        if self.mode == "tool":  # END_TOOL
            body, self._body = "".join(self._body), []
            self.mode = "text"
            out.extend(self._close_call(body, closed=True))
        elif m in self.stop:
            self.stopped, self.stop_hit = True, m
        elif m == THINK:
            self.mode = "reasoning"
        elif m == END_THINK:
            self.mode, self._strip = "text", True
        elif m == TOOL:
            self.mode = "tool"

    def _close_call(self, body: str, closed: bool) -> list[tuple]:
        """The deltas of a finished <tool_call> block (or of one that generation ended inside)."""
        self.mode, self._strip = "text", True
        text = body.strip()
        parsed = _xml_call(text) if text.startswith("<function=") else _json_call(text)
        if parsed is None:  # not a tool call after all: give the text back
            return [("text", TOOL + body + (END_TOOL if closed else ""))]
        name, args = parsed
        index, cid = len(self.calls), "call_" + uuid.uuid4().hex[:24]
        if text.startswith("<function="):  # one delta per parameter, as the XML style lists them
            items = [json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False)
                     for k, v in args.items()]
            pieces = ["{" + items[0], *(", " + x for x in items[1:]), "}"] if items else ["{}"]
        else:
            pieces = [json.dumps(args, ensure_ascii=False)]
        self.calls.append({"id": cid, "name": name, "arguments": "".join(pieces)})
        return [("tool_start", index, cid, name), *(("tool_args", index, p) for p in pieces), ("tool_end", index)]
