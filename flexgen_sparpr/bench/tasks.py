"""Retrieval tasks harder than one passkey, each built from a filler text like the needle prompts
(bench/needle_prompt.py), with its scoring and a canonical answer for trial-by-trial agreement.

- passkey: one 5-digit key (the original task).
- multi-key: four keys with different labels; the question asks for one.
- multi-value: one label with three values; all must be returned.
- two-needles: two halves of a code in two places; the answer is the first followed by the second.
- late-question: one key near the end of the prompt (depth ~0.9 of the prefill), then a long
  continuation of the text and only then the question, both fed token by token after the
  prefill (teacher-forced decode), so a policy that picked its blocks for the prompt's end must
  still find the key.
- long-key: one 10-digit key.
- phrase: a secret phrase of four random words.

A trial's `ids` are prefilled; its `forced` ids are decoded teacher-forced (late-question only),
then the answer is generated. Every trial of one task and length has the same token counts.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from .needle_prompt import NEEDLE, QUESTION, NeedlePrompts, random_key

TASKS = ("passkey", "multi-key", "multi-value", "two-needles", "late-question", "long-key", "phrase")
LATE_CONTINUATION = 256  # tokens of text between the prefill's end and the late question
# labels and words: common, one or two tokens each, none a number
LABELS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden")
WORDS = ("amber", "river", "lantern", "copper", "meadow", "falcon", "winter", "harbor", "violet", "marble",
         "thunder", "willow", "canyon", "ember", "orchid", "summit", "velvet", "glacier", "cedar", "comet")
GEN_LEN = {"multi-value": 28, "two-needles": 20, "long-key": 16, "phrase": 14}  # answer tokens (default 12)


@dataclass(frozen=True)
class Trial:
    task: str
    ids: list[int]  # prefilled
    expected: tuple[str, ...]  # what a right answer holds (all of it)
    depth: float  # the asked needle's depth
    start: int  # filler offset of the excerpt
    where: tuple[int, ...]  # token index of each insert in the whole prompt (ids + forced)
    text: str = ""  # the filler's name
    forced: list[int] = field(default_factory=list)  # teacher-forced after the prefill (late-question)

    @property
    def gen_len(self) -> int:
        return GEN_LEN.get(self.task, 12)


def _numbers(answer: str) -> list[str]:
    return re.findall(r"\d+", answer)


def canonical(task: str, answer: str) -> str:
    """What two answers must share to agree: the numbers they give, in order (the phrase tasks:
    the lower-case words of the first line)."""
    if task == "phrase":
        return " ".join(re.findall(r"[a-z]+", answer.lower().split("\n")[0]))
    return " ".join(_numbers(answer))


def hit(task: str, answer: str, expected: tuple[str, ...]) -> bool:
    """Whether an answer is right: every expected key as a whole number (two-needles: the first
    half then the second, at most 3 characters apart), or the phrase's words in order."""
    if task == "phrase":
        return " ".join(expected) in canonical(task, answer)
    if task == "two-needles":
        a, b = expected
        return re.search(rf"(?<!\d){a}\D{{0,3}}{b}(?!\d)", answer) is not None
    nums = set(_numbers(answer))
    return all(e in nums for e in expected)


def _pick_depths(rng: random.Random, depth: float, count: int, gap: float = 0.1) -> list[float]:
    """`depth` first, then count - 1 other depths in [0.05, 0.95], each >= gap from the others."""
    out = [depth]
    while len(out) < count:
        d = round(rng.uniform(0.05, 0.95), 3)
        if all(abs(d - o) >= gap for o in out):
            out.append(d)
    return out


def build_trial(task: str, b: NeedlePrompts, length: int, depth: float, rng: random.Random,
                text: str = "") -> Trial:
    """One trial of `task` whose prompt (prefill plus any forced tokens) is `length` tokens."""
    if task in ("passkey", "long-key"):
        key = random_key(rng, 5 if task == "passkey" else 10)
        ids, where, start = b.build_many(length, [(depth, b.encode(NEEDLE.format(key=key)))], rng)
        return Trial(task, ids, (key,), depth, start, tuple(where), text)
    if task == "multi-key":
        labels = rng.sample(LABELS, 4)
        keys = [random_key(rng, 5) for _ in labels]
        depths = _pick_depths(rng, depth, len(labels))
        inserts = [(d, b.encode(f"The secret passkey for {lab} is {k}.")) for d, lab, k in zip(depths, labels, keys)]
        _, tail = b.template(f"What is the secret passkey for {labels[0]} mentioned in the text above? "
                             "Answer with the number only.", f"The secret passkey for {labels[0]} is")
        ids, where, start = b.build_many(length, inserts, rng, tail)
        return Trial(task, ids, (keys[0],), depth, start, tuple(where), text)
    if task == "multi-value":
        label = rng.choice(LABELS)
        values = [random_key(rng, 5) for _ in range(3)]
        depths = _pick_depths(rng, depth, 3)
        inserts = [(d, b.encode(f"One of the special numbers for {label} is {v}.")) for d, v in zip(depths, values)]
        _, tail = b.template(f"What are all the special numbers for {label} mentioned in the text above? "
                             "Answer with the numbers only.", f"The special numbers for {label} are")
        ids, where, start = b.build_many(length, inserts, rng, tail)
        return Trial(task, ids, tuple(values), depth, start, tuple(where), text)
    if task == "two-needles":
        first, second = random_key(rng, 4), random_key(rng, 4)
        d2 = _pick_depths(rng, depth, 2, gap=0.2)[1]
        inserts = [(depth, b.encode(f"The first half of the secret code is {first}.")),
                   (d2, b.encode(f"The second half of the secret code is {second}."))]
        _, tail = b.template("The secret code is its first half followed by its second half. What is the "
                             "secret code? Answer with the number only.", "The secret code is")
        ids, where, start = b.build_many(length, inserts, rng, tail)
        return Trial(task, ids, (first, second), depth, start, tuple(where), text)
    if task == "phrase":
        words = rng.sample(WORDS, 4)
        inserts = [(depth, b.encode(f"The secret phrase is {' '.join(words)}."))]
        _, tail = b.template("What is the secret phrase mentioned in the text above? Answer with the phrase only.",
                             "The secret phrase is")
        ids, where, start = b.build_many(length, inserts, rng, tail)
        return Trial(task, ids, tuple(words), depth, start, tuple(where), text)
    if task == "late-question":
        # the whole prompt as one passkey prompt; the key at `depth` of the part that is prefilled
        key = random_key(rng, 5)
        late = LATE_CONTINUATION + len(b.tail)  # forced: the continuation, then the question
        d = depth * (length - late) / length
        ids, where, start = b.build_many(length, [(d, b.encode(NEEDLE.format(key=key)))], rng)
        if where[0] >= length - late:
            raise ValueError(f"length {length} leaves no room for a continuation before the late question")
        return Trial(task, ids[:length - late], (key,), depth, start, tuple(where), text, ids[length - late:])
    raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")


__all__ = ["TASKS", "Trial", "build_trial", "canonical", "hit", "QUESTION"]
