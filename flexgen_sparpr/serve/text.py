"""A request's answer as its tokens come: the text in pieces (held back while it could be the
start of a stop string), the tokens counted, their log-probabilities, and why it ended."""
from __future__ import annotations

from ..api.outputs import TextStream


class StopScan:
    """Text pieces with the stop strings cut out: a piece is handed on once no stop string can
    begin in it; the first stop string found ends the text before it (OpenAI's `stop`)."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.hit = stops, "", False

    def feed(self, piece: str, final: bool = False) -> str:
        text, self.held = self.held + piece, ""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            return text[:min(found)]
        if final:
            return text
        keep = max((n for s in self.stops for n in range(1, min(len(s), len(text)) + 1)
                    if text.endswith(s[:n])), default=0)  # a tail that may begin a stop string
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


class Answer:
    """One request's tokens and text; finish_reason is set ("stop" or "length") once it ended."""

    def __init__(self, tokenizer, stops: list[str], max_new: int, stop_id: int | None):
        self.stream, self.scan = TextStream(tokenizer), StopScan(stops)
        self.max_new, self.stop_id = max_new, stop_id
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, float, list]] = []  # (token id, its logprob, [(id, logprob)] top)
        self.text = ""
        self.finish_reason: str | None = None

    def push(self, token_id: int, logprob: tuple | None = None) -> str:
        """Take the next token (and its (logprob, top) when asked); returns the text it adds."""
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append((token_id, *logprob))
        ended = "stop" if token_id == self.stop_id else "length" if len(self.token_ids) >= self.max_new else None
        piece = self.scan.feed(self.stream.push(token_id, final=ended is not None), final=ended is not None)
        if self.scan.hit:
            ended = "stop"
        self.text += piece
        self.finish_reason = ended
        return piece
