"""DKV on SmolLM2-135M-Instruct: compression per block, passkey retrieval, decode speed and
prefill time, for dense, dkv, dkv with block-sparse prefill, and sparpr with DKV cold blocks.

Each configuration prefills its own batch (their caches differ in form): dense and dkv keep the
cache on the compute tier; sparpr and sparpr+dkv keep it on the disk tier (O_DIRECT; raw, or in
DKV form there) and decode once per keep ratio from one prefill. Writes <out>/bench.{json,md}.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.dkv_runs import CONFIGS, PICKS, compression_rows, render, run_config  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from flexgen_sparpr.weights.resolve import resolve_source  # noqa: E402


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192])
    ap.add_argument("--trials", type=int, default=4, help="prompts per length (one batch)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--keep", default="0.5,0.1", help="sparpr keep ratios (comma list)")
    ap.add_argument("--block", type=int, default=256, help="--dkv-block")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--residuals", type=int, default=16)
    ap.add_argument("--residual-pick", default="attention", choices=list(PICKS),
                    help="which rows a block keeps exact (--dkv-residual-pick)")
    ap.add_argument("--pick-follow", type=int, default=None,
                    help="dkv: a token inherits the pick score of this many tokens before it (default: the policy's)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--dense-layers", type=int, default=0)
    ap.add_argument("--route", default="lowrank", choices=["lowrank", "mean"], help="dkv block routing")
    ap.add_argument("--gen-len", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depths", default="0.25,0.75,0.5,0.1,0.9",
                    help="needle depths, trial i uses depths[i %% n]; 0.25,0.75 with the same --seed gives "
                         "scripts/needle.py's prompts (default: %(default)s)")
    ap.add_argument("--offload-dir", default=None, help="disk tier folder (default: a temporary one)")
    ap.add_argument("--out", default=str(REPO / "results/dkv"))
    args = ap.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.keep = [float(k) for k in args.keep.split(",") if k]
    try:
        args.depths = [float(x) for x in args.depths.split(",") if x]
    except ValueError:
        die(f"--depths must be a comma list of numbers in [0, 1] (got {args.depths!r})")
    if not args.depths or not all(0 <= x <= 1 for x in args.depths):
        die(f"--depths must be a comma list of numbers in [0, 1] (got {args.depths})")
    if set(args.configs) - set(CONFIGS):
        die(f"unknown configs {sorted(set(args.configs) - set(CONFIGS))} (known: {', '.join(CONFIGS)})")
    if args.trials < 1 or args.gen_len < 1 or not all(0 < k <= 1 for k in args.keep):
        die("--trials and --gen-len must be >= 1 and --keep values in (0, 1]")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    src = resolve_source("smollm2-135m", "")
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builder = NeedlePrompts(tok, REPO / "tests/data/alice29.txt", "The secret passkey is")
    rng = random.Random(args.seed)
    depths = args.depths
    plans = {n: [builder.build(n, depths[i % len(depths)], random_key(rng, 5), rng) for i in range(args.trials)]
             for n in args.lengths}
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "command": " ".join(["scripts/bench_dkv.py", *(argv or
               sys.argv[1:])]), "machine": machine_info(), "compression": compression_rows(args.block, args.rank,
               args.residuals), "runs": []}
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as offload, timer() as wall:
        for n in args.lengths:
            for config in args.configs:
                payload["runs"] += run_config(src, config, args, plans[n], tok, offload)
                payload["wall_s"] = round(wall(), 1)
                write_results(Path(args.out), "bench", payload, render(payload))
    print(f"wrote {args.out}/bench.json and bench.md in {payload.get('wall_s', 0)} s")


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
