"""The retrieval tasks' prompt builders and scoring (bench/tasks.py, bench/needle_prompt.py), on
a tokenizer made here: exact lengths, the inserts where asked, what counts as a hit."""
from __future__ import annotations

import random

import pytest

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts
from flexgen_sparpr.bench.tasks import LATE_CONTINUATION, TASKS, build_trial, canonical, hit
from flexgen_sparpr.bench.texts import DATA
from tests.bench.fake_tokenizer import FakeTokenizer


@pytest.fixture(scope="module")
def builder():
    return NeedlePrompts(FakeTokenizer(), DATA / "asyoulik.txt", "The secret passkey is")


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_the_exact_length_and_its_answer_inside(builder, task):
    rng = random.Random(3)
    tok = builder.tok
    lengths = set()
    for depth in (0.1, 0.5, 0.9):
        t = build_trial(task, builder, 1024, depth, rng)
        whole = t.ids + t.forced
        assert len(whole) == 1024
        lengths.add((len(t.ids), len(t.forced)))
        text = tok.decode(whole)
        for e in t.expected:
            assert e in text  # every part of the answer is in the prompt
        assert "<assistant>" in tok.decode(whole[-12:])  # the question, then the answer's opening
        # the asked needle sits near its depth in the filler
        assert 0 < t.where[0] < 1024
    assert len(lengths) == 1  # every trial of a task and length batches without padding


def test_late_question_prefills_the_key_and_forces_continuation_and_question(builder):
    t = build_trial("late-question", builder, 2048, 0.9, random.Random(1))
    assert len(t.forced) == LATE_CONTINUATION + len(builder.tail)
    assert t.where[0] < len(t.ids)  # the key is in the prefilled part ...
    assert t.where[0] > 0.7 * len(t.ids)  # ... near its end
    assert builder.tok.decode(t.forced).endswith("The secret passkey is")  # the question comes late


def test_the_tuning_split_rebuilds_the_original_needle_prompts(builder):
    """The passkey task draws from the seed exactly as NeedlePrompts.build always has."""
    a, b = random.Random(0), random.Random(0)
    from flexgen_sparpr.bench.needle_prompt import random_key
    for depth in (0.25, 0.75):
        t = build_trial("passkey", builder, 900, depth, a)
        n = builder.build(900, depth, random_key(b, 5), b)
        assert t.ids == n.ids and t.expected == (n.key,) and t.where == (n.needle_at,)


@pytest.mark.parametrize("task, answer, expected, right", [
    ("passkey", " 12345. Remember it.", ("12345",), True),
    ("passkey", " 1234.", ("12345",), False),
    ("passkey", " 123456.", ("12345",), False),  # not a whole number
    ("multi-value", " 11111, 22222 and 33333.", ("11111", "22222", "33333"), True),
    ("multi-value", " 11111, 22222.", ("11111", "22222", "33333"), False),
    ("two-needles", " 1234-5678.", ("1234", "5678"), True),
    ("two-needles", " 12345678.", ("1234", "5678"), True),
    ("two-needles", " 5678 1234.", ("1234", "5678"), False),
    ("two-needles", " 1234.", ("1234", "5678"), False),
    ("phrase", " Amber river lantern copper.", ("amber", "river", "lantern", "copper"), True),
    ("phrase", " amber lantern river copper", ("amber", "river", "lantern", "copper"), False),
])
def test_hit(task, answer, expected, right):
    assert hit(task, answer, expected) is right


def test_canonical_answers_agree_on_what_matters():
    assert canonical("passkey", " 12345. Remember it.") == canonical("passkey", " 12345.")
    assert canonical("passkey", " 12345.") != canonical("passkey", " 1234.")
    assert canonical("phrase", " Amber River.\nmore") == "amber river"


def test_unknown_task_and_too_short_prompt(builder):
    with pytest.raises(ValueError):
        build_trial("nope", builder, 1024, 0.5, random.Random(0))
    with pytest.raises(ValueError):
        build_trial("late-question", builder, 300, 0.5, random.Random(0))
