"""Diagnostic for SparPR's needle fidelity: at every decode step and layer, does a block
selection cover the needle's digit tokens? Decoding runs dense (the recorder reads everything),
so every variant is scored on the same queries; writes <out>/recall.json and recall.md.

Variants (VARIANTS, each at every keep ratio): SparPR's selection knobs (one shared set for the
batch or per-sequence top-k; raw or per-head-softmax head scores; summaries per block or per run
of t tokens), and a reference ("oracle") that ranks whole blocks by their best token's true
attention probability summed over heads (it reads every key; it is not an upper bound on
digit recall).
"""
from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _common import OneLineParser, REPO, int_list, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key  # noqa: E402
from flexgen_sparpr.engine.config import EngineConfig, Policy  # noqa: E402
from flexgen_sparpr.engine.executor import Engine  # noqa: E402
from flexgen_sparpr.kv.policies.base import token_budget  # noqa: E402
from flexgen_sparpr.kv.policies.sparpr import SparPR  # noqa: E402
from flexgen_sparpr.kv.policy import KVPolicy, Selection  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

# name -> SparPR selection knobs (the oracle is scored separately)
VARIANTS = {"shared-sum-block": dict(per_sequence=False, head_score="sum", summary_tokens=0),  # the first version
            "seq-sum-block": dict(per_sequence=True, head_score="sum", summary_tokens=0),
            "seq-softmax-block": dict(per_sequence=True, head_score="softmax", summary_tokens=0),
            "seq-softmax-t8": dict(per_sequence=True, head_score="softmax", summary_tokens=8),
            "seq-softmax-t4": dict(per_sequence=True, head_score="softmax", summary_tokens=4)}  # the default
NAMES = (*VARIANTS, "oracle")


class Recorder(KVPolicy):
    """Reads everything; on the side, asks every variant what it would read and scores that
    against the needle's digit tokens."""

    def __init__(self, keeps, digits, block_size):
        self.keeps, self.digits, self.rows = keeps, digits, []  # digits: [B] lists of positions
        self.pols = {n: SparPR(keep_ratio=1.0, quest_only=True, **kw) for n, kw in VARIANTS.items()
                     if kw.get("summary_tokens", 0) <= block_size}

    def attach(self, table, layer):
        for p in self.pols.values():
            p.attach(table, layer)

    def on_prefill(self, table, layer, q, k, valid):
        for p in self.pols.values():
            p.on_prefill(table, layer, q, k, valid)

    def plan(self, table, layer):
        return None

    def oracle(self, table, q, budgets) -> torch.Tensor:
        """[B, L]: whole blocks ranked by their best token's attention probability summed over
        heads (from the true keys)."""
        b, h, _, d = q.shape
        hkv, bs, length = table.block_shape[2], table.bs, table.length
        sealed = length // bs
        ref = next(iter(self.pols.values()))
        valid = ref.valid_tokens(table)
        keys = table.gather()[0][0].float()  # keys: [B, Hkv, L, D]
        logit = torch.einsum("bgjd,bgld->bgjl", q.float().view(b, hkv, h // hkv, d), keys) / math.sqrt(d)
        prob = logit.reshape(b, h, length).masked_fill(~valid[:, None], -math.inf).softmax(-1).sum(1)  # [B, L]
        score = prob[:, :sealed * bs].view(b, sealed, bs).amax(dim=2)  # score: [B, nb]
        ids = torch.arange(sealed)
        own = (ids[None, :] == (ref.pads(table) // bs)[:, None]) | (ids >= sealed - ref.recent_blocks)[None, :]
        keep = torch.ones(b, length, dtype=torch.bool)
        for i in range(b):
            room = budgets[i] - int(valid[i, sealed * bs:].sum()) - bs * int(own[i].sum())
            pick = own[i].clone()
            for blk in score[i].masked_fill(own[i], -1).argsort(descending=True).tolist()[:max(0, room) // bs]:
                pick[blk] = True
            keep[i, :sealed * bs] = pick.repeat_interleave(bs)
        return keep & valid

    def select(self, table, layer, q):
        ref = next(iter(self.pols.values()))
        n_valid = ref.valid_tokens(table).sum(dim=1).tolist()
        for keep in self.keeps:
            budgets = [token_budget(keep, n, ref.floor(table)) for n in n_valid]
            reads = {n: p.top_k(table, layer, q, budgets) for n, p in self.pols.items()}  # [B, L] each
            reads["oracle"] = self.oracle(table, q, budgets)
            for i, dig in enumerate(self.digits):
                dig = [p for p in dig if p < table.length]
                if dig:
                    self.rows.append({"layer": layer, "length": table.length, "seq": i, "keep": keep,
                                      **{n: float(r[i, dig].float().mean()) for n, r in reads.items()}})
        return Selection.all(table)


def summarise(rows, keeps):
    """Mean digit recall per (keep, variant), overall and per layer."""
    names = [n for n in NAMES if rows and n in rows[0]]
    out = {}
    for keep in keeps:
        rs = [r for r in rows if r["keep"] == keep]
        layers = sorted({r["layer"] for r in rs})
        out[str(keep)] = {n: round(sum(r[n] for r in rs) / max(1, len(rs)), 3) for n in names}
        out[str(keep)]["by_layer"] = {n: [round(sum(r[n] for r in rs if r["layer"] == la)
                                                / max(1, sum(1 for r in rs if r["layer"] == la)), 2)
                                          for la in layers] for n in names}
    return out


def main(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int_list, default=[2048])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results/needle/sparpr"))
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    src = resolve_source(args.model, "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
    rng = random.Random(args.seed)
    keeps, rows, runs = [0.5, 0.1], [], []
    with timer() as wall:
        for n in args.lengths:
            trials = [builder.build(n, [0.25, 0.75][i % 2], random_key(rng, 5), rng) for i in range(args.trials)]
            digits = []
            for t in trials:
                span = t.ids[t.needle_at:t.needle_at + len(builder._needle(t.key))]
                digits.append([t.needle_at + j for j, s in enumerate(tok.convert_ids_to_tokens(span))
                               if s.strip("Ġ▁ ").isdigit()])
            rec = Recorder(keeps, digits, args.block_size)
            with Engine(src, Policy(gpu_batch_size=len(trials)),
                        EngineConfig(device="cpu", block_size=args.block_size)) as eng:
                eng.set_kv_policy(rec)
                res = eng.generate([t.ids for t in trials], args.gen_len)
            runs.append({"length": n, "answers": [tok.decode(r) for r in res.tokens], "keys": [t.key for t in trials]})
            rows += rec.rows
            print(n, summarise([r for r in rows if r["length"] >= n], keeps), f"{wall():.0f}s", flush=True)
    payload = {"config": vars(args), "runs": runs, "summary": summarise(rows, keeps), "rows": rows}
    lines = ["# SparPR needle-digit recall per variant (mean over steps, layers, sequences)", "",
             "| keep | " + " | ".join(NAMES) + " |", "|---|" + "---|" * len(NAMES)]
    for keep, s in payload["summary"].items():
        lines.append(f"| {keep} | " + " | ".join(str(s.get(v, "–")) for v in NAMES) + " |")
    write_results(Path(args.out), "recall", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
