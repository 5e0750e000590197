"""Every KV policy from one prefill per batch: the fidelity scripts' shared runner.

Two families of configurations store the cache differently, so each has its own LLM and one
prefill per batch, and every configuration of the family decodes from a snapshot of it (the
calls of `llm.engine` that api/llm.py lists: prefill with observers, snapshot / restore):

- raw (KV block `block_size`, 16 by default: Quest's page): dense and every budgeted policy
  (sparpr, quest, h2o, streaming-llm, flexgen-topk) at each keep ratio, all observers of one
  dense prefill;
- dkv (KV block `dkv_block`, 256 by default: a rank-32 basis of a 16-token block would be
  lossless): the dkv policy, whose engine prefills the cache in DKV form, and "sparpr+dkv",
  SparPR at each keep ratio reading those same DKV blocks (what `--cold-codec dkv` stores, with
  the same query-aware exact rows, attended as there; here on the compute tier: fidelity only);
- kv-q8, kv-q4, kv-float16 (KV block `block_size`): the sealed blocks on the disk tier, stored as
  `--kv-dtype` gives it (q8 / q4: 8- / 4-bit codes with a scale and minimum per group, llama.cpp's
  `-ctk` idea; the disk tier because on a CPU-only machine the CPU tier is the compute tier, whose
  blocks stay in the compute dtype), the weights on compute: "dense+q8" is dense attention over those blocks, "sparpr+q8" SparPR's
  selection over them, all observers of one dense prefill, as in the raw family.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from ..api.llm import LLM
from ..config.options import resolve
from ..kv import policies
from ..kv.knobs import knobs
from ..kv.policies import POLICIES, make_policy
from ..kv.policies.dkv import DKV
from ..kv.policies.h2o import H2O
from ..kv.policy import KVPolicy

REFERENCE = policies.DEFAULT  # full attention: what every configuration is compared with
RAW = "raw"  # the family of configurations whose cache is stored raw
DKV_RANK, DKV_RESIDUALS, DKV_BLOCK = DKV().rank, DKV().residuals, DKV().block  # the scripts' --dkv-* defaults
# policy compositions the fidelity scripts sweep by default: SparPR reading DKV-coded blocks
# (what `--kv-policy sparpr --cold-codec dkv` stores)
COMPOSED = ("sparpr+dkv",)
# KV storage dtypes a configuration "A+<dtype>" reads its blocks in (--kv-dtype, the offloaded tiers)
KV_STORES = ("q8", "q4", "float16")
KV_PERCENT = (100, 0, 0, 0, 100, 0)  # weights and activations on compute, the KV cache on the disk tier


@dataclass(frozen=True)
class Config:
    """One decode configuration: a policy name, or "A+C" (policy A reading the blocks policy C's
    codec stores, as `--cold-codec C` does; or C a KV_STORES dtype: the blocks stored so on the disk
    tier, as `--kv-dtype C` does), and its keep ratio (1 for policies without one). The decoding
    policy's name may carry knobs, "A:knob=value:knob=value" (field names: "sparpr:per_head=true")."""

    policy: str
    keep: float = 1.0

    @property
    def parts(self) -> tuple[str, str | None]:
        """(the policy that decodes, the policy whose codec stores the blocks it reads, or None)."""
        name, _, cold = self.policy.partition("+")
        return name.partition(":")[0], cold or None

    @property
    def knobs(self) -> dict:
        """The knob values the name sets (typed as the policy's fields). Raises ValueError."""
        name, _, rest = self.policy.partition("+")[0].partition(":")
        fields = {k.name: k for k in knobs(POLICIES[name])}
        out = {}
        for item in filter(None, rest.split(":")):
            key, eq, value = item.partition("=")
            if key not in fields or not eq:
                raise ValueError(f"{self.policy}: {item!r} is not knob=value for a knob of {name} "
                                 f"({', '.join(fields)})")
            kind = fields[key].type
            out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        return out

    @property
    def budgeted(self) -> bool:
        """Whether the policy reads a keep ratio of the cache (it has that knob)."""
        return any(k.name == "keep_ratio" for k in knobs(POLICIES[self.parts[0]]))

    @property
    def label(self) -> str:
        return f"{self.policy}@{self.keep:g}" if self.budgeted else self.policy

    @property
    def family(self) -> str:
        """How the cache it reads is stored: RAW, the name of the policy whose codec stores it, or
        "kv-<dtype>" (KV_STORES)."""
        name, cold = self.parts
        if cold in KV_STORES:
            return f"kv-{cold}"
        return cold or (name if name in policies.codec_names() else RAW)


