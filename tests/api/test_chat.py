"""ChatSession (api/chat.py): the KV cache kept across turns. A later turn computes only its own
tokens (plus the last answer's final token), and its answer equals what a full re-prefill of the
same conversation gives (greedy), with the KV resident or on disk: under dense, and under SparPR
reading every block (keep 1: its summaries, hooks and fed steps in play). At a tighter keep a
selecting policy picks from summaries whose basis the first turn's prefill fitted, so its answers
may differ from a re-prefill's as any two selections may; it is tested to converse."""
from __future__ import annotations

import pytest

from flexgen_sparpr import LLM
from flexgen_sparpr.api.chat import ChatSession
from flexgen_sparpr.errors import ConfigError

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name one river that flows through it."]


@pytest.fixture(scope="module")
def llm(smollm2_dir, tmp_path_factory):
    with LLM("smollm2-135m", quiet=True, offload_dir=str(tmp_path_factory.mktemp("off"))) as m:
        yield m


def _converse(session: ChatSession) -> tuple[list[int], list[int]]:
    """Three turns; returns each turn's positions computed before its answer, and its answer tokens."""
    prefilled, answers = [], []
    for q in QUESTIONS:
        answer = "".join(session.send(q))
        assert answer.strip() and session.last.ended in ("stop", "length")
        prefilled.append(session.last.positions_prefilled)
        answers.append(session.last.answer_tokens)
    return prefilled, answers


@pytest.mark.parametrize("placement", ["resident", "disk"])
@pytest.mark.parametrize("policy", ["dense", "sparpr@1"])
def test_third_turn_prefills_only_its_own_tokens_and_answers_as_a_full_prefill(smollm2_dir, tmp_path, policy,
                                                                               placement):
    percent = [100, 0, 100, 0, 100, 0] if placement == "resident" else [100, 0, 0, 0, 100, 0]
    knobs = {"kv_policy": "sparpr", "keep_ratio": 1.0} if policy == "sparpr@1" else {}
    with LLM("smollm2-135m", quiet=True, percent=percent, offload_dir=str(tmp_path), gpu_batch_size=1, **knobs) as llm:
        s = ChatSession(llm, max_context=1024, max_tokens=24)
        prefilled, answers = _converse(s)
        tok = llm.tokenizer
        own = tok(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[2]}], add_generation_prompt=True,
                                          tokenize=False), add_special_tokens=False)["input_ids"]
        # turn 3 computed the end of answer 2 and its own templated tokens, not the conversation
        assert prefilled[2] < len(own) + 2 and prefilled[2] < s.context_tokens // 3, (prefilled, len(own))
        # every position was computed once: a later turn's count includes the previous answer's final
        # token (sampled in its answer, computed in this turn); the newest answer's last is not yet in
        assert s.context_tokens == sum(prefilled) - (len(prefilled) - 1) + sum(answers) - 1
        ctx, answer = s.context_ids(), s.last.answer_ids
        prefix = ctx[:len(ctx) - (len(answer) - 1)]  # the conversation up to turn 3's answer
        again = llm.generate_ids([prefix], llm.params(len(answer), stop="eos"))[0][:len(answer)]
    assert again == answer


def test_sparpr_converses_on_disk(smollm2_dir, tmp_path):
    """At its defaults but the token floor: the conversation stays under 768 tokens, which the
    floor would read whole."""
    with LLM("smollm2-135m", quiet=True, percent=[100, 0, 0, 0, 100, 0], kv_policy="sparpr",
             min_keep_tokens=0, offload_dir=str(tmp_path)) as llm:
        s = ChatSession(llm, max_context=1024, max_tokens=24)
        prefilled, _ = _converse(s)
        assert prefilled[2] < s.context_tokens // 3
        assert s.stats()["kv_bytes"]["disk"] > 0 and s.stats()["last_turn"]["kv_read_share"] < 1


def test_reset_starts_over_and_a_full_context_is_refused(llm):
    s = ChatSession(llm, max_context=64, max_tokens=8)
    "".join(s.send("Hi"))
    first = s.last.positions_prefilled
    with pytest.raises(ConfigError, match="--max-context"):
        "".join(s.send("Tell me everything about the history of the world, in great detail. " * 3))
    s.reset()
    assert s.context_tokens == 0 and not s.messages
    "".join(s.send("Hi"))
    assert s.last.positions_prefilled == first  # the whole templated prompt again, nothing kept


def test_an_interrupted_answer_keeps_the_cache_whole(llm):
    s = ChatSession(llm, max_context=512, max_tokens=64)
    pieces = list(s.send("Count from one to fifty.", interrupted=lambda: True))
    assert s.last.ended == "interrupted" and s.last.answer_tokens == 1 and len(pieces) <= 1
    before = s.context_tokens
    "".join(s.send("Thanks."))
    # the cut answer's token, the end token the template expects, then the new turn's own tokens
    assert s.context_tokens > before and s.last.positions_prefilled >= 3


def test_a_model_without_a_chat_template_is_refused(tiny_opt_dir, tmp_path):
    with LLM(str(tiny_opt_dir), quiet=True, offload_dir=str(tmp_path)) as m:
        with pytest.raises(ConfigError, match="chat template"):
            ChatSession(m)
