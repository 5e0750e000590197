"""Step 0 of a generation: the prompts left-padded to one length into new block tables (made
for the prompt, the answer and any room asked for), observers attached, and the prompt run
through every layer; or one prompt's rest prefilled onto a kept cache that holds its start
(engine/reuse.py). What it leaves is the GenState decode goes on from."""
from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigError
from .sampling import Sampler
from .state import GenState


@torch.inference_mode()
def prefill(eng, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler | None = None,
            keep_logits: bool = False, observers=(), pad_to: int = 0, progress: bool = False,
            capacity: int = 0) -> GenState:
    """Engine.prefill's body (its docstring says what each argument does)."""
    p, dev = eng.policy, eng.devices.compute
    if len(prompts) != p.batch_size:
        if not (eng.can_shrink and 0 < len(prompts) < p.batch_size):
            raise ConfigError(f"got {len(prompts)} prompts; the policy runs batches of "
                              f"{p.gpu_batch_size} x {p.num_gpu_batches} = {p.batch_size}")
        p = dataclasses.replace(p, gpu_batch_size=len(prompts))  # fewer rows: a smaller batch, no copies
    eng.run_policy = p
    if max_new_tokens < 1 or any(len(s) == 0 for s in prompts):
        raise ConfigError("need at least one prompt token and one new token")
    plen = max(pad_to, max(len(s) for s in prompts))
    limit = _check_room(eng, plen, max_new_tokens)
    # a policy that is also an observer sees each hook once
    eng._observers = tuple(o for o in dict.fromkeys(observers) if o is not eng.kv_policy)
    eng._new_tables(max(plen + max_new_tokens, min(capacity, limit)))
    for obs in eng._observers:
        for (i, _), t in eng.tables.items():
            obs.attach(t, i)
    ids = torch.full((p.batch_size, plen), eng.spec.pad_id, dtype=torch.long)
    for b, seq in enumerate(prompts):
        ids[b, plen - len(seq):] = torch.tensor(seq)
    pads = torch.tensor([plen - len(seq) for seq in prompts], device=dev)
    st = GenState(plen=plen, max_new=max_new_tokens, pads=pads, sampler=sampler or Sampler(),
                  keep_logits=keep_logits, done=torch.zeros(p.batch_size, dtype=torch.bool, device=dev))
    pos = (torch.arange(plen, device=dev)[None, :] - pads[:, None]).clamp(min=0)  # pos: [B, S]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(eng.layers), desc="prefill", unit="layer", leave=False)
    try:
        eng._advance(st, ids.to(dev), pos, prefill=True, stop=None, bar=bar)
    finally:
        eng._observers = ()
        if bar is not None:
            bar.close()
    return st


@torch.inference_mode()
def prefill_onto(eng, prompt: list[int], reused: int, max_new: int, sampler: Sampler | None) -> GenState:
    """The prefill of a prompt whose first `reused` tokens the current tables already hold."""
    _check_room(eng, len(prompt), max_new)
    dev = eng.devices.compute
    st = GenState(plen=len(prompt), max_new=max_new, pads=torch.zeros(1, dtype=torch.long, device=dev),
                  sampler=sampler or Sampler(), keep_logits=False, done=torch.zeros(1, dtype=torch.bool, device=dev))
    ids = torch.tensor(prompt[reused:], dtype=torch.long, device=dev)[None]  # ids: [1, S]
    pos = torch.arange(reused, len(prompt), device=dev)[None]  # pos: [1, S]
    eng._advance(st, ids, pos, prefill=True, stop=None)
    return st


def _check_room(eng, plen: int, max_new: int) -> int:
    """The model's positions, or a ConfigError when the prompt and its answer pass them (every
    architecture: past them the maths would differ)."""
    limit, what = eng.spec.context_limit()
    if plen + max_new > limit:
        raise ConfigError(f"{plen}+{max_new} tokens exceed {eng.spec.name}'s {what}")
    return limit

