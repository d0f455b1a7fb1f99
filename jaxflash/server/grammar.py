"""`response_format` constraints: JSON (any object, or a JSON schema), or a Lark grammar (`guided_grammar`),
enforced by token masks computed with llguidance. The engine asks the constraint for each step's allowed-token
bitmask and feeds it the sampled token."""

from __future__ import annotations

from functools import lru_cache


class GrammarError(ValueError):
    """The requested format cannot be compiled into a grammar."""


@lru_cache(maxsize=4)
def _tokenizer(path: str, vocab: int, eos: tuple):
    import llguidance

    return llguidance.LLTokenizer(path, n_vocab=vocab, eos_token=list(eos))


class GrammarConstraint:
    """An llguidance grammar (from a JSON schema, or Lark) as a token-mask source."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids, *, schema: dict | None = None,
                 lark: str | None = None):
        import llguidance

        tok = _tokenizer(str(tokenizer_json), int(vocab_size), tuple(int(e) for e in eos_ids))
        what = "JSON schema" if lark is None else "grammar"
        try:
            if lark is not None:
                grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema if schema is not None else {"type": "object"}, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid {what}: {e}") from None
        is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_err:
            raise GrammarError(f"invalid {what}: {msgs[0] if msgs else 'rejected'}")
        self.matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        self.eos = tuple(int(e) for e in eos_ids)

    def mask(self, row) -> None:
        """Fill row (int32 [ceil(V/32)]) with the allowed tokens of the next step."""
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self.matcher, row[None, :], 0)
        if self.matcher.is_accepting():  # the JSON is complete: let the model stop
            for e in self.eos:
                row[e // 32] |= 1 << (e % 32)

    def accept(self, token: int) -> None:
        if token not in self.eos:
            self.matcher.consume_token(token)

    def finished(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()


def constraint_for(response_format, tokenizer_json: str, vocab_size: int, eos_ids, guided_grammar=None):
    """The constraint of an OpenAI `response_format`, or of `guided_grammar` (a Lark grammar, vLLM's extension
    field); None for plain text."""
    if guided_grammar is not None:
        if not isinstance(guided_grammar, str) or not guided_grammar.strip():
            raise GrammarError("guided_grammar must be a Lark grammar string")
        if response_format and response_format.get("type") not in (None, "text"):
            raise GrammarError("give either response_format or guided_grammar, not both")
        return GrammarConstraint(tokenizer_json, vocab_size, eos_ids, lark=guided_grammar)
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarConstraint(tokenizer_json, vocab_size, eos_ids)
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js if "type" in js or "properties" in js else None)
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return GrammarConstraint(tokenizer_json, vocab_size, eos_ids, schema=schema)
    raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
