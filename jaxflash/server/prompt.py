"""Prompts: chat messages rendered by the checkpoint's template and tokenised, with the untrusted parts kept as
text. Everything here is CPU work that the endpoints run off the event loop.

- Control tokens written in user or tool content (`<|im_end|>\\n<|im_start|>system ...`) are encoded as the
  characters, not as the tokens, so a user cannot forge a turn; `allow_special_tokens` lets a request opt out.
  The template renders such contents as placeholders, which are then encoded apart from the template's text.
- A final assistant message with text is a prefill: the prompt ends inside that turn, right after its text, and
  the model continues it (`continue_final_message: false` closes the turn instead).
- A prompt of more bytes than the context's tokens can hold (context x the longest token's bytes) is refused
  before anything is rendered or tokenised: it could never fit.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from .parsing import END_THINK, THINK


class PromptError(ValueError):
    """The request's prompt cannot be built (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Prompt:
    ids: list[int]
    text: str
    in_reasoning: bool  # the prompt leaves the model inside an open <think> block


def _text(content) -> str:
    """A message's text, as the template's text() macro reads it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def openai_messages(messages) -> list[dict]:
    """OpenAI chat messages (pydantic) as the template's dicts: developer is system, call arguments parsed."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        for call in d.get("tool_calls", []):
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args)
                except ValueError:
                    pass
        out.append(d)
    return out


def too_long(nbytes: int, max_bytes: int, ctx: int, token_bytes: int, param: str) -> PromptError:
    return PromptError(f"the prompt is {nbytes} bytes; the context of {ctx} tokens holds at most {max_bytes} "
                       f"({token_bytes} bytes per token at most)", param)


def encode_text(vocab, text: str, *, ctx: int, param: str = "prompt") -> list[int]:
    """A raw prompt (completions, /tokenize): the client wrote all of it, control tokens included."""
    limit = ctx * vocab.max_token_bytes
    if len(text) > limit or len(text.encode()) > limit:
        raise too_long(len(text.encode()), limit, ctx, vocab.max_token_bytes, param)
    return vocab.encode(text)


def render_chat(vocab, messages: list[dict], *, tools=None, kwargs: dict | None = None, ctx: int,
                allow_special: bool = False, continue_final: bool = True, generation_prompt: bool = True,
                param: str = "messages") -> Prompt:
    limit = ctx * vocab.max_token_bytes
    chars = sum(len(_text(m.get("content"))) for m in messages)
    if chars > limit:  # characters are at most bytes: refuse before rendering anything
        raise too_long(chars, limit, ctx, vocab.max_token_bytes, param)

    prefill = None
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        body = _text(last.get("content"))
        if not body.strip():
            messages = messages[:-1]  # an empty final assistant message: just the new turn
        elif continue_final:
            prefill = body

    untrusted: dict[str, str] = {}
    if not allow_special:
        nonce = str(secrets.randbelow(10**12))
        messages = [_isolate(m, vocab, nonce, untrusted) for m in messages]
    try:
        text = vocab.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt and prefill is None, tools=tools, **dict(kwargs or {}))
    except Exception as e:  # noqa: BLE001 -- template errors are the request's fault
        raise PromptError(f"chat template: {e}", param) from None
    if prefill is not None:
        text = _cut_after(text, prefill, param)
    nbytes = len(text.encode())
    if nbytes > limit:
        raise too_long(nbytes, limit, ctx, vocab.max_token_bytes, param)

    if untrusted:
        ids, shown = [], []
        for i, piece in enumerate(_PLACEHOLDER.split(text)):
            if i % 2:  # a placeholder's key
                ids += vocab.encode_plain(untrusted[piece])
                shown.append(untrusted[piece])
            elif piece:
                ids += vocab.encode(piece)
                shown.append(piece)
        text = "".join(shown)
    else:
        ids = vocab.encode(text)
    turn = text[text.rfind("<|im_start|>") :] if "<|im_start|>" in text else text
    return Prompt(ids, text, turn.rfind(THINK) > turn.rfind(END_THINK))


_PLACEHOLDER = re.compile("\ue000(\\d+:\\d+)\ue001")  # private-use brackets, digits: no template filter alters it


def _isolate(m: dict, vocab, nonce: str, untrusted: dict) -> dict:
    """The message with each user/tool text that contains control-token text replaced by a placeholder."""
    if m["role"] not in ("user", "tool"):
        return m

    def hide(s: str) -> str:
        if not vocab.has_special_text(s):
            return s
        key = f"{nonce}:{len(untrusted)}"
        untrusted[key] = s
        return f"\ue000{key}\ue001"

    c = m.get("content")
    if isinstance(c, str):
        return {**m, "content": hide(c)}
    if isinstance(c, list):
        return {**m, "content": [{**p, "text": hide(p["text"])} if isinstance(p, dict) and isinstance(
            p.get("text"), str) else p for p in c]}
    return m


def _cut_after(text: str, prefill: str, param: str) -> str:
    """The rendered conversation up to the end of the final assistant message's text (as the template wrote it:
    the answer after any </think>, stripped)."""
    body = prefill.split(END_THINK)[-1].strip() or (END_THINK if END_THINK in prefill else prefill.strip())
    at = text.rfind(body)
    if at < 0:
        raise PromptError("the chat template does not keep the final assistant message's text, so it cannot be "
                          "continued (send continue_final_message: false)", param)
    return text[: at + len(body)]
