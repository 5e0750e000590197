"""Requests grouped into the engine's batches, on one worker thread that owns the engine.

Static batching: the engine prefills a whole batch at once and decodes it in lock step, so a
request waits for the batch in flight, then joins the next one with every request waiting then
(up to gpu_batch_size x num_gpu_batches, the same per-request KV policy, and a padded prompt plus
the longest answer within the model's positions). A batch ends when each of its requests has
ended or been cancelled; its KV blocks and offload files are freed then, except a one-request
batch's with --prefix-cache-gb on: its cache is kept (engine/prefix_cache.py), and a later request
whose prompt starts as its did (at least half of it) runs as a batch of its own, prefilling only
the rest onto the kept cache (prefix reuse is per sequence: a batch's rows are left-padded apart).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

from ..errors import ConfigError
from .errors import ApiError
from .requests import Request
from .text import Answer

log = logging.getLogger("flexgen_sparpr.serve")


class Ticket:
    """One request in the batcher: its Request, where its events go (an asyncio queue of the
    server's loop: ("token", (piece, [logprob entry] or None)), ("done", info), ("error", ApiError)) and its Answer."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop):
        self.req, self.loop, self.events = req, loop, asyncio.Queue()
        self.arrived, self.first_token_at = time.perf_counter(), None
        self.answer: Answer | None = None
        self.failed = False  # the engine failed under it (it got a 500)
        self.cancelled = False  # its client left (set by the server's loop; read between engine steps)
        self.kv_key = tuple(sorted(req.kv.items())) if req.kv else None

    @property
    def ended(self) -> bool:
        return self.cancelled or self.failed or (self.answer is not None and self.answer.finish_reason is not None)

    def send(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


def default_stop(llm) -> int | None:
    """The stop token a request ends at: the API's default (engine/sampling.py STOP_DEFAULT, the
    model's end token), as in run, batch and chat; a model that names no end token runs each request
    to its max_tokens (its stop strings still apply)."""
    try:
        return llm.params(1).stop
    except ConfigError:  # "--stop eos: ... names no end token"
        return None


class Batcher:
    """Owns the LLM's engine: submit() queues a Ticket (429 past max_queue waiting), the worker
    runs batches; close() refuses new tickets, finishes the queued ones, then returns.
    window_s: how long the first waiting request waits for others before its batch starts.
    on_batch(tickets, stats, info, prefix) runs after each batch (metrics; prefix: the prefix cache's
    counts and kept bytes then)."""

    def __init__(self, llm, max_queue: int, window_s: float = 0.0, on_batch=None):
        self.llm, self.max_queue, self.window_s, self.on_batch = llm, max_queue, window_s, on_batch
        self.stop_id = default_stop(llm)
        self.limit = llm.spec.context_limit()[0]
        self.cond = threading.Condition()
        self.waiting: list[Ticket] = []
        self.running: list[Ticket] = []
        self.closing = False
        self.num_batches = 0
        self._policies: dict = {}
        self.own_policy = llm.engine.kv_policy
        self.thread = threading.Thread(target=self._loop, name="flexgen-batcher", daemon=True)
        self.thread.start()

    # --- the server's side ---
    def check_kv(self, req: Request) -> None:
        """400 when the request's KV policy cannot run on this engine's cache layout."""
        if req.kv is not None:
            self._policy(tuple(sorted(req.kv.items())))

    def submit(self, t: Ticket) -> None:
        with self.cond:
            if self.closing:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting): retry later",
                               code="queue_full")
            self.waiting.append(t)
            self.cond.notify()

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join()

    # --- the worker ---
    def _policy(self, key: tuple):
        if key not in self._policies:
            try:
                self._policies[key] = self.llm.kv_policy_for(dict(key))
            except (ConfigError, ValueError) as e:
                raise ApiError(400, f"kv_policy: {e}", "kv_policy", "invalid_value") from None
        return self._policies[key]

    def _loop(self) -> None:
        batch: list[Ticket] = []
        while True:
            if not batch:
                with self.cond:
                    while not self.waiting and not self.closing:
                        self.cond.wait()
                    if not self.waiting:
                        return
                    first = self.waiting[0].arrived
                wait = first + self.window_s - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                with self.cond:
                    batch = self._pick()
            if batch:
                batch = self._run(batch)

    def _pick(self) -> list[Ticket]:
        """The next batch: the oldest waiting request and those after it that can join it."""
        self.waiting = [t for t in self.waiting if not t.cancelled]
        if not self.waiting:
            return []
        batch = [self.waiting[0]]
        for t in self.waiting[1:] if not self._reuses(batch[0]) else ():
            if len(batch) == self.llm.batch_size:
                break
            if t.kv_key == batch[0].kv_key and self._fits(batch + [t]) and not self._reuses(t):
                batch.append(t)
        self.waiting = [t for t in self.waiting if t not in batch]
        return batch

    def _reuses(self, t: Ticket) -> bool:
        """Whether a kept cache holds at least half of t's prompt (t then runs alone, to reuse it)."""
        cache = self.llm.prefix_cache
        if not cache.enabled or not len(cache):
            return False
        ids = t.req.ids
        pol = self._policy(t.kv_key) if t.kv_key else self.own_policy
        hit = cache.lookup(ids, pol, len(ids) + (t.req.max_new or self.limit - len(ids)), count=False)
        return hit is not None and 2 * hit.tokens >= len(ids)

    def _fits(self, batch: list[Ticket]) -> bool:
        plen = max(len(t.req.ids) for t in batch)  # the batch's prompts are left-padded to one length
        return plen + max(t.req.max_new or 1 for t in batch) <= self.limit

    def _run(self, batch: list[Ticket]) -> list[Ticket]:
        """Run one batch; returns the next, taken from the queue before this one's answers go out (so
        their clients' next requests queue behind it, not beside it, and --max-queue holds)."""
        llm = self.llm
        plen = max(len(t.req.ids) for t in batch)
        params = []
        for t in batch:  # no max_tokens: until the end token or the batch's context end
            t.answer = Answer(llm.tokenizer, t.req.stops, t.req.max_new or self.limit - plen, self.stop_id)
            params.append(t.req.params(t.answer.max_new, self.stop_id))
        self.num_batches += 1
        self.running = batch
        t_prefilled = None
        try:
            pol = self._policy(batch[0].kv_key) if batch[0].kv_key else None
            steps = llm.batch_steps([t.req.ids for t in batch], params, kv_policy=pol,
                                    keep=lambda: not all(t.cancelled for t in batch))  # a left client's KV goes
            try:
                for step in steps:
                    if t_prefilled is None:
                        t_prefilled = time.perf_counter()
                    if step.result is not None or self._take(batch, step):
                        break
            finally:
                steps.close()  # ends the engine's batch here when every request has ended
        except Exception as e:  # noqa: BLE001  (one logged line; the clients get a 500, not a traceback)
            log.error("batch %d failed: %s: %s", self.num_batches, type(e).__name__, " ".join(str(e).split())[:300])
            with self.cond:
                following = self._pick()
            for t in batch:
                if not t.ended:
                    t.failed = True
                    t.send("error", ApiError(500, "internal error while generating (logged on the server)"))
            return following
        finally:
            self.running = []
        stats, t1 = llm.last_stats, time.perf_counter()
        decoded = sum(max(0, len(t.answer.token_ids) - 1) for t in batch)  # the prefill gave each its first
        rate = decoded / (t1 - t_prefilled) if t_prefilled is not None and decoded else None
        info = {"batch_id": self.num_batches, "batch_rows": len(batch), "kv_read_share": stats.kv_read_share,
                "decode_tokens_per_s": rate, "kv_policy": dict(batch[0].kv_key or ()) or None,
                "prefix_reused_tokens": stats.reused_tokens}
        with self.cond:
            following = self._pick()
        for t in batch:
            if not t.cancelled:
                t.send("done", info)
        if self.on_batch is not None:
            cache = llm.prefix_cache
            self.on_batch(batch, stats, info, {"stats": dataclasses.replace(cache.stats), "held": cache.held()})
        return following

    def _take(self, batch: list[Ticket], step) -> bool:
        """This step's token of every live request, sent on; True when all have ended."""
        toks = step.state.tokens[-1].tolist()  # [B]
        logprobs = step.state.sampler.logprobs
        now = time.perf_counter()
        for r, t in enumerate(batch):
            if t.ended:
                continue
            if t.first_token_at is None:
                t.first_token_at = now
            lp = logprobs[r][-1] if t.req.logprobs is not None else None
            piece = t.answer.push(toks[r], lp)
            t.send("token", (piece, t.answer.logprobs[-1:] if lp is not None else None))
        return all(t.ended for t in batch)

