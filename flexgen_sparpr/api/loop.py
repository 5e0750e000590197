"""The one generation loop every face of the package runs (LLM.generate / stream / batch_steps,
the command line, the server, chat): prompts cut into the engine's batches, each prefilled (or, one
prompt with the prefix cache on, prefilled onto a kept cache: engine/reuse.py) and decoded step by
step, with the call's measurements in the LLM's last_stats."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine import reuse
from ..engine.memory import PeakMemory
from ..engine.state import GenerationResult, GenState
from ..utils.progress import progress as bar
from .batching import fill, plan_batches, row_sampler
from .outputs import Stats, finish
from .params import Params


@dataclass
class Step:
    """After each engine step of a batch: which inputs its first rows are (the rest fill the batch
    up), the engine's state (state.tokens[-1]: this step's tokens [B]); `result` once it is done."""

    rows: list[int]
    state: GenState
    result: GenerationResult | None = None


def steps(llm, ids: list[list[int]], params: Params | list[Params], *, progress: bool = False, pad_to: int = 0,
          sort: bool = True, decode_bar: bool = True, capacity: int = 0, keep=None):
    """Every batch through the engine's loop, yielding a Step after the prefill, after each decode
    step, and once more when the batch is done (with its result); fills llm.last_stats. params: one
    for all prompts, or one per prompt (rows then sample apart: engine/sampling.py RowSampler). A
    batch of one prompt goes through the prefix cache when it is on (LLM.keep_prefixes): capacity,
    the tokens its kept tables hold; keep(), asked at its end whether to keep them."""
    eng, size = llm.engine, llm.batch_size
    batches = plan_batches([len(x) for x in ids], size, sort)
    stats = llm.last_stats = Stats(num_prompts=len(ids), num_batches=len(batches), prompt_tokens=sum(map(len, ids)))
    rows_params = params if isinstance(params, list) else None
    sampler = params.sampler() if rows_params is None else None  # one per call: its stream runs on
    blocks0 = list(eng.reader.blocks_read)
    outer = bar(total=len(ids), desc="generate", unit="prompt", enabled=progress and len(batches) > 1)
    t0, mem = time.perf_counter(), None
    eng.devices.counters.reset()
    if eng.link is not None:
        eng.link.reset()  # a pipeline stage's timings and bytes, like the counters, per call
    try:
        with PeakMemory(eng.devices.compute) as mem:
            for rows in batches:
                each = [params] * len(rows) if rows_params is None else [rows_params[i] for i in rows]
                max_new, stop = max(p.max_new for p in each), each[0].stop
                rows_in = len(rows) if eng.can_shrink else size  # a short batch runs short, or is filled up
                choose = sampler if sampler is not None else row_sampler(each, rows_in)
                kept = rows_in == 1 and llm.prefix_cache.enabled and not pad_to
                if kept:
                    prompt = ids[rows[0]]
                    st, reused = reuse.start(eng, llm.prefix_cache, prompt, max_new, choose,
                                             room(llm, len(prompt) + max_new, capacity))
                    stats.reused_tokens += reused
                else:
                    st = eng.prefill(fill([ids[i] for i in rows], rows_in), max_new, choose, pad_to=pad_to,
                                     progress=progress)
                whole = False  # the state matches the tables (between steps)
                try:
                    yield Step(rows, st)
                    for _ in eng.decode_steps(st, stop, progress and decode_bar):
                        yield Step(rows, st)
                    whole = True
                except GeneratorExit:
                    whole = True
                    raise
                finally:
                    if kept and whole and (keep is None or keep()):
                        reuse.keep(eng, st, prompt, llm.prefix_cache)
                res = st.result()
                stats.step_times.append(res.step_times)
                stats.step_parts.append(res.step_parts)
                stats.generated_tokens += sum(len(finish(res.tokens[r], each[r].max_new, stop)[0])
                                              for r in range(len(rows)))
                yield Step(rows, st, res)
                outer.update(len(rows))
    finally:
        outer.close()
        stats.wall_s = time.perf_counter() - t0
        stats.prefill_s = sum(t[0] for t in stats.step_times)
        stats.decode_s = sum(sum(t[1:]) for t in stats.step_times)
        stats.bytes_moved = eng.devices.counters.snapshot()
        stats.peak_memory = mem.report() if mem is not None else {}
        stats.kv_policy_stats = eng.kv_policy.stats()
        stats.kv_blocks_read = tuple(n - n0 for n, n0 in zip(eng.reader.blocks_read, blocks0))
        stats.disk_io_mode = sorted({f.direct_mode for f in eng.disk.files.values()}) if eng.disk else None
        stats.device, stats.dtype = str(eng.devices.compute), str(eng.dtype).removeprefix("torch.")


def room(llm, need: int, capacity: int) -> int:
    """Tokens a kept cache's tables hold: `capacity` if given, else twice what this prompt needs (a
    conversation grows), in 1024s, up to the model's positions."""
    if capacity:
        return max(need, capacity)
    return min(llm.spec.context_limit()[0], -(-2 * need // 1024) * 1024)
