"""How the API cuts any number of prompts into the engine's fixed-size batches."""
from __future__ import annotations

from ..engine.sampling import RowSampler, Sampler


def plan_batches(lengths: list[int], batch_size: int, sort: bool = True) -> list[list[int]]:
    """Input indices cut into batches: by length (stable) when sort, so a batch pads its prompts to
    similar lengths; the last batch may be short."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__) if sort else list(range(len(lengths)))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def fill(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """A short batch filled up with copies of its shortest prompt (where the engine runs whole batches
    only: several GPU batches, a pipeline stage; else a short batch runs as a smaller one):
    each sequence attends to its own cache only, so the copies, whose outputs are dropped, change
    no other sequence's tokens (unless a KV policy selects blocks for the batch as a whole)."""
    short = min(prompts, key=len)
    return prompts + [short] * (batch_size - len(prompts))


def row_sampler(each: list, size: int) -> RowSampler:
    """A batch whose prompts each have their own Params (`each`): per-row sampling and logprobs;
    the rows filling it up decode greedily, unseen."""
    fillers = size - len(each)
    return RowSampler([p.sampler() for p in each] + [Sampler()] * fillers,
                      [p.logprobs for p in each] + [None] * fillers)
