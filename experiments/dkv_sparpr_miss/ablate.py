"""Ablations on one needle prompt under sparpr+dkv (keep 0.5, 256-token blocks, cache on disk).

usage: .venv/bin/python results/dkv/sparpr-miss/ablate.py LENGTH TRIALS MODE [MODE ...]
MODE:
  raw         SparPR over raw blocks (records its selection for `replay`)
  dkv         SparPR over DKV cold blocks (as bench_dkv's sparpr+dkv; with the fix: unselected
              blocks attended on their exact rows)
  before      as dkv without the fix (SparPR's selection alone, as before commit 669e9e4); the
              modes below run without the fix too
  replay      DKV cold blocks, but each (step, layer) reads exactly the blocks raw SparPR read
  dkvsel-raw  raw blocks, but each (step, layer) reads the blocks the dkv run read
  needle      DKV cold blocks, the needle's block forced into every selection
  resall      DKV cold blocks, plus the exact residual rows of every unselected cold block
              (emulated: the whole block is moved, the mask keeps only its residual rows)
  keep1       DKV cold blocks, keep 1.0 (every block read)
"""
import os, random, sys, tempfile
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # scripts/_common.py
from _common import REPO
from transformers import AutoTokenizer
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key, passkey_hit
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.weights.resolve import resolve_source

length = int(sys.argv[1])
trial_ids = [int(x) for x in sys.argv[2].split(",")]
modes = sys.argv[3:]
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
rng = random.Random(0)
plans = {n: [builder.build(n, (0.25, 0.75)[i % 2], random_key(rng, 5), rng) for i in range(6)] for n in (2048, 4096, 8192)}
trials = [plans[length][i] for i in trial_ids]
BS = 256
nblk = [(t.needle_at + 5) // BS for t in trials]  # the needle's digits sit a few tokens after needle_at

logs = {}
cur = {"mode": None, "log": None}
orig_top_k = SparPR.top_k


def top_k(self, table, layer, q, budgets):
    keep = orig_top_k(self, table, layer, q, budgets)  # keep: [B, L]
    mode, key = cur["mode"], (table.length, layer)
    sealed = table.length // BS
    if mode in ("replay", "dkvsel-raw"):
        src_log = logs["raw" if mode == "replay" else "dkv"]
        if key in src_log:
            keep = src_log[key].clone() & self.valid_tokens(table)
    if mode == "needle":
        for b, blk in enumerate(nblk):
            keep[b, blk * BS:(blk + 1) * BS] = True
    if mode == "resall" and table.store.codec.compressed:
        cold = [blk for blk in range(sealed) if table.homes[blk] in table.coded]
        p = table.store.codec.parts(table.rows(cold))
        for j, blk in enumerate(cold):
            keep.view(keep.shape[0], -1)[torch.arange(keep.shape[0])[:, None], blk * BS + p.res_idx[j].long()] = True
    cur["log"][key] = keep.clone()
    return keep


SparPR.top_k = top_k
import flexgen_sparpr.kv.policies.sparpr as sparpr_mod  # noqa: E402
fixed = sparpr_mod.with_exact_rows

for mode in modes:
    cur["mode"], cur["log"] = mode, {}
    sparpr_mod.with_exact_rows = fixed if mode == "dkv" else (lambda table, sel, valid: sel)
    raw = mode in ("raw", "dkvsel-raw")
    with tempfile.TemporaryDirectory() as off:
        cold = {} if raw else {"cold_codec": "dkv", "codec_args": {"rank": 32, "residuals": 16,
                                                                   "residual_pick": "attention"}}
        cfg = EngineConfig(device="cpu", block_size=BS, offload_dir=off, direct_io=True, **cold)
        pol = make_policy("sparpr", keep_ratio=1.0 if mode == "keep1" else 0.5, probe_dir=off)
        with Engine(src, Policy(gpu_batch_size=len(trials), cache_gpu_percent=0), cfg) as eng:
            st = eng.prefill([t.ids for t in trials], 12, observers=(pol,))
            eng.set_kv_policy(pol, attach=False)
            res = eng.decode(st, stop=src.spec.eos_id)
    logs[mode] = cur["log"]
    out = []
    for b, t in enumerate(trials):
        toks = res.tokens[b]
        ans = tok.decode(toks[:toks.index(src.spec.eos_id)] if src.spec.eos_id in toks else toks).strip()
        out.append(f"{t.key}:{ans!r}:{'HIT' if passkey_hit(ans, t.key) else 'miss'}")
    print(f"{mode:11s} {length} " + "  ".join(out), flush=True)
