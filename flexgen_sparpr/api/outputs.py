"""What the Python API hands back: one Output per prompt, StreamEvents while decoding, and the
Stats of the last call; plus the text of a growing token list, handed out in pieces."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.step_clock import median_parts


@dataclass(frozen=True)
class Output:
    """One prompt's generation. token_ids end at the first stop token (included), as HF's do;
    text is their decoding without special tokens (None for a model without a tokenizer)."""

    index: int  # the prompt's place in the input
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop": the stop token came; "length": max_new_tokens reached


@dataclass(frozen=True)
class StreamEvent:
    """One new token of one prompt, as soon as it is decoded. The prompt's last event has
    finished=True and its finish_reason; text deltas joined give the Output's text."""

    index: int
    token_id: int
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class Stats:
    """What the last generate() / stream() measured (wall and engine seconds, bytes, memory)."""

    num_prompts: int = 0
    num_batches: int = 0
    prompt_tokens: int = 0  # real prompt tokens (padding and fillers excluded)
    generated_tokens: int = 0  # tokens in the outputs
    prefill_s: float = 0.0  # the engine's steps, summed over batches
    decode_s: float = 0.0
    wall_s: float = 0.0  # the whole call, batching and detokenising included
    step_times: list[list[float]] = field(default_factory=list)  # per batch: [prefill, decode steps...]
    # per batch, per step (prefill first): seconds per part (select, read, rebuild, io_wait, compute)
    step_parts: list[list[dict]] = field(default_factory=list)
    bytes_moved: dict[str, int] = field(default_factory=dict)  # per link ("disk->cpu", ...)
    peak_memory: dict = field(default_factory=dict)  # engine/memory.py PeakMemory.report()
    kv_policy_stats: dict | None = None
    kv_blocks_read: tuple[int, int] = (0, 0)  # over the decode cells: KV blocks attention read, blocks cached
    reused_tokens: int = 0  # prompt tokens a kept cache held (LLM.keep_prefixes), not computed again
    disk_io_mode: list[str] | None = None
    device: str = ""
    dtype: str = ""

    @property
    def decode_step_parts(self) -> dict[str, float]:
        """Where a decode step's time goes: per part, the median over every batch's decode steps."""
        return median_parts([p for batch in self.step_parts for p in batch[1:]])

    @property
    def kv_read_share(self) -> float | None:
        """Share of the cached KV blocks the decode steps read (None: no block was counted)."""
        read, total = self.kv_blocks_read
        return read / total if total else None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second of the call."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


def finish(row: list[int], max_new: int, stop: int | None) -> tuple[list[int], str]:
    """A sequence's generated ids cut after the first stop token, and why it ended. The engine
    keeps a finished sequence's row filled with the stop token until the whole batch ends."""
    row = row[:max_new]
    if stop is not None and stop in row:
        return row[:row.index(stop) + 1], "stop"
    return row, "length"


class TextStream:
    """The text of a growing token list, in pieces: each piece is what the decoding of the ids so
    far adds to the text already given, held back while it ends in an incomplete UTF-8 character
    (the decoder's U+FFFD). For byte-level BPE tokenizers (SmolLM2's, OPT's) the pieces join into
    the full decoding; a tokenizer that rewrites text it already gave would make them differ."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta
