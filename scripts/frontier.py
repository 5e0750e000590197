"""The keep frontier: for SparPR, Quest, DKV and SparPR+DKV, the smallest keep at which the answer
still equals dense's in >= 95 % of trials, per task and context length (DKV has no keep: its
budget is its bytes per block over a raw block's, set by its rank and exact rows, so its column
is the smallest such share measured, one needle.py run per DKV configuration). Reads one or more
needle.json files of scripts/needle.py made with the same prompts (split, texts, depths, seed,
tasks; trials and batch too where two files share a context length): their records are joined by trial, so a run with --no-dense takes dense's
answers from another. Writes <out>/frontier.{json,md,png}.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import md_table, write_results  # noqa: E402
from flexgen_sparpr.bench.fidelity import frontier, summarize  # noqa: E402
from flexgen_sparpr.bench.frontier_report import POLICIES, dkv_bytes, dkv_cell, load, parse_drop, plot  # noqa: E402


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="needle.json files of scripts/needle.py (same prompts)")
    ap.add_argument("--threshold", type=float, default=0.95, help="agreement with dense needed")
    ap.add_argument("--drop", default="", help="comma list of labels (policy@keep, e.g. sparpr@0.02) left out, or "
                    "policy@keep:length for one context length: a keep run only under an older default, "
                    "which no newer input replaces")
    ap.add_argument("--out", default=str(REPO / "results/fidelity"))
    args = ap.parse_args(argv)
    if not 0 < args.threshold <= 1:
        die("--threshold must be in (0, 1]")
    drop = sorted(parse_drop(args.drop))
    plan, recs, commits = load([Path(p) for p in args.inputs], frozenset(drop))
    rows = summarize(recs)
    cells = sorted({(r["task"], r["length"]) for r in rows if r["label"] != "dense"})
    if not cells:
        die("the inputs hold no policy's answers besides dense's: there is no frontier to find")
    dkvs = ["dkv"] + sorted({r["policy"] for r in rows if r["policy"].startswith("dkv-exact")})
    every = (*POLICIES, *dkvs)
    fr = {p: frontier(rows, p, args.threshold) for p in every}  # dkv: over its bytes shares
    keeps = {p: sorted({r["keep"] for r in rows if r["policy"] == p}, reverse=True) for p in every}
    dkv_rows = {p: {} for p in dkvs}
    for r in rows:
        if r["policy"] in dkv_rows:
            dkv_rows[r["policy"]].setdefault((r["task"], r["length"]), []).append(r)
    n = {(r["task"], r["length"]): r["n"] for r in rows if r["label"] == "dense"}

    def cell(pol, c):
        if c not in fr[pol]:
            return "–"
        k = fr[pol][c]
        return f"{k:g}" if k is not None else f"> {max(keeps[pol]):g}"
    table = [[t, n_, n.get((t, n_), "?"), *[cell(p, (t, n_)) for p in POLICIES],
              *["–" if (t, n_) not in dkv_rows[p] else dkv_cell(fr[p][(t, n_)], dkv_rows[p][(t, n_)]) for p in dkvs]]
             for t, n_ in cells]
    png = Path(args.out) / "frontier.png"
    plot(fr, cells, png)
    payload = {"config": {"inputs": [str(p) for p in args.inputs], "threshold": args.threshold, "prompts": plan,
                          "dropped": drop,
                          "engine_commits": commits, "keeps": keeps},
               "frontier": {p: [{"task": t, "length": n_, "keep": k} for (t, n_), k in sorted(fr[p].items())]
                            for p in every},
               "rows": rows}
    md = "\n".join([
        "# The keep frontier (SmolLM2-135M-Instruct)", "",
        f"Smallest keep ratio at which a policy's answer equals dense's in ≥ {100 * args.threshold:g} % of the "
        f"trials, at that keep and every larger one measured (`> k`: not even at the largest, k). Keeps "
        f"measured: {json.dumps({p: keeps[p] for p in POLICIES})}. DKV has no keep: its budget is its bytes per "
        f"block over a raw block's (256-token blocks; rank 32 and 16 exact rows: {dkv_bytes():.3f}), and its "
        f"column is the smallest such share measured that meets the same bar, then each configuration's trials "
        f"equal to dense's and how many of dense's right answers it also gives (agreeing on dense's wrong answers "
        f"counts in the first); shares measured: {keeps['dkv']}. "
        + ("A `dkv-exactE` column is DKV with its E routed blocks of most attention mass read raw and attended "
           "exactly (`--dkv-exact-routed E`): the same bytes stored encoded, a raw copy of every block on a "
           "slower tier, E blocks a sequence read from it a step. " if len(dkvs) > 1 else "") +
        f"With n trials a cell needs ⌈{args.threshold:g}·n⌉ agreements ("
        + ", ".join(f"{math.ceil(args.threshold * k - 1e-9)} of {k}" for k in sorted(set(n.values()), reverse=True))
        + "). Split "
        f"**{plan['split']}**: texts {', '.join(plan['texts'])}, depths {plan['depths']}, seed {plan['seed']}.", "",
        md_table(["task", "context", "trials", *[f"{p} keep" for p in POLICIES], *[f"{p} bytes" for p in dkvs]], table),
        f"Inputs: {', '.join(args.inputs)}; engine commits {', '.join(sorted(set(commits)))}. Plot: {png.name}.", ""])
    paths = write_results(Path(args.out), "frontier", payload, md)
    print(md)
    print(f"wrote {', '.join(map(str, paths))}, {png}")


if __name__ == "__main__":
    main()
