"""The OpenAI response shapes: a whole completion / chat completion, and the chunks of a stream
(text_completion chunks or chat.completion.chunk deltas). `flexgen` carries this engine's facts
about the answer's batch (its id and size, decode tokens/s, the share of KV blocks read)."""
from __future__ import annotations

import time
import uuid


class Shaper:
    """The response pieces of one request (kind "completion" or "chat")."""

    def __init__(self, kind: str, model: str, tokenizer):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion" if self.kind == "chat" else "text_completion") + (
            ".chunk" if chunk and self.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, answer, prompt_tokens: int, info: dict) -> dict:
        lp = self.logprobs(answer.logprobs) if answer.logprobs else None
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": lp,
                      "finish_reason": answer.finish_reason}
        else:
            choice = {"index": 0, "text": answer.text, "logprobs": lp, "finish_reason": answer.finish_reason}
        return {**self._head(False), "choices": [choice], "usage": usage(prompt_tokens, answer), "flexgen": info}

    def chunk(self, piece: str | None, logprobs: list | None = None, finish_reason: str | None = None,
              role: bool = False) -> dict:
        """One stream chunk: a text piece (None: none), the logprobs of its tokens, the end."""
        lp = self.logprobs(logprobs) if logprobs else None
        if self.kind == "chat":
            delta = ({"role": "assistant"} if role else {}) | ({"content": piece} if piece is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": lp, "finish_reason": finish_reason}
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, answer, info: dict) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(prompt_tokens, answer), "flexgen": info}

    def logprobs(self, entries: list) -> dict:
        """entries: (token id, logprob, [(id, logprob)] top) per token, in the endpoint's shape."""
        text = self._token_text
        if self.kind == "chat":
            return {"content": [{"token": text(i), "logprob": lp, "bytes": list(text(i).encode()),
                                 "top_logprobs": [{"token": text(j), "logprob": v, "bytes": list(text(j).encode())}
                                                  for j, v in top]} for i, lp, top in entries]}
        return {"tokens": [text(i) for i, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(j): v for j, v in top} for _, _, top in entries]}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)


def usage(prompt_tokens: int, answer) -> dict:
    n = len(answer.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
