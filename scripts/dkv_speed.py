"""DKV's decode speed against dense, interleaved in one run (SmolLM2-135M-Instruct, CPU).

Per context length: one batch of held-out passkey prompts, prefilled once by a dense engine and
once by a dkv engine (both with the cache on the compute tier, `--block` tokens per block); then
`--rounds` rounds that each time one dense decode and one dkv decode of `--gen-len` tokens (no
stop token), alternating, so machine load hits both alike. Also checks that the greedy answers
(with the stop token) agree. Writes <out>/speed.{json,md}: tok/s per round, the median of the
per-round ratios dkv / dense, the answers, the config and the engine commit.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import (check_context, die, exact_routed_arg, int_list, OneLineParser,  # noqa: E402
                                       resolve_split, split_args)
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from flexgen_sparpr.bench.needle_prompt import NeedlePrompts  # noqa: E402
from flexgen_sparpr.bench.tasks import build_trial  # noqa: E402
from flexgen_sparpr.bench.dkv_speed import interleaved, render  # noqa: E402


def parse_args(argv=None):
    ap = OneLineParser(description=__doc__.splitlines()[0])
    split_args(ap, depths=True)
    ap.add_argument("--lengths", type=int_list, default=[2048, 4096, 7936])
    ap.add_argument("--batch", type=int, default=4, help="prompts per batch")
    ap.add_argument("--gen-len", type=int, default=16, help="tokens per timed decode")
    ap.add_argument("--rounds", type=int, default=3, help="dense/dkv decode pairs per length")
    ap.add_argument("--block", type=int, default=256, help="KV block tokens (both engines)")
    exact_routed_arg(ap)
    ap.add_argument("--out", default=str(REPO / "results/dkv/speed-interleaved"))
    args = ap.parse_args(argv)
    resolve_split(args)
    if min(args.batch, args.rounds) < 1 or args.gen_len < 2:
        die("--batch and --rounds must be >= 1 and --gen-len >= 2")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    from flexgen_sparpr.weights.resolve import resolve_source
    src = resolve_source("smollm2-135m", "")
    check_context(src.spec, [(n, args.gen_len) for n in args.lengths])
    tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
    builders = [NeedlePrompts(tok, t.path, "The secret passkey is") for t in args.text_objs]
    rng = random.Random(args.seed)
    config = {k: v for k, v in vars(args).items() if k != "text_objs"} | {
        "texts": [t.name for t in args.text_objs], "device": "cpu", "engine_commit": engine_commit()}
    payload = {"config": config, "machine": machine_info(), "runs": [],
               "command": " ".join(["scripts/dkv_speed.py", *(argv if argv is not None else sys.argv[1:])])}
    with timer() as wall:
        for n in args.lengths:
            trials = [build_trial("passkey", builders[i % len(builders)], n, args.depths[i % len(args.depths)], rng)
                      for i in range(args.batch)]
            run = interleaved(src, tok, trials, args)
            payload["runs"].append({"length": n, **run})
            print(f"{n}: dense {run['dense_tok_s']}, dkv {run['dkv_tok_s']}, median ratio {run['ratio_median']:.2f}, "
                  f"answers equal {run['answers_equal']}/{len(trials)}", flush=True)
            payload["wall_s"] = round(wall(), 1)
            write_results(Path(args.out), "speed", payload, render(payload))
    print(f"wrote {args.out}/speed.json and speed.md")


if __name__ == "__main__":
    main()
