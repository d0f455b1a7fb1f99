"""Output constraints, enforced by token masks computed with llguidance: JSON (any object, or a JSON schema), a
Lark grammar (`guided_grammar`), forced tool calls. The engine asks the constraint for each step's allowed-token
bitmask and feeds it the sampled token.

Compiling a grammar can take a while (llguidance drops the GIL for it); callers run it off the event loop and
bound its size first. A grammar that matches nothing is refused when it is compiled; one that reaches an error
state while generating stops the request, and `failed` says why, so that the server ends it as an error.

JSON schemas follow the strictness OpenAI documents for `response_format.json_schema`: with `strict: true` every
object schema must say `"additionalProperties": false` and list all its properties in `required`; without it,
an object schema that lists properties but says nothing about others forbids them (Pydantic's schemas say
nothing), and `"additionalProperties": true` allows them.
"""

from __future__ import annotations

import json

import numpy as np


class GrammarError(ValueError):
    """The requested format cannot be compiled into a grammar."""


class GrammarConstraint:
    """A compiled llguidance grammar as a token-mask source for one request."""

    def __init__(self, vocab, grammar: str, what: str):
        import llguidance

        self.matcher = llguidance.LLMatcher(vocab.ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"invalid {what}: {_first_line(self.matcher.get_error())}")
        self.eos = vocab.eos_ids
        row = np.zeros(-(-vocab.size // 32), np.int32)
        self.mask(row)  # the first step: some limits (items per row, lexer fuel) are only hit here
        if self.matcher.is_error():
            raise GrammarError(f"invalid {what}: {_first_line(self.matcher.get_error())}")
        if not row.any():
            raise GrammarError(f"the {what} matches no output")

    def mask(self, row) -> None:
        """Fill row (int32 [ceil(V/32)]) with the allowed tokens of the next step."""
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self.matcher, row[None, :], 0)
        if self.matcher.is_accepting():  # the output is complete: let the model stop
            for e in self.eos:
                row[e // 32] |= 1 << (e % 32)

    def accept(self, token: int) -> None:
        if token not in self.eos:
            self.matcher.consume_token(token)

    def finished(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def failed(self) -> str | None:
        """Why the grammar reached an error state, if it did."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None


def _first_line(msg: str) -> str:
    line = (msg or "rejected").strip().splitlines()[0]
    return line if len(line) <= 300 else line[:300] + "..."


# ----- JSON schemas --------------------------------------------------------------------------------------------
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def _is_object(s: dict) -> bool:
    t = s.get("type")
    return "properties" in s and (t is None or t == "object" or (isinstance(t, list) and "object" in t))


def prepare_schema(schema, *, strict: bool, where: str):
    """The schema as it is enforced: a copy in which object schemas listing properties forbid undeclared ones
    unless they say otherwise; with strict, OpenAI's rules checked instead (GrammarError naming the path)."""

    def walk(s, path: str, closable: bool):
        if isinstance(s, list):
            return [walk(x, f"{path}[{i}]", closable) for i, x in enumerate(s)]
        if not isinstance(s, dict):
            return s
        out = dict(s)
        if _is_object(s):
            if strict:
                if s.get("additionalProperties") is not False:
                    raise GrammarError(f"{path}: strict mode needs \"additionalProperties\": false on every object")
                missing = [k for k in s["properties"] if k not in (s.get("required") or [])]
                if missing:
                    raise GrammarError(f"{path}: strict mode needs every property in \"required\" (missing "
                                       f"{', '.join(map(repr, missing[:5]))})")
            elif closable and "additionalProperties" not in s:
                out["additionalProperties"] = False
        for k in _SCHEMA_LISTS:
            if isinstance(s.get(k), list):
                out[k] = walk(s[k], f"{path}.{k}", True)
        if isinstance(s.get("allOf"), list):  # members are intersected: closing each would forbid the others' keys
            out["allOf"] = walk(s["allOf"], f"{path}.allOf", len(s["allOf"]) < 2)
        for k in _SCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                out[k] = {name: walk(v, f"{path}.{k}.{name}", True) for name, v in s[k].items()}
        for k in _SCHEMA_ONE:
            if isinstance(s.get(k), (dict, list)):
                out[k] = walk(s[k], f"{path}.{k}", True)
        return out

    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON schema object")
    return walk(schema, where, True)


def json_grammar(schema: dict | None) -> str:
    """Compact JSON (no free whitespace, so the model cannot pad forever) matching `schema`, or any object."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_grammar(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def tool_call_grammar(tools: list[dict], *, parallel: bool) -> str:
    """Lark for a reply that is only tool calls (one, or with parallel one or more) to these tools, in the Qwen
    JSON style the chat template teaches: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, the
    arguments matching the tool's parameter schema, formatted as the template renders calls."""
    shapes = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                "arguments": t.get("parameters") or {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    body = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    body = {**body, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    call = f'"<tool_call>\\n" %json {json.dumps(body)} "\\n</tool_call>"'
    return "start: call" + (' ("\\n" call)*' if parallel else "") + "\ncall: " + call + "\n"
