"""Greedy tokens of a real model on the GPU against the CPU's: the same prompts through this
engine on the CPU (float32), on --device in float32 with TF32 off (must be equal), and on
--device in float16 (reported: where it first departs, and the CPU's top-1/top-2 logit margin
there; a float16 departure where that margin is below float16's resolution is a near-tie, not
a bug). Exit 1 when the float32 tokens differ.

Writes <out>/tokens.json (config, tokens, margins, machine).

    python scripts/device_tokens.py --model DIR --device cuda --out results/gpu
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.device_tokens import FP16_TIE, first_departure, run  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, write_results  # noqa: E402

TEXT = REPO / "tests" / "data" / "alice29.txt"


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a prepared model dir (flexgen-sparpr prepare) or a known name")
    ap.add_argument("--device", default="cuda", help="the device compared with the CPU (default: cuda)")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens (default: 512,2048)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per prompt length (default: 2)")
    ap.add_argument("--gen-len", type=int, default=16, help="new tokens (default: 16)")
    ap.add_argument("--out", default=str(REPO / "results" / "gpu"), help="output folder (default: results/gpu)")
    args = ap.parse_args(argv)
    try:
        lengths = int_list(args.lengths)
    except ValueError:
        die(f"--lengths must be a comma-separated list of positive integers (got {args.lengths!r})")
    if args.batch < 1 or args.gen_len < 1:
        die("--batch and --gen-len must be >= 1")
    import torch
    from transformers import AutoTokenizer
    from flexgen_sparpr.weights.resolve import ModelNotFound, resolve_source
    try:
        src = resolve_source(args.model, "")
    except (ModelNotFound, ValueError) as e:
        die(str(e))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ids = AutoTokenizer.from_pretrained(src.tokenizer_dir)(TEXT.read_text())["input_ids"]
    cells, ok = [], True
    for n in lengths:
        # rows start at different places of the text; the last row is shorter (left padding)
        prompts = [ids[b * 997: b * 997 + n - (7 if b == args.batch - 1 and b else 0)] for b in range(args.batch)]
        for placement in ({}, {"cache_gpu_percent": 0, "cache_cpu_percent": 100}):
            # float32 against float32: blocks on the CPU tier stored exact (--kv-dtype float32), as the
            # CPU run keeps them (there the CPU tier is the compute tier); the default float16
            # storage would round them on the GPU run alone
            cpu, cpu_logits, cpu_conf = run(src, prompts, args.gen_len, "cpu", "float32", placement, "float32")
            f32, f32_logits, f32_conf = run(src, prompts, args.gen_len, args.device, "float32", placement, "float32")
            f16, _, f16_conf = run(src, prompts, args.gen_len, args.device, "float16", placement)
            top2 = cpu_logits.topk(2, dim=-1).values  # top2: [B, n, 2]
            margin = (top2[..., 0] - top2[..., 1])  # margin: [B, n] the CPU's top-1 lead
            dep = first_departure(cpu, f16)
            dep32 = first_departure(cpu, f32)
            cell = {"prompt_len": n, "placement": placement or "all on compute", "float32_kv_dtype": "float32",
                    "float32_equal": cpu == f32, "float32_max_logit_diff": float((f32_logits - cpu_logits).abs().max()),
                    "float32_first_departure": dep32,
                    "cpu_margin_at_float32_departure": None if dep32 is None else float(margin[dep32]),
                    "float16_first_departure": dep,
                    "cpu_margin_at_departure": None if dep is None else float(margin[dep]),
                    "cpu_min_margin": float(margin.min()), "cpu_tokens": cpu, "float32_tokens": f32,
                    "float16_tokens": f16,  # resolved: keyed as the tokens are (each names its device)
                    "resolved": {"cpu": cpu_conf, "float32": f32_conf, "float16": f16_conf}}
            cell["float16_ok"] = dep is None or cell["cpu_margin_at_departure"] < FP16_TIE
            ok &= cell["float32_equal"]
            cells.append(cell)
            print(f"{n:>5} tokens, {cell['placement']}: float32 equal {cell['float32_equal']} (max logit diff "
                  f"{cell['float32_max_logit_diff']:.2e}, departs at {dep32}); float16 departs at {dep} "
                  f"(CPU margin there {cell['cpu_margin_at_departure']})", flush=True)
    payload = {"config": {"command": " ".join(["python"] + sys.argv), "engine_commit": engine_commit(),
                          "model": str(src.path), "device": args.device,
                          "lengths": lengths, "batch": args.batch, "gen_len": args.gen_len, "fp16_tie": FP16_TIE,
                          "tf32": False},
               "machine": machine_info(), "cells": cells, "float32_all_equal": ok}
    for p in write_results(Path(args.out), "tokens", payload):
        print(f"wrote {p}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
