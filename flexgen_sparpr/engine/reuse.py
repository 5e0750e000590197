"""Prefix reuse, the engine's side: a one-sequence generation starts from the kept cache that shares
the longest whole-block prefix with its prompt (engine/prefix_cache.py) and prefills only the rest
onto it, in one pass whose queries attend every kept block from whichever tier holds it (disk
included) and, causally, each other; when it ends its tables are kept for the next. A chat's later
turn and a server's request that repeats a conversation or a system prompt take this path alike.

Kept caches are found by the hash of whole blocks, then matched on token by token (a cut inside an
offloaded block reads it back; inside an encoded one it goes back to the block's start). The
prefix never covers the prompt's last token (its logits give the first answer token). A policy
that cannot go on from a cut-back cache (`reuses_prefix` False: H2O, DKV) and a pipeline stage are
prefilled whole, and their tables are not kept. On a CUDA device nothing stays kept in its memory
while another prompt runs (the running batch needs it); the CPU and disk tiers keep theirs. With
the KV stored exactly (--kv-dtype float32) the continuation equals a full prefill's up to float
rounding (the same maths in another order); with the compact default it reads the prefix as
stored (float16), as every decode step does.
"""
from __future__ import annotations

import torch

from ..storage.tiers import Tier
from .prefill import prefill_onto
from .prefix_cache import Kept, PrefixCache
from .sampling import Sampler
from .state import GenState


@torch.inference_mode()
def start(eng, cache: PrefixCache, prompt: list[int], max_new: int, sampler: Sampler | None,
          capacity: int = 0) -> tuple[GenState, int]:
    """Prefill one prompt (into tables holding at least `capacity` tokens), or onto the kept cache
    sharing its longest whole-block prefix. Returns the state, as a prefill leaves it, and the
    prompt tokens reused (0: prefilled whole)."""
    pol = eng.kv_policy
    hit = None
    if cache.enabled and pol.reuses_prefix and eng.link is None and eng.can_shrink:
        hit = cache.lookup(prompt, pol, len(prompt) + max_new)
    kept = cache.take(hit.kept) if hit is not None else None
    if eng.devices.is_cuda:  # the device's memory is the running batch's: nothing else kept there
        cache.drop_on(Tier.COMPUTE)
    if kept is None:
        st = eng.prefill([prompt], max_new, sampler, capacity=capacity)
        cache.stats.computed_tokens += len(prompt)
        return st, 0
    eng.free_tables()
    eng.tables.update(kept.tables)
    eng.run_policy = kept.run_policy
    reused = min(t.exact_cut(hit.tokens) for t in eng.tables.values())
    for t in eng.tables.values():
        t.truncate(reused)
    moved0 = _offloaded_reads(eng)
    st = prefill_onto(eng, prompt, reused, max_new, sampler)
    s = cache.stats
    s.hits, s.hit_tokens, s.computed_tokens = s.hits + 1, s.hit_tokens + reused, s.computed_tokens + len(
        prompt) - reused
    s.reuse_read_bytes += _offloaded_reads(eng) - moved0
    return st, reused


def keep(eng, st: GenState | None, prompt: list[int], cache: PrefixCache) -> None:
    """After a one-sequence generation: hand its tables to the cache (which closes them when it
    keeps nothing), with the tokens they hold."""
    if st is None or not eng.tables or eng.run_policy.batch_size != 1 or not st.tokens or \
            not eng.kv_policy.reuses_prefix:  # nothing could go on from it: freed with the batch
        return
    ids = list(prompt) + [int(t[0]) for t in st.tokens[:-1]]  # the last sampled token is not yet in
    tables = dict(eng.tables)
    eng.tables.clear()
    first = next(iter(tables.values()))
    if first.length != len(ids):  # not the state of these tables (never expected): keep nothing
        for t in tables.values():
            t.close()
        return
    held = {tier: sum(t.held_on(tier) for t in tables.values()) for tier in Tier}
    cache.put(Kept(ids, tables, eng.kv_policy, eng.run_policy, first.capacity, held))


def _offloaded_reads(eng) -> int:
    """Bytes moved so far from the CPU and disk tiers towards compute."""
    moved = eng.devices.counters.snapshot()
    return sum(n for link, n in moved.items() if link.split("->")[0] in ("cpu", "disk"))
