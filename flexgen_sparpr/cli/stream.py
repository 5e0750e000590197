"""--stream: tokens printed as they are decoded. One sequence prints its text as it grows; a
batch prints each sequence's lines as they complete, as `[i] line`, and the rest of a sequence
when it ends. A model without a tokenizer prints token ids."""
from __future__ import annotations

import sys

from ..api.outputs import TextStream


class StreamPrinter:
    """Called with each engine step (api/llm.py Step) of one batch; close() ends the last lines."""

    def __init__(self, tokenizer, num_seqs: int, params, out=None):
        self.out = out or sys.stdout
        self.tokenizer, self.params, self.n = tokenizer, params, num_seqs
        self.texts = [TextStream(tokenizer) for _ in range(num_seqs)]
        self.pending = [""] * num_seqs  # a batch's text of the line each sequence is on
        self.count, self.ended = [0] * num_seqs, [False] * num_seqs

    def __call__(self, step) -> None:
        if step.result is not None:
            return
        toks = step.state.tokens[-1].tolist()
        for r, i in enumerate(step.rows):
            if self.ended[i]:
                continue
            t = toks[r]
            self.count[i] += 1
            self.ended[i] = t == self.params.stop or self.count[i] == self.params.max_new
            piece = self.texts[i].push(t, final=self.ended[i]) if self.tokenizer is not None else f" {t}"
            self._show(i, piece)
            if self.ended[i]:
                self._end(i)
        self.out.flush()

    def _show(self, i: int, piece: str) -> None:
        if self.n == 1:
            self.out.write(piece)
            return
        *done, self.pending[i] = (self.pending[i] + piece).split("\n")
        for line in done:
            self.out.write(f"[{i}] {line}\n")

    def _end(self, i: int) -> None:
        if self.n == 1:
            self.out.write("\n")
        elif self.pending[i]:
            self.out.write(f"[{i}] {self.pending[i]}\n")
            self.pending[i] = ""

    def close(self) -> None:
        """Sequences the engine stopped early (every one had ended) are ended already; none is left."""
        for i in range(self.n):
            if not self.ended[i]:
                self.ended[i] = True
                self._end(i)
        self.out.flush()
