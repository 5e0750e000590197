"""SparPR selection variants end to end on the needle task: every variant decodes from the same
prefill as dense (scripts/needle.py's run_batch), so the passkey scores differ only by selection.
Writes <out>/variants.json and variants.md.

A variant is a comma list of SparPR fields, e.g. "per_sequence=0,head_score=sum,summary_tokens=0"
(the first version's selection); "default" is the policy's defaults. Variants are separated by ';'.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from _common import OneLineParser, REPO, die, int_list, machine_info, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from _fidelity import float_list  # noqa: E402

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, passkey_hit, random_key  # noqa: E402
from flexgen_sparpr.engine.config import EngineConfig, Policy  # noqa: E402
from flexgen_sparpr.engine.executor import Engine  # noqa: E402
from flexgen_sparpr.kv.policies.sparpr import SparPR  # noqa: E402
from flexgen_sparpr.kv.policies import make_policy  # noqa: E402
from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402

INTS = ("recent_blocks", "summary_tokens")
BOOLS = ("per_sequence",)


def scores(trials):
    """(variant, keep, length) -> (hits, n)."""
    acc = {}
    for r in trials:
        h, n = acc.get((r["policy"], r["keep"], r["length"]), (0, 0))
        acc[(r["policy"], r["keep"], r["length"])] = (h + r["hit"], n + 1)
    return acc


def run_batch(eng, trials, pols, gen_len, eos, tok):
    """Prefill the batch once, decode it densely and with every variant. Returns records, times."""
    dense = make_policy("dense")
    eng.set_kv_policy(dense, attach=False)  # the engine's own policy must not also be an observer
    with timer() as t_pre:
        st = eng.prefill([t.ids for t in trials], gen_len, observers=tuple(pols.values()))
    snap = eng.snapshot(st)
    records, times = [], {"prefill_s": round(t_pre(), 2)}
    for (name, keep), pol in [(("dense", 1.0), dense), *pols.items()]:
        eng.set_kv_policy(pol, attach=False)
        with timer() as t_dec:
            res = eng.decode(eng.restore(snap), stop=eos)
        times[f"{name}@{keep}"] = round(t_dec(), 2)
        for trial, toks in zip(trials, res.tokens):
            toks = toks[:toks.index(eos)] if eos in toks else toks
            answer = tok.decode(toks, skip_special_tokens=True)
            records.append({"policy": name, "keep": keep, "length": len(trial.ids), "depth": trial.depth,
                            "key": trial.key, "answer": answer, "hit": passkey_hit(answer, trial.key)})
    return records, times


def parse_variant(text: str) -> dict:
    """'per_sequence=0,head_score=sum' -> SparPR keyword arguments ('default' -> {})."""
    if text == "default":
        return {}
    kw = {}
    for item in text.split(","):
        key, _, val = item.partition("=")
        if key in INTS:
            kw[key] = int(val)
        elif key in BOOLS:
            kw[key] = val not in ("0", "false", "False")
        elif key in ("head_score", "summary"):
            kw[key] = val
        elif key == "summary_rank":
            kw[key] = float(val)
        else:
            raise ValueError(f"unknown variant field {key!r} in {text!r}")
    SparPR(keep_ratio=0.5, quest_only=True, **kw)  # refuse bad knobs before any prefill
    return kw


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", default="per_sequence=0,head_score=sum,summary_tokens=0;default")
    ap.add_argument("--lengths", type=int_list, default=[2048])
    ap.add_argument("--keep", type=float_list, default=[0.1])
    ap.add_argument("--trials", type=int, default=5, help="trials per length (depths 0.25 / 0.75 alternate)")
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="0: the same prompts as needle.py's first batch")
    ap.add_argument("--out", default=str(REPO / "results/needle/sparpr"))
    args = ap.parse_args(argv)
    try:
        variants = {v: parse_variant(v) for v in args.variants.split(";") if v}
    except (ValueError, TypeError) as e:
        die(f"--variants: {e}")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    src = resolve_source(args.model, "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
    rng = random.Random(args.seed)
    records, engines = [], {}
    with timer() as wall:
        for n in args.lengths:
            plan = [builder.build(n, [0.25, 0.75][i % 2], random_key(rng, 5), rng) for i in range(args.trials)]
            for i in range(0, len(plan), args.batch):
                chunk = plan[i:i + args.batch]
                if len(chunk) not in engines:
                    engines[len(chunk)] = Engine(src, Policy(gpu_batch_size=len(chunk)),
                                                 EngineConfig(device="cpu", block_size=args.block_size))
                pols = {(v, k): SparPR(keep_ratio=k, **kw) for v, kw in variants.items() for k in args.keep}
                recs, times = run_batch(engines[len(chunk)], chunk, pols, 12, src.spec.eos_id, tok)
                records += recs
                print(n, i, times, f"{wall():.0f}s", flush=True)
        for eng in engines.values():
            eng.close()
        wall_s = round(wall(), 1)
    acc = scores(records)
    lines = ["# SparPR selection variants on the needle (passkeys hit / trials)", "",
             "| variant | keep | " + " | ".join(f"{n} tok" for n in args.lengths) + " |",
             "|---|---|" + "---|" * len(args.lengths)]
    for (pol, keep) in sorted({k[:2] for k in acc}, key=lambda pk: (pk[0] != "dense", pk)):
        lines.append(f"| {pol} | {keep:g} | " + " | ".join(
            f"{acc[(pol, keep, n)][0]} / {acc[(pol, keep, n)][1]}" for n in args.lengths) + " |")
    lines += ["", f"Wall time: {wall_s} s, CPU, block size {args.block_size}, batch {args.batch}, seed {args.seed}."]
    config = vars(args) | {"machine": machine_info()}
    paths = write_results(Path(args.out), "variants", {"config": config, "wall_s": wall_s, "trials": records},
                          "\n".join(lines) + "\n")
    print("\n".join(lines[2:]))
    print(f"wrote {', '.join(map(str, paths))}")


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
