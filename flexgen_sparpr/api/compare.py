"""One prefill, several KV policies: the LLM's own policy and others decode the same prefilled
batch (Engine.snapshot / restore), each with its answer, decode speed and bytes moved."""
from __future__ import annotations

import time

from ..config.options import resolve
from ..config.validate import typed_flag_values
from ..engine.memory import PeakMemory
from ..errors import ConfigError
from ..kv import policies
from .batching import fill
from .outputs import Stats


def policy_for(llm, label: str, values: dict):
    """The KV policy given by flag values ({"kv_policy": "sparpr", "keep_ratio": 0.25}), made as
    LLM(...) makes its own (the same config, hardware and offload folder)."""
    if llm._given is None:
        raise ConfigError("compare() needs an LLM made by LLM(...)")
    try:
        values = typed_flag_values(values)
        merged = {**llm._given, **values}
        names = [n for n in (merged.get("kv_policy", policies.DEFAULT), merged.get("cold_codec", "raw")) if n != "raw"]
        # the LLM's own knobs carry over where the compared policy (or the cold codec) reads them
        own = {k: v for k, v in llm._given.items()
               if k not in policies.flags() or any(policies.reads(n, k) for n in names)}
        _, _, ecfg = resolve({**own, **values})
    except ConfigError as e:
        raise ConfigError(f"kv_policies[{label!r}]: {e}") from None
    pol = ecfg.make_kv_policy()
    if ecfg.block_size != llm.engine_config.block_size or ecfg.cold_codec != llm.engine_config.cold_codec:
        raise ConfigError(f"kv_policies[{label!r}]: its KV block size or --cold-codec differs from the LLM's "
                          "(one prefill serves policies that store the cache alike)")
    if pol.has_codec:
        raise ConfigError(f"kv_policies[{label!r}]: {pol.name} stores the cache in its own codec; it cannot share "
                          "a raw prefill (make an LLM with it)")
    return pol


def compare(llm, prompts, kv_policies: dict[str, dict], max_new_tokens: int, stop, progress: bool) -> dict:
    """{label: (outputs, Stats)}: the LLM's own policy (labelled by its name) first, then each of
    kv_policies, all greedy from one prefill. A Stats' prefill_s is the shared prefill's."""
    example = '{"sparpr": {"kv_policy": "sparpr", "keep_ratio": 0.25}}'
    if not isinstance(kv_policies, dict) or not kv_policies or not all(
            isinstance(k, str) and isinstance(v, dict) and all(isinstance(x, str) for x in v)
            for k, v in kv_policies.items()):
        raise ConfigError(f"kv_policies must be a non-empty dict of label -> flag values, e.g. {example} "
                          f"(got {kv_policies!r})"[:400])
    ids = llm.encode(prompts)
    if not 0 < len(ids) <= llm.batch_size:
        raise ConfigError(f"compare() runs one batch: give 1 to {llm.batch_size} prompts")
    params = llm.params(max_new_tokens, stop=stop)
    llm._check_lengths(ids, params)
    eng = llm.engine
    own = eng.kv_policy
    others = {label: policy_for(llm, label, values) for label, values in kv_policies.items()}
    if own.name in others:
        raise ConfigError(f"kv_policies: {own.name!r} is the LLM's own policy's label; name the others otherwise")
    st = eng.prefill(ids if eng.can_shrink else fill(ids, llm.batch_size), params.max_new, params.sampler(), observers=tuple(others.values()),
                     progress=progress)
    snap = eng.snapshot(st)
    out = {}
    try:
        for label, pol in {own.name: own, **others}.items():
            eng.set_kv_policy(pol, attach=False)
            state = eng.restore(snap)
            before, t0 = eng.devices.counters.snapshot(), time.perf_counter()
            with PeakMemory(eng.devices.compute) as mem:
                res = eng.decode(state, stop=params.stop, progress=progress)
            now = eng.devices.counters.snapshot()
            outs = [llm._output(i, ids[i], res.tokens[i], params) for i in range(len(ids))]
            out[label] = (outs, Stats(
                num_prompts=len(ids), num_batches=1, prompt_tokens=sum(map(len, ids)),
                generated_tokens=sum(len(o.token_ids) for o in outs), prefill_s=res.step_times[0],
                decode_s=sum(res.step_times[1:]), wall_s=time.perf_counter() - t0, step_times=[res.step_times],
                step_parts=[res.step_parts],
                bytes_moved={k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)},
                peak_memory=mem.report(), kv_policy_stats=pol.stats(),
                disk_io_mode=sorted({f.direct_mode for f in eng.disk.files.values()}) if eng.disk else None,
                device=str(eng.devices.compute), dtype=str(eng.dtype).removeprefix("torch.")))
    finally:
        eng.set_kv_policy(own, attach=False)
    return out
