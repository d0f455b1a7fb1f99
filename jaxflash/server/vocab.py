"""The vocabulary as the server needs it: each token's exact bytes, which added tokens are control tokens, a
second encoder that reads control tokens written in text as plain text, and the llguidance tokenizer built from
the same tables.

Which added tokens are special comes from tokenizer_config.json (`added_tokens_decoder`), falling back to
tokenizer.json. The two files can disagree (checkpoints written before jaxflash's tokenizer builder fixed it
marked `<think>`, `<tool_call>` and the other markup tokens special in tokenizer.json only); the config wins,
because the markup is ordinary output text there, and llguidance gets the resulting table rather than reading
tokenizer.json, where it would treat those ids as control tokens that no grammar text can match.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(d) for d in decoder.get("decoders", []))


class Vocab:
    def __init__(self, tokenizer, eos_ids=(), n_vocab: int | None = None):
        """tokenizer: a jaxflash.tokenizer.Tokenizer (tokenizer.json + tokenizer_config.json); eos_ids: the model's
        end-of-sequence ids (what a grammar lets the model stop with); n_vocab: the model's vocabulary size, when
        its embedding is padded beyond the tokenizer's ids."""
        from tokenizers import Tokenizer as _HF

        self.tokenizer = tokenizer
        self.size = max(tokenizer.vocab_size, n_vocab or 0)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        spec = json.loads(Path(tokenizer.path).read_text())
        declared = tokenizer.config.get("added_tokens_decoder", {})
        self.added: dict[int, str] = {}
        self.special_ids: set[int] = set()
        for t in spec.get("added_tokens", []):
            special = declared.get(str(t["id"]), {}).get("special", t.get("special", False))
            t["special"] = bool(special)
            self.added[t["id"]] = t["content"]
            if special:
                self.special_ids.add(t["id"])
        self.special_texts = tuple(self.added[i] for i in sorted(self.special_ids))
        # Control tokens written in text stay text with this encoder; the markup tokens still encode as themselves.
        self._plain = _HF.from_str(json.dumps(spec))
        self._plain.encode_special_tokens = True
        self.token_bytes = self._bytes_table(spec)
        self.max_token_bytes = max(len(b) for b in self.token_bytes)

    def _bytes_table(self, spec: dict) -> list[bytes]:
        if not _is_byte_level(spec.get("decoder")):  # not GPT-2 style: a token's text is as close as it gets
            table = [self.tokenizer.decode([i]).encode() for i in range(self.tokenizer.vocab_size)]
            return table + [b""] * (self.size - len(table))
        chars = _byte_level_chars()
        names = {i: s for s, i in spec["model"]["vocab"].items()}
        table = []
        for i in range(self.tokenizer.vocab_size):
            if i in self.added:
                table.append(self.added[i].encode())
            else:
                name = names.get(i, "")
                table.append(bytes(chars[c] for c in name if c in chars))
        return table + [b""] * (self.size - len(table))  # padding ids of the embedding: no text

    # ----- encoding ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of trusted text (a rendered template, a raw completions prompt): control tokens written in
        it are those tokens."""
        return self.tokenizer.encode(text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of untrusted text: `<|im_end|>` written by a user is the characters, not the control token."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def has_special_text(self, text: str) -> bool:
        return any(s in text for s in self.special_texts)

    # ----- llguidance --------------------------------------------------------------------------------------
    @cached_property
    def ll_tokenizer(self):
        """llguidance's tokenizer over these token bytes and special ids; forced text is tokenised by the plain
        encoder, so a grammar's literal "<|im_end|>" is text and `<|im_end|>` (or `<[2]>`) the token."""
        import llguidance

        vocab = self
        real = self.tokenizer.vocab_size
        pad = list(range(real, self.size))  # embedding padding: named control tokens no text can match

        class _Source:
            tokens = vocab.token_bytes[:real] + [f"<|pad_{i}|>".encode() for i in pad]
            special_token_ids = sorted(vocab.special_ids) + pad
            eos_token_id = vocab.eos_ids[0] if vocab.eos_ids else 0
            bos_token_id = None

            def __call__(self, data: bytes) -> list[int]:
                return vocab.encode_plain(data.decode("utf-8", errors="replace"))

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Source()), eos_token=list(self.eos_ids) or None)
