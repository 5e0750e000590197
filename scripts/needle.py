"""Retrieval fidelity on SmolLM2-135M-Instruct: dense attention against every KV policy on the
passkey needle and harder retrieval tasks (--task), at several context lengths and keep ratios.

Each batch of trials is prefilled once per family (flexgen_sparpr/bench/sweep.py) and every
configuration decodes from a snapshot of it. Prompts come from the split's texts, depths and
seed (--split held-out for reported results; --split tuning is what the selection rules were
tuned on: alice29, depths 0.25/0.75, seed 0, the original needle grid's prompts). Writes
<out>/needle.json (plan, config, every trial), needle.md and needle.png after every batch; run
the same command again to resume.
"""
from __future__ import annotations

import os
import random
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

from flexgen_sparpr.bench.forced import ForcedTokens, greedy  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts  # noqa: E402
from flexgen_sparpr.bench.resume import PlanMismatch, done_ids, load_partial  # noqa: E402
from flexgen_sparpr.bench.sweep import (COMPOSED, DKV_BLOCK, DKV_RANK, DKV_RESIDUALS, Config, PolicySweep,  # noqa: E402
                                        configs, known_policies, resolved_config)
from flexgen_sparpr.bench.tasks import TASKS, build_trial, canonical, hit  # noqa: E402
from flexgen_sparpr.bench.needle_report import render  # noqa: E402
from flexgen_sparpr.utils.progress import bars_wanted, progress  # noqa: E402

