"""Every KV policy from one prefill per batch: the fidelity scripts' shared runner.

Two families of configurations store the cache differently, so each has its own engine and one
prefill per batch, and every configuration of the family decodes from a snapshot of it
(Engine.snapshot / restore):

- raw (KV block `block_size`, 16 by default: Quest's page): dense and every budgeted policy
  (sparpr, quest, h2o, streaming-llm, flexgen-topk) at each keep ratio, all observers of one
  dense prefill;
- dkv (KV block `dkv_block`, 256 by default: a rank-32 basis of a 16-token block would be
  lossless): the dkv policy, whose engine prefills the cache in DKV form, and "sparpr+dkv",
  SparPR at each keep ratio reading those same DKV blocks (what `--cold-codec dkv` stores, with
  the same query-aware exact rows, attended as there; here on the compute tier: fidelity only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..engine.config import EngineConfig, Policy
from ..engine.executor import Engine
from ..kv.policies.h2o import H2O
from ..kv.policy import POLICIES, KVPolicy, make_policy

DKV_FAMILY = ("dkv", "sparpr+dkv")


@dataclass(frozen=True)
class Config:
    """One decode configuration: a policy name (or "sparpr+dkv") and its keep ratio (1 for dense
    and dkv, which have none)."""

    policy: str
    keep: float = 1.0

    @property
    def label(self) -> str:
        return self.policy if self.policy in ("dense", "dkv") else f"{self.policy}@{self.keep:g}"

    @property
    def family(self) -> str:
        return "dkv" if self.policy in DKV_FAMILY else "raw"


def known_policies() -> list[str]:
    """Every registered policy and the sparpr+dkv composition."""
    make_policy("dense")  # registers the built-in policies
    return sorted(POLICIES) + ["sparpr+dkv"]


def configs(policies: list[str], keeps: list[float], dense: bool = True) -> list[Config]:
    """Dense first (unless not `dense`), then each policy at each keep ratio (once for dkv).
    Raises ValueError."""
    known = known_policies()
    bad = [p for p in policies if p not in known]
    if bad:
        raise ValueError(f"unknown policies {bad} (known: {', '.join(known)})")
    out = [Config("dense")] if dense else []
    for p in policies:
        if p == "dkv":
            out.append(Config("dkv"))
        elif p != "dense":
            out += [Config(p, k) for k in keeps]
    return out


def new_policy(cfg: Config, dkv_args: dict | None = None) -> KVPolicy:
    if cfg.policy == "dense":
        return make_policy("dense")
    if cfg.policy == "dkv":
        return make_policy("dkv", **(dkv_args or {}))
    return make_policy(cfg.policy.removesuffix("+dkv"), keep_ratio=cfg.keep)


class PolicySweep:
    """Engines kept across batches (one per family and batch size); `run` prefills a batch once
    per family and decodes it under every configuration."""

    def __init__(self, source, *, device: str = "cpu", block_size: int = 16, dkv_block: int = 256,
                 dkv_args: dict | None = None):
        self.src, self.device, self.block_size, self.dkv_block = source, device, block_size, dkv_block
        self.dkv_args = dict(dkv_args or {})
        self._engines: dict[tuple[str, int], Engine] = {}

    def engine(self, family: str, batch: int) -> Engine:
        key = (family, batch)
        if key not in self._engines:
            if family == "raw":
                cfg = EngineConfig(device=self.device, block_size=self.block_size)
            else:
                cfg = EngineConfig(device=self.device, block_size=self.dkv_block, kv_policy="dkv",
                                   policy_args=self.dkv_args)
            self._engines[key] = Engine(self.src, Policy(gpu_batch_size=batch), cfg)
        return self._engines[key]

    def run(self, prompts: list[list[int]], max_new: int, cfgs: list[Config],
            sampler_for: Callable[[Config | None], object], stop: int | None = None,
            on_done: Callable[[Config, object, object, float], None] | None = None) -> dict:
        """Decode `prompts` under every configuration. sampler_for(cfg) gives each decode's sampler
        (sampler_for(None): the prefill's); on_done(cfg, result, sampler, seconds) sees each
        decode as it ends. Returns {"prefill_s": {family: s}}."""
        times: dict = {"prefill_s": {}}
        for family in ("raw", "dkv"):
            fam = [c for c in cfgs if c.family == family]
            if not fam:
                continue
            eng = self.engine(family, len(prompts))
            pols = {c: (eng.kv_policy if c.policy == "dkv" else new_policy(c, self.dkv_args)) for c in fam}
            if family == "raw":
                own = pols.get(Config("dense"), make_policy("dense"))
                eng.set_kv_policy(own, attach=False)  # the engine's own policy must not also be an observer
            else:
                eng.set_kv_policy(make_policy("dkv", **self.dkv_args), attach=False)  # fresh counters
                pols = {c: (eng.kv_policy if c.policy == "dkv" else p) for c, p in pols.items()}
            # H2O's prefill statistics depend on no knob: one instance computes them for all
            h2os = [p for p in pols.values() if isinstance(p, H2O)]
            observers = tuple(p for p in pols.values() if p is not eng.kv_policy and p not in h2os[1:])
            t0 = time.perf_counter()
            st = eng.prefill(prompts, max_new, sampler_for(None), observers=observers)
            times["prefill_s"][family] = round(time.perf_counter() - t0, 2)
            for p in h2os[1:]:
                p.adopt_prefill(h2os[0], eng.tables.values())
            snap = eng.snapshot(st)
            for c in fam:
                eng.set_kv_policy(pols[c], attach=False)
                state = eng.restore(snap)
                state.sampler = sampler_for(c)
                t0 = time.perf_counter()
                res = eng.decode(state, stop=stop)
                if on_done is not None:
                    on_done(c, res, state.sampler, time.perf_counter() - t0)
        return times

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()