def known_policies(composed: tuple[str, ...] = ()) -> list[str]:
    """Every registered policy, then the compositions given ("A+C": budgeted policy A reading the
    blocks codec policy C stores, or any raw policy A reading blocks stored as KV_STORES dtype C)."""
    bad = [c for c in composed if not _composable(c)]
    if bad:
        raise ValueError(f"not a budgeted policy over a codec policy or a raw policy over a KV dtype: {bad} "
                         f"(codecs: {policies.codec_names()}; KV dtypes: {', '.join(KV_STORES)})")
    return sorted(POLICIES) + list(composed)


def _known(name: str) -> bool:
    """A registered policy (its knobs aside), or a composition "A+C" that `_composable` accepts."""
    policy, cold = Config(name).parts
    return _composable(name) if cold else policy in POLICIES


def _composable(name: str) -> bool:
    a, c = Config(name).parts
    c = c or ""
    if c in KV_STORES:
        return a in POLICIES and a not in policies.codec_names()
    return a in POLICIES and c in policies.codec_names() and Config(a).budgeted


def configs(names: list[str], keeps: list[float], dense: bool = True) -> list[Config]:
    """The reference first (unless not `dense`), then each policy (registered, or a composition
    "A+C") at each keep ratio (once for a policy without one). Raises ValueError."""
    bad = [p for p in names if not _known(p)]
    if bad:
        raise ValueError(f"unknown policies {bad} (known: {', '.join(sorted(POLICIES))}, and A+C compositions "
                         f"of a budgeted policy over {', '.join(policies.codec_names())}, or of a raw policy "
                         f"over a KV dtype: {', '.join(KV_STORES)})")
    out = [Config(REFERENCE)] if dense else []
    for p in names:
        if p != REFERENCE:
            Config(p).knobs  # noqa: B018 (raises on a bad knob before any run)
            out += [Config(p, k) for k in keeps] if Config(p).budgeted else [Config(p)]
    return out


def new_policy(cfg: Config, codec_args: dict | None = None) -> KVPolicy:
    """A fresh policy for cfg; codec_args: the knobs of a policy with a codec (e.g. DKV's)."""
    name, _ = cfg.parts
    args = dict(codec_args or {}) if name in policies.codec_names() else {}
    if any(k.name == "step_fallback" for k in knobs(POLICIES[name])):
        # fidelity of the selection itself: no step is timed and given to dense (a dense step reads
        # every block exactly), so every step is sparse, the worst case of the defaults; a config
        # may ask for it ("sparpr:step_fallback=true")
        args["step_fallback"] = False
    args.update(cfg.knobs)
    if cfg.budgeted:
        args["keep_ratio"] = cfg.keep
        floor = next((k.default for k in knobs(POLICIES[name]) if k.name == "min_keep"), None)
        if floor is not None and cfg.keep < floor:  # a keep below the policy's default floor lowers the floor too
            args["min_keep"] = cfg.keep
    return make_policy(name, **args)


