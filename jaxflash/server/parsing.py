"""Turning generated tokens into API output, incrementally: text, `<think>` reasoning, Qwen tool calls, stop
strings.

The parser is fed token ids as they come (any number per step) and returns deltas:
    ("text", s) | ("reasoning", s) | ("tool_start", index, id, name) | ("tool_args", index, s) | ("tool_end", index)
Text that could still be the start of a marker (`<think>`, `</think>`, `<tool_call>`) or of a stop string is
held back until it is decided, so a stop string never leaks partially. Tool calls come in both Qwen styles:
    <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
    <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>
A call's name is sent as soon as it is known; arguments follow (per parameter in the XML style, whole in the
JSON style), then tool_end. A block that does not parse is passed through as text.
"""

from __future__ import annotations

import json
import re
import uuid

THINK, END_THINK, TOOL, END_TOOL = "<think>", "</think>", "<tool_call>", "</tool_call>"
_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_XML_FUNC = re.compile(r"<function=([^>\n]+)>")
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_value(raw: str):
    """A parameter's value: JSON when it parses (numbers, objects, ...), else the string itself."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class OutputParser:
    def __init__(self, tokenizer, *, stop: list[str] = (), tools: bool = False, reasoning: bool = False,
                 in_reasoning: bool = False):
        """stop: stop strings; tools: parse <tool_call> blocks; reasoning: split <think> blocks (in_reasoning:
        the prompt already opened one)."""
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.tools, self.reasoning = tools, reasoning
        self.mode = "reasoning" if (reasoning and in_reasoning) else "text"
        self.ids: list[int] = []
        self.decoded = ""  # text of self.ids already taken into buf
        self.buf = ""
        self.stopped = False  # a stop string was hit: nothing more is emitted
        self.calls: list[dict] = []  # finished and open tool calls: {"id", "name", "arguments"(str)}
        self._call: dict | None = None  # the open call's parse state
        self._strip = False  # drop the newlines that follow a closed block, however the text is split

    # ----- input --------------------------------------------------------------------------------------------
    def feed(self, ids: list[int]) -> list[tuple]:
        if self.stopped:
            return []
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next token
            return []
        self.buf += text[len(self.decoded):]
        self.decoded = text
        return self._drain(final=False)

    def finish(self) -> list[tuple]:
        """Flush what was held back at the end of generation."""
        if self.stopped:
            return []
        text = self.tok.decode(self.ids)
        self.buf += text[len(self.decoded):]
        self.decoded = text
        return self._drain(final=True)

    # ----- the state machine ----------------------------------------------------------------------------------
    def _markers(self) -> list[str]:
        if self.mode == "tool":
            return [END_TOOL]
        m = list(self.stop)
        if self.mode == "reasoning":
            m.append(END_THINK)
        else:
            if self.reasoning:
                m.append(THINK)
            if self.tools:
                m.append(TOOL)
        return m

    def _drain(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while self.buf and not self.stopped:
            if self._strip:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    break
                self._strip = False
            if self.mode == "tool":
                out.extend(self._tool_progress(final))
                if self.mode == "tool":
                    break
                continue
            markers = self._markers()
            hits = [(self.buf.find(m), m) for m in markers if m in self.buf]
            if hits:
                at, m = min(hits)
                self._emit(out, self.buf[:at])
                self.buf = self.buf[at + len(m):]
                if m in self.stop:
                    self.stopped = True
                    self.buf = ""
                elif m == THINK:
                    self.mode = "reasoning"
                elif m == END_THINK:
                    self.mode, self._strip = "text", True
                elif m == TOOL:
                    self.mode = "tool"
                    self._call = {"index": len(self.calls), "started": False, "params": 0, "style": None}
                continue
            keep = 0 if final else max((k for m in markers for k in range(1, len(m))
                                        if self.buf.endswith(m[:k])), default=0)
            self._emit(out, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _emit(self, out: list, s: str) -> None:
        if s:
            out.append(("reasoning" if self.mode == "reasoning" else "text", s))

    def _tool_progress(self, final: bool) -> list[tuple]:
        c, out = self._call, []
        end = self.buf.find(END_TOOL)
        body = self.buf if end < 0 else self.buf[:end]
        if not c["started"]:
            m = _XML_FUNC.search(body) or _JSON_NAME.search(body)
            if m:
                c["style"] = "xml" if m.re is _XML_FUNC else "json"
                name = m.group(1) if c["style"] == "xml" else json.loads(f'"{m.group(1)}"')
                call = {"id": "call_" + uuid.uuid4().hex[:24], "name": name.strip(), "arguments": ""}
                self.calls.append(call)
                c["started"] = True
                out.append(("tool_start", c["index"], call["id"], call["name"]))
        if c["started"] and c["style"] == "xml":  # stream each parameter as it closes
            params = _XML_PARAM.findall(body)
            for pname, raw in params[c["params"]:]:
                frag = ("{" if c["params"] == 0 else ", ") + json.dumps(pname.strip()) + ": " + json.dumps(
                    _xml_value(raw))
                self.calls[c["index"]]["arguments"] += frag
                out.append(("tool_args", c["index"], frag))
                c["params"] += 1
        if end < 0 and not final:
            return out
        # the block is complete (or generation ended inside it)
        rest = self.buf[end + len(END_TOOL):] if end >= 0 else ""
        call = self.calls[c["index"]] if c["started"] else None
        ok = call is not None
        if ok and c["style"] == "json":
            try:
                obj = json.loads(body.strip())
                args = obj.get("arguments", obj.get("parameters", {}))
                call["arguments"] = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                out.append(("tool_args", c["index"], call["arguments"]))
            except (ValueError, AttributeError):
                ok = False
        elif ok:
            tail = "{}" if c["params"] == 0 else "}"
            call["arguments"] += tail
            out.append(("tool_args", c["index"], tail))
        if ok:
            out.append(("tool_end", c["index"]))
        else:  # not a tool call after all: give the text back
            if call is not None:
                self.calls.pop()
            out.append(("text", TOOL + body + (END_TOOL if end >= 0 else "")))
        self.mode, self._call, self._strip = "text", None, True
        self.buf = rest
        return out
