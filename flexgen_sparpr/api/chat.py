"""A multi-turn conversation on one LLM whose KV cache is kept between turns.

The first turn prefills the chat-templated conversation; each later turn is the whole
conversation's tokens again, which the LLM's prefix cache (LLM.keep_prefixes, engine/reuse.py: the
server's prefix reuse, one mechanism) finds kept: only the last answer's final token and the turn's
own tokens are prefilled onto the kept cache, in one pass, under any KV policy and placement, the
cache's blocks staying on whichever tier holds them. So a long conversation never prefills its
earlier turns again: `stats()["last_turn"]["positions_prefilled"]` says how many positions the last
turn computed before its answer.

The cache is made for `max_context` tokens (the conversation's ceiling); past it, a turn is
refused with a ConfigError and `reset()` starts over. A policy that cannot go on from a kept
cache (H2O, DKV: `reuses_prefix`) prefills each turn whole.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..storage.tiers import Tier
from .outputs import TextStream


@dataclass
class Turn:
    """What the last turn cost: positions computed before the answer (prefilled or appended),
    answer tokens, seconds of each phase, and the share of the cached blocks its steps read."""

    positions_prefilled: int = 0
    answer_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_read_share: float | None = None
    ended: str = ""  # "stop" (the end token), "length" (max_tokens), "interrupted"
    answer_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.answer_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class ChatSession:
    """llm: an api.llm.LLM with a chat-templated tokenizer and one sequence per batch allowed.
    max_context: the cache's size in tokens (default: the model's context limit, at most 8192)."""

    llm: object
    max_context: int | None = None
    max_tokens: int = 512  # per answer
    system: str | None = None
    sampling: dict = field(default_factory=dict)  # LLM.params' do_sample, temperature, top_p, seed
    messages: list[dict] = field(default_factory=list)
    last: Turn = field(default_factory=Turn)

    def __post_init__(self):
        tok = self.llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ConfigError(f"{self.llm.spec.name} has no chat template: chat needs an instruction-tuned model "
                              "with one (e.g. smollm2-135m)")
        limit, _ = self.llm.spec.context_limit()
        self.max_context = min(limit, 8192) if self.max_context is None else self.max_context
        if not 2 <= self.max_context <= limit:
            raise ConfigError(f"--max-context must be in [2, {limit}] for {self.llm.spec.name} "
                              f"(got {self.max_context})")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1 (got {self.max_tokens})")
        self.eos = self.llm.spec.eos_id
        if not self.llm.prefix_cache.enabled:
            self.llm.keep_prefixes(None)  # the conversation's cache, kept between turns
        self._ids: list[int] = []  # the conversation's tokens: the cache holds all but the last

    # --- the conversation ---
    def reset(self) -> None:
        """Forget the conversation and free its cache."""
        self.messages.clear()
        self._ids = []
        self.llm.prefix_cache.close()
        self.llm.engine.free_tables()

    @property
    def context_tokens(self) -> int:
        """Positions in the cache (the last sampled token joins it with the next turn)."""
        return max(0, len(self._ids) - 1)

    def context_ids(self) -> list[int]:
        """The token ids in the cache, in order (the first prompt, then every token fed or sampled)."""
        return self._ids[:-1]

    def send(self, text: str, interrupted=lambda: False):
        """Add a user message and stream the answer's text pieces. interrupted(): checked between
        steps; True ends the answer there (the cache stays whole). The answer joins the messages."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError("an empty message: type some text")
        llm = self.llm
        ids = self._ids + self._new_ids(text)
        room = self.max_context - len(ids)
        if room < 1:
            raise ConfigError(f"the conversation would pass --max-context {self.max_context} tokens: /reset starts over")
        self.messages.append({"role": "user", "content": text})
        turn = self.last = Turn()
        read0 = list(llm.engine.reader.blocks_read)
        params = llm.params(min(room, self.max_tokens), **self.sampling)
        # the one prefix-reuse path (engine/reuse.py): the kept cache holds every token before the
        # last answer's final one, so only that token and this turn's are computed
        steps = llm.batch_steps([ids], [params], capacity=self.max_context)
        yield from self._answer(steps, ids, params.max_new, interrupted, turn)
        read, cached = (n - n0 for n, n0 in zip(llm.engine.reader.blocks_read, read0))
        turn.kv_read_share = read / cached if cached else None

    def _answer(self, steps, ids: list[int], limit: int, interrupted, turn: Turn):
        text, out, t0 = TextStream(self.llm.tokenizer), [], time.perf_counter()
        t1 = None
        try:
            for step in steps:
                if step.result is not None:
                    break
                if t1 is None:
                    t1 = time.perf_counter()
                    turn.prefill_s, turn.positions_prefilled = t1 - t0, len(ids) - self.llm.last_stats.reused_tokens
                out.append(int(step.state.tokens[-1][0]))
                done = out[-1] == self.eos
                piece = text.push(out[-1], final=done)
                if piece:
                    yield piece
                if done or len(out) >= limit:
                    turn.ended = "stop" if done else "length"
                    break
                if interrupted():
                    turn.ended = "interrupted"
                    break
        finally:
            steps.close()  # the cache is kept (LLM.keep_prefixes) with every token but the last sampled
            self._ids = ids + out
            turn.answer_tokens, turn.answer_ids = len(out), out
            turn.decode_s = time.perf_counter() - (t1 or t0)
            answer = self.llm.tokenizer.decode(out, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": answer})

    def _new_ids(self, text: str) -> list[int]:
        """The tokens this turn adds: the whole templated conversation on the first turn, else the
        template's text past the last answer's end token (that token, the last sampled one, joins
        the cache as the first appended position; an answer cut short gets the end token first)."""
        tok = self.llm.tokenizer
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        new = tok.apply_chat_template(msgs + [{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=False)
        if not self._ids:
            return self._encode(new)
        before = tok.apply_chat_template(msgs, tokenize=False)
        eos_text = tok.decode([self.eos])
        cut = before.rfind(eos_text) + len(eos_text)
        if cut < len(eos_text) or not new.startswith(before[:cut]):
            raise ConfigError("the chat template does not extend the conversation it rendered: /reset starts over")
        ids = self._encode(new[cut:])
        return ids if self._ids[-1] == self.eos else [self.eos, *ids]

    def _encode(self, text: str) -> list[int]:
        ids = self.llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ConfigError("the message encodes to no tokens")
        return ids

    # --- what /stats shows ---
    def stats(self) -> dict:
        """Tokens in the context, KV bytes per tier (all layers), and the last turn's costs."""
        eng, t = self.llm.engine, self.last
        tables = [tab for kept in self.llm.prefix_cache.kept() for tab in kept.tables.values()]
        tiers = {tier.name.lower(): sum(tab.nbytes_on(tier) for tab in tables) for tier in Tier}
        return {"context_tokens": self.context_tokens, "max_context": self.max_context, "kv_bytes": tiers,
                "kv_policy": eng.kv_policy.name,
                "last_turn": {"positions_prefilled": t.positions_prefilled, "answer_tokens": t.answer_tokens,
                              "prefill_s": t.prefill_s, "decode_tok_per_s": t.tokens_per_s,
                              "kv_read_share": t.kv_read_share, "ended": t.ended}}
