"""DKV with its top-E routed blocks attended exactly (issue 16, item 4): what reading the raw rows of
the few cold blocks DKV's router ranks highest would buy on the tasks its 16 exact rows per block
lose (multi-value, phrase, two-needles, the late question). An offloading engine would keep those
raw blocks on a slower tier (disk) and copy E of them a step; here raw copies are kept in memory,
taken at each seal: a fidelity measurement, not an I/O one. Everything else is the dkv policy as
it is (routing, residual rows, window, the low-rank attention of the other routed blocks).

Tune on the TUNING split (alice29, depths 0.25 / 0.75, seed 0); check a chosen E once on held-out.

Usage (repo root):
  .venv/bin/python experiments/dkv_exact/exact_routed.py [--split tuning] \
      [--tasks multi-value,phrase,two-needles,passkey] [--length 2048] [--trials 10] [--exact 0,1,2]
Prints per task: dense's hits, then for each E the hits, the answers equal to dense's (and which
differ), and dense's hits kept. E = 0 is the dkv policy unchanged.
"""
from __future__ import annotations

import argparse
import os
import random
import time
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import flexgen_sparpr.kv.policies.dkv as dkv_mod  # noqa: E402
from flexgen_sparpr.bench.forced import ForcedTokens  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts  # noqa: E402
from flexgen_sparpr.bench.sweep import Config, PolicySweep  # noqa: E402
from flexgen_sparpr.bench.tasks import build_trial, canonical, hit  # noqa: E402
from flexgen_sparpr.bench.texts import SPLITS, TEXTS  # noqa: E402
from flexgen_sparpr.engine.sampling import Sampler  # noqa: E402
from flexgen_sparpr.models.layers import attention_with_lse, merge_attention  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

DKV = dkv_mod.DKV
RAW: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # table -> {block: kv [2, B, Hkv, bs, D]}
NOW: dict = {"exact": 0}  # the E of the decode running, and the table / policy of the step in flight

_attach, _attend, _merge = DKV.attach, DKV._attend, dkv_mod.lowrank_merge


def attach(self, table, layer):
    _attach(self, table, layer)
    if table not in RAW:
        raws = RAW[table] = {}  # the hook holds the dict, not the table

        def keep_raw(block, kv):
            raws[block] = kv.detach().clone()
        table.on_seal.append(keep_raw)


def attend(self, table, layer, q, k, v, pads, wide=None):
    NOW["table"], NOW["policy"] = table, self
    return _attend(self, table, layer, q, k, v, pads, wide)


def lowrank_merge(q, p, c, lse, route=None):
    """The top-E routed blocks (by their log mass) attended from their raw rows, the rest of the
    routed ones in low-rank form as before; one partial (out, lse) as lowrank_merge returns."""
    e = NOW["exact"]
    if e == 0:
        return _merge(q, p, c, lse, route)
    st = NOW["policy"]._state[NOW["table"]]
    raws = RAW[NOW["table"]]
    if route is None:  # every cold block routed: rank them all by mass
        route = lse.logsumexp(dim=2).topk(c.shape[0], dim=1).indices  # route: [B, n]
    e = min(e, route.shape[1])
    top, rest = route[:, :e], route[:, e:]  # _route's topk is sorted: the e largest masses first
    ks, vs, oks = [], [], []
    for s in range(q.shape[0]):
        kv = torch.cat([raws[st.first + int(i)][:, s] for i in top[s]], dim=2)  # kv: [2, Hkv, e*bs, D]
        ks.append(kv[0])
        vs.append(kv[1])
        oks.append(st.usable[top[s], s].reshape(-1))  # residual rows (attended exactly already) and pads out
    exact = attention_with_lse(q, torch.stack(ks).to(q.dtype), torch.stack(vs).to(q.dtype), torch.stack(oks))
    parts = [exact] + ([_merge(q, p, c, lse, rest)] if rest.shape[1] else [])
    out = merge_attention(parts)  # out: [B, H, 1, D]
    return out, torch.logsumexp(torch.stack([x for _, x in parts]), dim=0)  # lse: [B, H, 1]


DKV.attach, DKV._attend, dkv_mod.lowrank_merge = attach, attend, lowrank_merge


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="tuning", choices=sorted(SPLITS))
    ap.add_argument("--tasks", default="multi-value,phrase,two-needles,passkey")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--exact", default="0,1,2", help="comma list of E: routed blocks attended exactly")
    args = ap.parse_args()
    exacts = [int(x) for x in args.exact.split(",")]
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    split = SPLITS[args.split]
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builders = [(NeedlePrompts(tok, TEXTS[t].path, "The secret passkey is"), t) for t in split.texts]
    eos, t0 = src.spec.eos_id, time.time()
    # one Config per E (keep = E + 1: the dkv policy has no keep, so the label stays "dkv")
    cfgs = [Config("dense")] + [Config("dkv", float(e + 1)) for e in exacts]
    sweep = PolicySweep(src)
    try:
        for task in args.tasks.split(","):
            rng = random.Random(f"{split.seed}:{task}:{args.length}:exact")  # not needle.py's stream
            trials = [build_trial(task, builders[j % len(builders)][0], args.length,
                                  split.depths[j % len(split.depths)], rng, builders[j % len(builders)][1])
                      for j in range(args.trials)]
            got: dict[Config, list[str]] = {c: [] for c in cfgs}
            for i in range(0, args.trials, args.batch):
                batch = trials[i:i + args.batch]
                forced = [t.forced for t in batch]
                nf = len(forced[0])

                def sampler_for(c, forced=forced, nf=nf):
                    NOW["exact"] = 0 if c is None or c.policy != "dkv" else int(c.keep) - 1
                    return ForcedTokens([f[0 if c is None else 1:] for f in forced]) if nf else Sampler()

                def done(c, res, sampler, secs, nf=nf):
                    for toks in res.tokens:
                        toks = toks[nf:]
                        toks = toks[:toks.index(eos)] if eos in toks else toks
                        got[c].append(tok.decode(toks, skip_special_tokens=True))
                sweep.run([t.ids for t in batch], nf + batch[0].gen_len, cfgs, sampler_for,
                          stop=None if nf else eos, on_done=done)
            dense = got[cfgs[0]]
            dh = [hit(task, a, t.expected) for a, t in zip(dense, trials)]
            print(f"{task} @ {args.length}: dense hits {sum(dh)}/{args.trials}", flush=True)
            for c in cfgs[1:]:
                hits = [hit(task, a, t.expected) for a, t in zip(got[c], trials)]
                same = [canonical(task, a) == canonical(task, d) for a, d in zip(got[c], dense)]
                diff = [f"{t.expected[0]}:{a.strip()[:20]!r}" for a, s, t in zip(got[c], same, trials) if not s]
                print(f"  exact {int(c.keep) - 1}: hits {sum(hits)}, = dense {sum(same)}/{args.trials}, "
                      f"dense hits kept {sum(h and d for h, d in zip(hits, dh))}/{sum(dh)}  {' '.join(diff)}"
                      f"  [{time.time() - t0:.0f}s]", flush=True)
    finally:
        sweep.close()


if __name__ == "__main__":
    main()
