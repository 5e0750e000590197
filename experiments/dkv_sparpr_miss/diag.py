"""Why does sparpr+dkv miss the 2k needle trial 63075? Runs one prompt of the needle grid alone.

usage: .venv/bin/python results/dkv/sparpr-miss/diag.py [LENGTH] [TRIAL] [CONFIG ...]
CONFIG: sparpr | sparpr+dkv | sparpr+dkv@KEEP ... ; prints the answer, and per decode step and layer
which blocks SparPR read whole, whether the needle's block was among them, and which digits are exact rows.
(Since commit 669e9e4 a sparpr+dkv run also attends the exact rows of the blocks it does not read
whole; those blocks are not counted as read here.)
"""
import os, random, sys, tempfile, json
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

length = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
trial_ids = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "3").split(",")]
configs = sys.argv[3:] or ["sparpr+dkv", "sparpr"]
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
rng = random.Random(0)
depths = (0.25, 0.75)
plans = {n: [builder.build(n, depths[i % 2], random_key(rng, 5), rng) for i in range(6)] for n in (2048, 4096, 8192)}
trials = [plans[length][i] for i in trial_ids]
BS = 256

log = []
orig_select = SparPR.select
def select(self, table, layer, q):
    sel = orig_select(self, table, layer, q)
    seqs = sel.seqs.T.tolist() if sel.seqs is not None else None
    log.append({"layer": layer, "len": table.length, "blocks": list(sel.blocks),
                "seq_blocks": [[blk for j, blk in enumerate(sel.blocks) if seqs is None or seqs[j][b]]
                               for b in range(q.shape[0])]})
    return sel
SparPR.select = select

for conf in configs:
    name, _, keep = conf.partition("@")
    keep = float(keep or 0.5)
    log.clear()
    with tempfile.TemporaryDirectory() as off:
        cold = {"cold_codec": "dkv", "codec_args": {"rank": 32, "residuals": 16, "residual_pick": "attention"}} \
            if name == "sparpr+dkv" else {}
        cfg = EngineConfig(device="cpu", block_size=BS, offload_dir=off, direct_io=True, **cold)
        pol = make_policy("sparpr", keep_ratio=keep, probe_dir=off)
        with Engine(src, Policy(gpu_batch_size=len(trials), cache_gpu_percent=0), cfg) as eng:
            st = eng.prefill([t.ids for t in trials], 12, observers=(pol,))
            eng.set_kv_policy(pol, attach=False)
            res = eng.decode(st, stop=src.spec.eos_id)
            for b, t in enumerate(trials):
                toks = res.tokens[b]
                ans = tok.decode(toks[:toks.index(src.spec.eos_id)] if src.spec.eos_id in toks else toks)
                needle = builder._needle(t.key)
                digits = [t.needle_at + i for i, x in enumerate(needle) if tok.decode([x]).strip().isdigit()]
                nblk = digits[0] // BS
                print(f"== {conf} trial {trial_ids[b]} key {t.key} answer {ans!r} hit {passkey_hit(ans, t.key)}; "
                      f"digits at {digits} (block {nblk}); answer tokens {[tok.decode([x]) for x in toks[:7]]}")
                # exact rows of the needle block per layer (coded tables only)
                kept = []
                for layer in range(src.spec.num_layers):
                    tab = eng.tables[(layer, 0)]
                    if tab.store.codec.compressed and tab.homes[nblk] in tab.store.coded:
                        p = tab.store.codec.parts(tab.rows([nblk]))
                        res_rows = set((p.res_idx[0, b].long() + nblk * BS).tolist())
                        kept.append("".join("x" if d in res_rows else "." for d in digits))
                if kept:
                    print("  digit rows exact per layer (x = exact):", " ".join(kept))
                steps = sorted({r["len"] for r in log})
                for s in steps:
                    rows = [r for r in log if r["len"] == s]
                    miss = [r["layer"] for r in rows if nblk not in r["seq_blocks"][b]]
                    nsel = [len(r["seq_blocks"][b]) for r in rows]
                    print(f"  step len {s}: blocks read per layer {nsel}; needle block not read in layers {miss}")
