"""A word-level tokenizer made on the spot (no hub): a token per run of spaces + a word, a single
digit or a punctuation mark, like SmolLM2's digit-by-digit numbers; with a chat template."""
from __future__ import annotations

import re

_PIECE = re.compile(r"\s*(?:\d|[A-Za-z']+|[^\sA-Za-z\d])|\s+")


class FakeTokenizer:
    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.inv)
            self.inv.append(piece)
        return self.vocab[piece]

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [self._id(p) for p in _PIECE.findall(text)]}

    def convert_ids_to_tokens(self, ids):
        return [self.inv[i] for i in ids]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.inv[i] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False) -> str:
        body = "".join(f"<user>{m['content']}</user>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")