class PolicySweep:
    """LLMs kept across batches (one per family and batch size); `run` prefills a batch once per
    family and decodes it under every configuration."""

    def __init__(self, source, *, device: str = "cpu", block_size: int = 16, dkv_block: int = 256,
                 dkv_args: dict | None = None, weight_format: str = "auto", offload_dir: str | None = None):
        self.src, self.device, self.block_size, self.dkv_block = source, device, block_size, dkv_block
        self.offload_dir = offload_dir  # the kv-<dtype> families' disk tier (None: the engine's default)
        self.weight_format = weight_format
        self.dkv_args = dict(dkv_args or {})
        self._llms: dict[tuple[str, int], LLM] = {}

    def llm(self, family: str, batch: int) -> LLM:
        """The family's LLM for batches of `batch`, made on first use."""
        key = (family, batch)
        if key not in self._llms:
            flags = dict(device=self.device, gpu_batch_size=batch, weight_format=self.weight_format, quiet=True)
            if family == RAW:
                flags["block_size"] = self.block_size
            elif family.startswith("kv-"):  # the cache on the disk tier, stored in that dtype
                flags.update(block_size=self.block_size, kv_dtype=family[3:], percent=list(KV_PERCENT),
                             offload_dir=self.offload_dir)
            else:  # the codec's own policy prefills the cache in its form
                flags.update(block_size=self.dkv_block, kv_policy=family, policy_args=self.dkv_args)
            self._llms[key] = LLM(self.src, **flags)
        return self._llms[key]

    def weight_formats(self) -> dict[str, str]:
        """What --weight-format resolved to in each LLM made so far: {family: describe()}."""
        return {family: llm.engine.weight_format.describe() for (family, _), llm in self._llms.items()}

    def run(self, prompts: list[list[int]], max_new: int, cfgs: list[Config],
            sampler_for: Callable[[Config | None], object], stop: int | None = None,
            on_done: Callable[[Config, object, object, float], None] | None = None) -> dict:
        """Decode `prompts` under every configuration. sampler_for(cfg) gives each decode's sampler
        (sampler_for(None): the prefill's); on_done(cfg, result, sampler, seconds) sees each
        decode as it ends. Returns {"prefill_s": {family: s}}."""
        times: dict = {"prefill_s": {}}
        for family in dict.fromkeys([RAW] + [c.family for c in cfgs]):
            fam = [c for c in cfgs if c.family == family]
            if not fam:
                continue
            eng = self.llm(family, len(prompts)).engine
            pols = {c: new_policy(c, self.dkv_args) for c in fam}
            if family == RAW or family.startswith("kv-"):  # a dense prefill, every policy observing it
                own = next((p for c, p in pols.items() if c.policy.partition("+")[0] == REFERENCE), None) \
                    or make_policy(REFERENCE)
            else:  # the codec's own policy, fresh (its counters); its configuration decodes with it
                own = make_policy(family, **self.dkv_args)
                pols = {c: (own if c.policy == family else p) for c, p in pols.items()}
            eng.set_kv_policy(own, attach=False)  # the engine's own policy must not also be an observer
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
        for llm in self._llms.values():
            llm.close()
        self._llms.clear()


def resolved_config(cfgs, device: str, block_size: int, dkv_block: int, dkv_args: dict | None = None) -> dict:
    """What a run's configurations resolve to, for its config: the compute and KV dtypes the
    engine picks on `device` (--dtype and --kv-dtype auto), the placement (every block on the
    compute tier: --percent's default), and each configuration's KV block and every knob of its
    policy after the policy resolved them (SparPR's summary "auto" -> lowrank, the floor it runs
    with, ...); a composition "A+C" also lists the knobs of the codec policy C storing its blocks."""
    import torch

    def knob_values(p) -> dict:
        return {k.name: getattr(p, k.name) for k in knobs(type(p))}
    _, pl, ec = resolve({"device": device, "block_size": block_size})  # as LLM(...) resolves these flags
    compute = ec.torch_dtype(torch.device(device))
    out = {"compute_dtype": str(compute).removeprefix("torch."),
           "kv_dtype": str(ec.torch_kv_dtype(compute)).removeprefix("torch.") + " (raw blocks on the CPU/disk tiers; "
           "none here: every block is on the compute tier, in the compute dtype)",
           "placement": {"weights": list(pl.weight_percents), "cache": list(pl.cache_percents)},
           "configs": {}}
    for c in cfgs:
        p = new_policy(c, dkv_args)
        kv = c.family.startswith("kv-")
        entry = {"family": c.family, "block_size": block_size if c.family == RAW or kv else dkv_block,
                 "policy": type(p).name, **knob_values(p)}
        _, codec = c.parts
        if kv:
            entry["kv_store"] = {"kv_dtype": codec, "percent": list(KV_PERCENT)}
        elif codec:
            entry["codec"] = {"policy": codec, **knob_values(make_policy(codec, **(dkv_args or {})))}
        out["configs"][c.label] = entry
    return out



def resolved_lines(cfg: dict) -> list[str]:
    """A report's section on its config's "resolved" entry (resolved_config): the engine's
    dtypes and placement, then one line per configuration; none for a config without it."""
    res = cfg.get("resolved")
    if not res:
        return []
    head = {k: v for k, v in res.items() if k != "configs"}
    return ["## Resolved configuration", "", f"Engine on {cfg.get('device', '?')}: `{json.dumps(head)}`", "",
            *[f"- {label}: `{json.dumps(c, default=str)}`" for label, c in res["configs"].items()], ""]