FRONTIER_POLICIES = ("sparpr", "quest", "sparpr+dkv")  # swept over --frontier-keep too


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    split_args(ap, depths=True)
    ap.add_argument("--task", default="passkey", help=f"comma list of {', '.join(TASKS)}, or all")
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 7936], help="prompt tokens")
    ap.add_argument("--keep", type=float_list, default=[0.5, 0.1, 0.05], help="keep ratios (every policy)")
    ap.add_argument("--frontier-keep", type=float_list, default=[],
                    help=f"further keep ratios for {', '.join(FRONTIER_POLICIES)} only (the frontier's sweep)")
    ap.add_argument("--policies", default="", help="comma list (default: every registered policy and sparpr+dkv); "
                    "A+q8, A+q4, A+float16: policy A over KV blocks stored so on the disk tier (--kv-dtype)")
    ap.add_argument("--no-dense", action="store_true",
                    help="leave dense out (its answers come from another run of the same plan; frontier.py joins them)")
    ap.add_argument("--trials", type=int, default=10, help="trials per task and length")
    ap.add_argument("--batch", type=int, default=5, help="prompts per prefill")
    ap.add_argument("--block-size", type=int, default=16, help="KV block of the raw family (Quest's page)")
    ap.add_argument("--weight-format", default="auto", choices=["auto", "raw", "bfloat16", "int8", "int4"],
                    help="the engine's --weight-format (default auto, the engine's default)")
    ap.add_argument("--dkv-block", type=int, default=DKV_BLOCK,
                    help="KV block of the dkv family (default: the dkv policy's --dkv-block)")
    ap.add_argument("--dkv-rank", type=int, default=DKV_RANK, help="rank of the dkv family's joint K|V delta")
    ap.add_argument("--dkv-residuals", type=int, default=DKV_RESIDUALS,
                    help="exact rows per block of the dkv family (frontier.py reads DKV's bytes from these)")
    exact_routed_arg(ap)
    ap.add_argument("--answer-prefix", default="The secret passkey is", help="opens the passkey tasks' answer")
    ap.add_argument("--max-minutes", type=float, default=0, help="start no batch after this (0: no limit)")
    ap.add_argument("--fresh", action="store_true", help="start over instead of resuming from <out>/needle.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    ap.add_argument("--out", default=str(REPO / "results/needle"))
    args = ap.parse_args(argv)
    resolve_split(args)
    args.tasks = list(TASKS) if args.task == "all" else [t for t in args.task.split(",") if t]
    if not args.tasks or set(args.tasks) - set(TASKS):
        die(f"--task must be a comma list of {', '.join(TASKS)} or all (got {args.task!r})")
    args.policy_names = ([p for p in args.policies.split(",") if p]
                         or [p for p in known_policies(COMPOSED) if p != "dense"])
    try:
        cfgs = configs(args.policy_names, args.keep, dense=not args.no_dense)
        extra = [Config(p, k) for p in args.policy_names if p in FRONTIER_POLICIES
                 for k in args.frontier_keep if k not in args.keep]
    except ValueError as e:
        die(str(e))
    args.configs = cfgs + extra
    if args.trials < 1 or args.batch < 1:
        die("--trials and --batch must be >= 1")
    if not all(0 < k <= 1 for k in args.keep + args.frontier_keep):
        die("keep ratios must be in (0, 1]")
    if not (1 <= args.dkv_rank <= args.dkv_block and 0 <= args.dkv_residuals <= args.dkv_block):
        die(f"--dkv-rank must be in 1..{args.dkv_block} and --dkv-residuals in 0..{args.dkv_block} (--dkv-block)")
    defaults = {"rank": DKV_RANK, "residuals": DKV_RESIDUALS, "exact_routed": 0}
    given = {"rank": args.dkv_rank, "residuals": args.dkv_residuals, "exact_routed": args.dkv_exact_routed}
    args.dkv_args = {k: v for k, v in given.items() if v != defaults[k]}  # only what differs: older plans still resume
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    from flexgen_sparpr.weights.resolve import resolve_source
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builders = [NeedlePrompts(tok, t.path, args.answer_prefix) for t in args.text_objs]
    rng = random.Random(args.seed)  # one stream: --split tuning --task passkey rebuilds the original grid
    plans = {}
    for task in args.tasks:
        for n in args.lengths:
            try:
                plans[(task, n)] = [build_trial(task, builders[i % len(builders)], n, args.depths[i % len(args.depths)],
                                                rng, args.text_objs[i % len(builders)].name)
                                    for i in range(args.trials)]
            except ValueError as e:
                die(str(e))
    check_context(src.spec, [(n, ts[0].gen_len) for (_, n), ts in plans.items() if ts])
    plan = {"split": args.split, "texts": [t.name for t in args.text_objs], "depths": args.depths, "seed": args.seed,
            "tasks": args.tasks, "lengths": args.lengths, "trials": args.trials, "batch": args.batch,
            "configs": [c.label for c in args.configs], "block_size": args.block_size, "dkv_block": args.dkv_block,
            "weight_format": args.weight_format,
            "answer_prefix": args.answer_prefix, **({"dkv_args": args.dkv_args} if args.dkv_args else {})}
    out = Path(args.out)
    try:
        old = None if args.fresh else load_partial(out / "needle.json", plan)
    except (PlanMismatch, ValueError) as e:
        die(str(e))
    config = dict(plan, keep=args.keep, frontier_keep=args.frontier_keep, policies=args.policy_names,
                  device=args.device, engine_commit=engine_commit(), machine=machine_info(),
                  resolved=resolved_config(args.configs, args.device, args.block_size, args.dkv_block, args.dkv_args))
    payload = {"plan": plan, "config": config, "batches": resumed_batches(old),
               "records": old["records"] if old else [], "skipped": [], "wall_s": old.get("wall_s", 0) if old else 0}
    done = done_ids(old)
    todo = [b for b in plan_batches(plans, args.batch) if b[0] not in done]
    print(f"{len(done)} batches already in {out / 'needle.json'}; {len(todo)} to run", flush=True)
    eos = src.spec.eos_id
    sweep = PolicySweep(src, device=args.device, block_size=args.block_size, dkv_block=args.dkv_block,
                        dkv_args=args.dkv_args, weight_format=args.weight_format)
    base = payload["wall_s"]
    try:
        with timer() as wall:
            for bid, (task, n), trials in progress(todo, desc="batches", unit="batch", enabled=bars_wanted(args.quiet)):
                if args.max_minutes and wall() > 60 * args.max_minutes:
                    payload["skipped"].append(bid)
                    continue
                recs, times = [], {}
                forced = [t.forced for t in trials]
                nf = len(forced[0])

                def sampler_for(cfg, forced=forced, nf=nf):
                    if not nf:
                        return greedy()
                    return ForcedTokens([f[0 if cfg is None else 1:] for f in forced])  # then greedy

                def done_one(cfg, res, sampler, secs, trials=trials, bid=bid, nf=nf):
                    times[cfg.label] = round(secs, 2)
                    for j, (t, toks) in enumerate(zip(trials, res.tokens)):
                        toks = toks[nf:]
                        toks = toks[:toks.index(eos)] if eos in toks else toks
                        answer = tok.decode(toks, skip_special_tokens=True)
                        recs.append({"batch": bid, "trial": f"{bid}:{j}", "task": t.task, "length": n, "text": t.text,
                                     "depth": t.depth, "expected": list(t.expected), "label": cfg.label,
                                     "policy": cfg.policy, "keep": cfg.keep, "answer": answer,
                                     "hit": hit(t.task, answer, t.expected), "canon": canonical(t.task, answer)})
                # forced tokens may hold the stop token (the chat template's turn end): then no early stop
                pre = sweep.run([t.ids for t in trials], nf + trials[0].gen_len, args.configs, sampler_for,
                                stop=None if nf else eos, on_done=done_one)
                payload["records"] += recs
                payload["batches"].append({"id": bid, "task": task, "length": n, "trials": len(trials), **pre,
                                           "decode_s": times, "engine": config["engine_commit"],
                                           "weight_format": sweep.weight_formats()})
                payload["wall_s"] = round(base + wall(), 1)
                dh = sum(r["hit"] for r in recs if r["label"] == "dense")
                print(f"{bid}: dense {dh}/{len(trials)}, prefill {pre['prefill_s']}, elapsed {wall():.0f}s", flush=True)
                write_results(out, "needle", payload)  # the records first: a report that fails loses nothing
                write_results(out, "needle", payload, render(payload, out / "needle.png"))
    finally:
        sweep.close()
    paths = write_results(out, "needle", payload, render(payload, out / "needle.png"))
    print(f"wrote {', '.join(str(p) for p in [*paths, out / 'needle.png'] if p.exists())}")


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
