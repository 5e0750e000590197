"""Agreement with dense, trial by trial, of every configuration in one or more scripts/needle.py
runs (e.g. one per context length), per task and context; the target's verdict (SparPR at keep
0.1 gives dense's answer in >= 95 % of the trials of every task and context) and every trial on
which a watched configuration's answer differs from dense's. Files are joined as frontier.py
joins them (same prompts; DKV's label is its bytes share). Writes <out>/agreement.{json,md}.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import md_table, write_results  # noqa: E402
from flexgen_sparpr.bench.frontier_report import load  # noqa: E402

from flexgen_sparpr.bench.fidelity import summarize  # noqa: E402
from flexgen_sparpr.bench.sweep import REFERENCE  # noqa: E402


def order(label: str) -> tuple:
    name, _, keep = label.partition("@")
    return (label != REFERENCE, name, -float(keep) if keep else 0)


def shown(answer: str, hit: bool) -> str:
    """An answer in a table cell: its first 40 characters quoted (a bar escaped), ✓ where it hits."""
    return repr(answer.strip()[:40]).replace("|", "\\|") + (" ✓" if hit else "")


def differing(recs: list[dict], label: str) -> list[dict]:
    """The trials where `label`'s canonical answer differs from dense's: what each answered."""
    dense = {(r["trial"], r["length"]): r for r in recs if r["label"] == REFERENCE}
    out = []
    for r in sorted((r for r in recs if r["label"] == label), key=lambda r: (r["length"], r["trial"])):
        d = dense.get((r["trial"], r["length"]))
        if d is not None and r["canon"] != d["canon"]:
            out.append({"trial": r["trial"], "task": r["task"], "length": r["length"], "text": r.get("text"),
                        "depth": r["depth"], "expected": r["expected"], "dense": d.get("answer", d["canon"]),
                        "dense_hit": d["hit"], label: r.get("answer", r["canon"]), "hit": r["hit"]})
    return out


def pair_table(rows: list[dict], before: str, after: str, tasks: list[str], lengths: list[int]) -> list[list]:
    """Per task and context, the trials equal to dense's under `before` -> under `after` ("–" where a
    configuration has none there), and an "all" row over the tasks where both ran."""
    agree = {(r["label"], r["task"], r["length"]): r for r in rows}
    table, total = [], {n: [0, 0, 0] for n in lengths}
    for task in tasks:
        cells = []
        for n in lengths:
            a, b = agree.get((before, task, n)), agree.get((after, task, n))
            if a is None and b is None:
                cells.append("–")
                continue
            cells.append(f"{a['agree'] if a else '–'} -> {b['agree'] if b else '–'}")
            if a and b:
                total[n] = [total[n][0] + a["agree"], total[n][1] + b["agree"], total[n][2] + b["n"]]
        table.append([task, *cells])
    table.append(["all (tasks where both ran)", *[
        f"{a} -> {b} of {k} ({100 * b / k:.0f} %)" if k else "–" for a, b, k in (total[n] for n in lengths)]])
    return table


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+", help="needle.json files of scripts/needle.py (same prompts)")
    ap.add_argument("--target", default="sparpr@0.1", help="the configuration the verdict is about")
    ap.add_argument("--threshold", type=float, default=0.95, help="agreement with dense needed")
    ap.add_argument("--watch", default="sparpr@0.1,sparpr@0.5,sparpr+dkv@0.1,quest@0.1",
                    help="comma list of labels whose differing trials are listed")
    ap.add_argument("--pair", default="",
                    help="BEFORE,AFTER: two labels whose trials equal to dense's are set side by side per task")
    ap.add_argument("--title", default="Agreement with dense at the defaults", help="the report's heading")
    ap.add_argument("--out", default=str(REPO / "results/fidelity/defaults"))
    args = ap.parse_args(argv)
    if not 0 < args.threshold <= 1:
        die("--threshold must be in (0, 1]")
    pair = [x for x in args.pair.split(",") if x]
    if args.pair and len(pair) != 2:
        die(f"--pair {args.pair}: expected two labels, BEFORE,AFTER")
    plan, recs, commits = load([Path(p) for p in args.inputs])
    rows = summarize(recs)
    unknown = [x for x in pair if not any(r["label"] == x for r in rows)]
    if unknown:
        die(f"--pair: no configuration {', '.join(unknown)} with dense's answers in the inputs")
    if not any(r["label"] == args.target for r in rows):
        die(f"--target {args.target}: no such configuration with dense's answers in the inputs")
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lines = [f"# {args.title} (SmolLM2-135M-Instruct)", "",
             f"Split **{plan['split']}**: texts {', '.join(plan['texts'])}, depths {plan['depths']}, seed "
             f"{plan['seed']}. Cell: trials whose answer equals dense's (the answers' numbers, or the phrase) / "
             "trials, then the configuration's hits (dense row: its hits / trials). dkv@S: DKV at its defaults, S its "
             "bytes per raw block's. Inputs: " + ", ".join(args.inputs) + f"; engine commits "
             f"{', '.join(sorted(set(commits)))}.", ""]
    if pair:
        lines += [f"## {pair[0]} -> {pair[1]}", "",
                  f"Trials whose answer equals dense's, under {pair[0]} -> under {pair[1]}, of the task's trials "
                  "(the tables below give each one's count).", "",
                  md_table(["task", *[f"{n} tok" for n in lengths]], pair_table(rows, *pair, tasks, lengths))]
    verdicts = []
    for task in tasks:
        by = {(r["label"], r["length"]): r for r in rows if r["task"] == task}
        labels = sorted({lab for lab, _ in by}, key=order)
        table = [[lab, *[("–" if (lab, n) not in by else
                          f"{by[(lab, n)]['hits']}/{by[(lab, n)]['n']}" if lab == REFERENCE else
                          f"{by[(lab, n)]['agree']}/{by[(lab, n)]['n']} ({by[(lab, n)]['hits']})") for n in lengths]]
                 for lab in labels]
        lines += [f"## {task}", "", md_table(["config", *[f"{n} tok" for n in lengths]], table)]
        for n in lengths:
            r = by.get((args.target, n))
            if r:
                need = math.ceil(args.threshold * r["n"] - 1e-9)
                verdicts.append({"task": task, "length": n, "agree": r["agree"], "n": r["n"], "need": need,
                                 "agree_lo": round(r["agree_lo"], 3), "met": r["agree"] >= need})
    lines += ["## Verdict", "",
              f"{args.target} gives dense's answer in ≥ {100 * args.threshold:g} % of the trials:", "",
              md_table(["task", "context", "agree / trials", "needed", "Wilson 95 % low", "met"],
                       [[v["task"], v["length"], f"{v['agree']}/{v['n']}", v["need"], f"{v['agree_lo']:.2f}",
                         "yes" if v["met"] else "**no**"] for v in verdicts])]
    watch = [w for w in args.watch.split(",") if w and any(r["label"] == w for r in rows)]
    diffs = {w: differing(recs, w) for w in watch}
    for w, ds in diffs.items():
        lines += [f"## Trials where {w} differs from dense ({len(ds)})", ""]
        if ds:
            lines.append(md_table(["trial", "text", "depth", "expected", "dense", w],
                                  [[d["trial"], d["text"], d["depth"], " ".join(d["expected"]),
                                    shown(d["dense"], d["dense_hit"]), shown(d[w], d["hit"])] for d in ds]))
    payload = {"config": {"inputs": args.inputs, "target": args.target, "threshold": args.threshold, "pair": pair,
                          "prompts": plan,
                          "engine_commits": sorted(set(commits))},
               "verdict": verdicts, "rows": rows, "differing": diffs}
    paths = write_results(Path(args.out), "agreement", payload, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    main()
