"""Passkey-retrieval ("needle in a haystack") prompts, as in the SparPR paper's fidelity task.

A passkey sentence is hidden at a relative depth of a filler excerpt, the excerpt is cut so the
whole chat prompt is exactly the target number of tokens, and the user turn asks for the key.
Prompts are assembled from token pieces (template head, filler slice, needle, question, template
tail), so every prompt of one length has the same token count and a batch needs no padding.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

NEEDLE = "The secret passkey is {key}. Remember it."
QUESTION = "What is the secret passkey mentioned in the text above? Answer with the number only."
_SENTENCE_END = re.compile(r"[.!?][`'\")\]]*$")


@dataclass(frozen=True)
class Needle:
    """One prompt: token ids and where its needle sits."""

    ids: list[int]
    key: str
    depth: float  # asked-for relative depth in the excerpt
    start: int  # filler token offset of the excerpt
    needle_at: int  # token index of the needle inside the prompt


def normalise_filler(text: str) -> str:
    """Join hard-wrapped lines and drop indentation: paragraphs become single lines."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return "\n".join(p for p in paras if p)


def passkey_hit(answer: str, key: str) -> bool:
    """Exact match: the key's digits appear in the answer as a whole number."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


def random_key(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


class NeedlePrompts:
    """Builds needle prompts from one filler text with one tokenizer (a chat template needed)."""

    def __init__(self, tokenizer, filler: str | Path, answer_prefix: str = ""):
        self.tok = tokenizer
        text = Path(filler).read_text(encoding="utf-8", errors="replace") if isinstance(filler, Path) else filler
        self.filler = self._encode(normalise_filler(text))
        # sentence ends: a needle or an excerpt start goes right after one of these tokens
        pieces = self.tok.convert_ids_to_tokens(self.filler[:-1])
        self.cuts = [i + 1 for i, t in enumerate(pieces) if _SENTENCE_END.search(t)]
        if len(self.cuts) < 2:
            raise ValueError("filler text has too few sentences")
        self.answer_prefix = answer_prefix
        self.head, self.tail = self.template(QUESTION, answer_prefix)

    def template(self, question: str, answer_prefix: str) -> tuple[list[int], list[int]]:
        """Token ids of the chat template before the context and after it (the question, the
        assistant turn's opening, the answer prefix)."""
        marker = "\x00CONTEXT\x00"
        chat = self.tok.apply_chat_template([{"role": "user", "content": f"{marker}\n\n{question}"}],
                                            add_generation_prompt=True, tokenize=False)
        head, tail = chat.split(marker)
        return self._encode(head), self._encode(tail + answer_prefix)

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def overhead(self, key: str) -> int:
        return len(self.head) + len(self.tail) + len(self._needle(key))

    def encode(self, text: str) -> list[int]:
        """Token ids of a sentence inserted into the filler (a leading space, as after a sentence end)."""
        return self._encode(" " + text)

    def _needle(self, key: str) -> list[int]:
        return self.encode(NEEDLE.format(key=key))

    def build(self, length: int, depth: float, key: str, rng: random.Random) -> Needle:
        """A prompt of exactly `length` tokens with the key at `depth` (0 = start, 1 = end)."""
        ids, (at,), start = self.build_many(length, [(depth, self._needle(key))], rng)
        return Needle(ids, key, depth, start, at)

    def build_many(self, length: int, inserts: list[tuple[float, list[int]]], rng: random.Random,
                   tail: list[int] | None = None) -> tuple[list[int], list[int], int]:
        """A prompt of exactly `length` tokens: a filler excerpt with each insert's token ids after
        the sentence end nearest its depth (0 = start, 1 = end), then `tail` (default: the passkey
        question's). Returns the ids, each insert's token index in the prompt (in the order given)
        and the excerpt's filler offset. One insert draws from rng exactly as `build` always has."""
        tail = self.tail if tail is None else tail
        n = length - len(self.head) - len(tail) - sum(len(p) for _, p in inserts)  # filler tokens
        if n < 16:
            raise ValueError(f"length {length} leaves no room for filler")
        starts = [c for c in self.cuts if c + n <= len(self.filler)] or [0]
        start = rng.choice(starts)
        excerpt = self.filler[start:start + n]
        if len(excerpt) < n:  # filler shorter than the context: wrap around
            excerpt = (excerpt + self.filler * (n // len(self.filler) + 1))[:n]
        # the sentence end in the excerpt nearest to each asked depth
        ends = [c - start for c in self.cuts if 0 < c - start < n]
        cut = [min(ends, key=lambda e: abs(e - d * n)) if ends else round(d * n) for d, _ in inserts]
        order = sorted(range(len(inserts)), key=lambda i: (cut[i], i))
        ids, prev, where = list(self.head), 0, [0] * len(inserts)
        for i in order:
            ids += excerpt[prev:cut[i]]
            prev = cut[i]
            where[i] = len(ids)
            ids += inserts[i][1]
        ids += excerpt[prev:] + tail
        assert len(ids) == length
        return ids, where, start
