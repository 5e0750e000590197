"""Long-text perplexity per KV policy on SmolLM2-135M-Instruct: prefill P tokens of a held-out
public-domain text densely, then decode the next T tokens teacher-forced with every policy
reading its keep of the cache, and score the text's true next token.

One prefill per batch of windows serves every policy of a family (flexgen_sparpr/bench/sweep.py:
raw blocks for dense and the budgeted policies, DKV blocks for dkv and sparpr+dkv). Writes
<out>/ppl.json (plan, config, every window x policy), ppl.md and ppl.png; after every batch, so
a run stopped by --max-minutes (or anything else) resumes where it stopped when run again.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import (check_context, die, exact_routed_arg, float_list, int_list,  # noqa: E402
                                       OneLineParser, resolve_split, split_args)
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402
from flexgen_sparpr.bench.resume import plan_batches, resumed_batches  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from flexgen_sparpr.bench.forced import ForcedTokens  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import normalise_filler  # noqa: E402
from flexgen_sparpr.bench.perplexity import stream_windows, windows  # noqa: E402
from flexgen_sparpr.bench.resume import PlanMismatch, done_ids, load_partial  # noqa: E402
from flexgen_sparpr.bench.sweep import COMPOSED, DKV_BLOCK, PolicySweep, configs, known_policies, resolved_config  # noqa: E402
from flexgen_sparpr.bench.ppl_report import render  # noqa: E402
from flexgen_sparpr.utils.progress import bars_wanted, progress  # noqa: E402


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    split_args(ap)
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 7936], help="prefilled tokens P")
    ap.add_argument("--score-tokens", type=int, default=64, help="teacher-forced, scored tokens T per window")
    ap.add_argument("--windows", type=int, default=2, help="windows per text and length (--stream: per length)")
    ap.add_argument("--stream", action="store_true",
                    help="cut the windows from the split's texts joined into one stream (blank line between "
                         "them), evenly spaced: prompts overlap, scored spans do not (texts shorter than a window)")
    ap.add_argument("--keep", type=float_list, default=[0.5, 0.25, 0.1, 0.05], help="keep ratios")
    ap.add_argument("--policies", default="", help="comma list (default: every registered policy and sparpr+dkv); "
                    "A+q8, A+q4, A+float16: policy A over KV blocks stored so on the disk tier (--kv-dtype)")
    ap.add_argument("--batch", type=int, default=4, help="windows per prefill")
    ap.add_argument("--block-size", type=int, default=16, help="KV block of the raw family")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "raw", "bfloat16", "int8", "int4"],
                    help="the engine's --weight-format (default auto, the engine's default)")
    ap.add_argument("--dkv-block", type=int, default=DKV_BLOCK,
                    help="KV block of the dkv family (default: the dkv policy's --dkv-block)")
    exact_routed_arg(ap)
    ap.add_argument("--max-minutes", type=float, default=0, help="start no batch after this (0: no limit)")
    ap.add_argument("--fresh", action="store_true", help="start over instead of resuming from <out>/ppl.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    ap.add_argument("--out", default=str(REPO / "results/ppl"))
    args = ap.parse_args(argv)
    resolve_split(args)
    args.policy_names = ([p for p in args.policies.split(",") if p]
                         or [p for p in known_policies(COMPOSED) if p != "dense"])
    try:
        args.configs = configs(args.policy_names, args.keep)
    except ValueError as e:
        die(str(e))
    if args.score_tokens < 1 or args.windows < 1 or args.batch < 1:
        die("--score-tokens, --windows and --batch must be >= 1")
    if not all(0 < k <= 1 for k in args.keep):
        die("--keep values must be in (0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    from flexgen_sparpr.weights.resolve import resolve_source
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    check_context(src.spec, [(n, args.score_tokens + 1) for n in args.lengths])
    wins = {}
    texts = [(t.name, tok(normalise_filler(t.path.read_text(encoding="utf-8", errors="replace")),
                          add_special_tokens=False)["input_ids"]) for t in args.text_objs]
    if args.stream:  # one stream: the texts in the split's order, a blank line between them
        sep = tok("\n\n", add_special_tokens=False)["input_ids"]
        joined = [i for j, (_, ids) in enumerate(texts) for i in (sep if j else []) + ids]
        texts = [("+".join(n for n, _ in texts), joined)]
    for name, ids in texts:
        for n in args.lengths:
            try:
                wins.setdefault(n, []).extend(stream_windows(name, ids, n, args.score_tokens, args.windows)
                                              if args.stream else
                                              windows(name, ids, n, args.score_tokens, args.windows, args.seed))
            except ValueError as e:
                die(str(e))
    plan = {"split": args.split, "texts": [t.name for t in args.text_objs], "seed": args.seed,
            "lengths": args.lengths, "score_tokens": args.score_tokens, "windows": args.windows,
            "configs": [c.label for c in args.configs], "batch": args.batch, "block_size": args.block_size,
            "dkv_block": args.dkv_block, "weight_format": args.weight_format}
    dkv_args = {"exact_routed": args.dkv_exact_routed} if args.dkv_exact_routed else {}
    plan |= {"dkv_args": dkv_args} if dkv_args else {}  # older plans (no such key) still resume
    plan |= {"stream": True} if args.stream else {}
    out = Path(args.out)
    try:
        old = None if args.fresh else load_partial(out / "ppl.json", plan)
    except (PlanMismatch, ValueError) as e:
        die(str(e))
    batches = plan_batches(wins, args.batch)
    config = dict(plan, keep=args.keep, policies=args.policy_names, device=args.device,
                  engine_commit=engine_commit(), machine=machine_info(),
                  resolved=resolved_config(args.configs, args.device, args.block_size, args.dkv_block, dkv_args),
                  texts_detail={t.name: {"title": t.title, "file": t.file} for t in args.text_objs})
    payload = {"plan": plan, "config": config, "batches": resumed_batches(old),
               "records": old["records"] if old else [], "skipped": [], "wall_s": old.get("wall_s", 0) if old else 0}
    done = done_ids(old)
    sweep = PolicySweep(src, device=args.device, block_size=args.block_size, dkv_block=args.dkv_block,
                        dkv_args=dkv_args, weight_format=args.weight_format)
    todo = [(bid, n, ws) for bid, n, ws in batches if bid not in done]
    print(f"{len(batches) - len(todo)} of {len(batches)} batches already in {out / 'ppl.json'}", flush=True)
    base = payload["wall_s"]
    try:
        with timer() as wall:
            for bid, n, ws in progress(todo, desc="batches", unit="batch", enabled=bars_wanted(args.quiet)):
                if args.max_minutes and wall() > 60 * args.max_minutes:
                    payload["skipped"].append(bid)
                    continue
                recs, times = [], {}

                def done_one(cfg, res, sampler, secs, ws=ws, n=n, bid=bid):
                    nll, top1 = sampler.nll, sampler.top1  # [B, T]
                    times[cfg.label] = round(secs, 2)
                    for w, row_nll, row_top in zip(ws, nll, top1):
                        recs.append({"batch": bid, "window": f"{w.text}:{w.start}", "text": w.text, "length": n,
                                     "label": cfg.label, "policy": cfg.policy, "keep": cfg.keep,
                                     "nll_sum": float(row_nll.sum()), "n": int(row_nll.numel()),
                                     "top1": int(row_top.sum())})
                pre = sweep.run([w.prompt for w in ws], args.score_tokens + 1, args.configs,
                                # the prefill predicts forced[0] (dense for all); each decode scores the rest
                                lambda cfg, ws=ws: ForcedTokens([w.forced[0 if cfg is None else 1:] for w in ws]),
                                on_done=done_one)
                payload["records"] += recs
                payload["batches"].append({"id": bid, "length": n, "windows": len(ws), **pre, "decode_s": times,
                                           "engine": config["engine_commit"],
                                           "weight_format": sweep.weight_formats()})
                payload["wall_s"] = round(base + wall(), 1)
                dense = [r for r in recs if r["label"] == "dense"]
                print(f"{bid}: dense ppl {math.exp(sum(r['nll_sum'] for r in dense) / sum(r['n'] for r in dense)):.2f}"
                      f", prefill {pre['prefill_s']}, elapsed {wall():.0f}s", flush=True)
                write_results(out, "ppl", payload, render(payload, out / "ppl.png"))
    finally:
        sweep.close()
    paths = write_results(out, "ppl", payload, render(payload, out / "ppl.png"))
    print(f"wrote {', '.join(str(p) for p in paths)}, {out / 'ppl.png'}")


if __name__ == "__main__":
    main()
