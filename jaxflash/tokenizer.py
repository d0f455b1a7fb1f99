"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library) and its settings from
tokenizer_config.json (special tokens, whether to add BOS, the chat template)."""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path


class Tokenizer:
    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as _Tok

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no tokenizer.json (this checkpoint has no tokenizer)")
        self._tok = _Tok.from_file(str(path))
        self.path = str(path)
        cfg_path = directory / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.add_bos = bool(self.config.get("add_bos_token", False))
        bos = self.config.get("bos_token")
        self.bos_token_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added (BOS handling is the caller's choice)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """The checkpoint's chat template (jinja2, sandboxed) rendered for `messages`; extra keyword arguments
        (tools, enable_thinking, ...) are passed to the template."""
        if not self.chat_template:
            raise ValueError("this checkpoint's tokenizer_config.json has no chat_template")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token") or "", eos_token=self.config.get("eos_token") or "", **kwargs)

    @cached_property
    def _template(self):
        """The chat template compiled once (compiling costs far more than rendering)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template)

    def special_ids(self) -> set[int]:
        """Ids of the added special tokens."""
        return {int(i) for i, t in self.config.get("added_tokens_decoder", {}).items() if t.get("special")}
