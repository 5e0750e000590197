"""Decode throughput: this engine's dense decode vs HF transformers' `generate`, same model,
same prompts, same dtype and thread count, in one run.

For every (context, batch) cell both run greedy generation of --gen-len tokens from the same
prompts (slices of a text file, tokenized with the model's tokenizer, truncated to the context
length; batch rows start at different offsets of the text so they differ but share a length).

  decode tok/s = batch * (gen_len - 1) / decode seconds   (prefill and its first token excluded)

Engine: prefill = step_times[0]; decode = sum(step_times[1:]).
HF: one ordinary `model.generate` call; a pass-through LogitsProcessor timestamps every step
(it runs right after each forward). prefill = first timestamp - call start; decode = last
timestamp - first timestamp, which spans exactly gen_len - 1 one-token forwards plus their
greedy selection and bookkeeping, the same work the engine's steps 1.. do.

Writes <out>/decode_vs_hf.json (every cell + config + machine info) and <out>/decode_vs_hf.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never contact a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.decode_vs_hf import build_payload, load_tokens, render_md, run_grid  # noqa: E402
from flexgen_sparpr.bench.results import write_results  # noqa: E402
from flexgen_sparpr.bench.decode_vs_hf import load_models  # noqa: E402

STEM = "decode_vs_hf"
DEFAULT_TEXT = REPO / "tests" / "data" / "alice29.txt"


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Timing method:\n" + __doc__.split("\n\n", 2)[2])
    ap.add_argument("--model", default="smollm2-135m",
                    help="a known name or a local HF checkpoint dir (default: smollm2-135m, the prepared model)")
    ap.add_argument("--text", default=str(DEFAULT_TEXT),
                    help="prompt text file (default: tests/data/alice29.txt in the repo; "
                         "filler words are used, with a note, if the default is missing)")
    ap.add_argument("--lengths", default="2048,4096,8192",
                    help="comma-separated context lengths in tokens (default: 2048,4096,8192)")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default: 1,4)")
    ap.add_argument("--gen-len", type=int, default=32, help="new tokens per sequence, >= 2 (default: 32)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per cell, engine and HF alternating; the run with the shortest decode "
                         "is reported (default: 1)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for both (default: torch's default here)")
    ap.add_argument("--device", default="cpu", help="where both run: cpu or cuda (default: cpu)")
    ap.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                    help="both models' dtype; auto: float32 on the CPU, float16 on CUDA (default: auto)")
    ap.add_argument("--out", default=str(REPO / "results"), help="output directory (default: results/)")
    args = ap.parse_args(argv)
    for name in ("lengths", "batches"):
        try:
            setattr(args, name, int_list(getattr(args, name)))
        except ValueError:
            die(f"--{name} must be a comma-separated list of positive integers (got {getattr(args, name)!r})")
    if args.gen_len < 2:
        die(f"--gen-len must be >= 2 (decode excludes the first token; got {args.gen_len})")
    if args.repeats < 1:
        die(f"--repeats must be >= 1 (got {args.repeats})")
    if args.threads is not None and args.threads < 1:
        die(f"--threads must be >= 1 (got {args.threads})")
    from flexgen_sparpr.bench.offload import resolve_device
    from flexgen_sparpr.errors import ConfigError
    try:
        device, dtype = resolve_device(args.device, args.dtype)
        args.device, args.dtype = str(device), str(dtype).removeprefix("torch.")
    except ConfigError as e:
        die(str(e))
    if not Path(args.text).is_file() and Path(args.text) != DEFAULT_TEXT:
        die(f"--text file not found: {args.text}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_before = [round(v, 2) for v in os.getloadavg()]
    src, tok, model = load_models(args)
    tokens, text_desc = load_tokens(tok, args.text, max(args.lengths) * max(args.batches))
    if max(args.lengths) + args.gen_len > src.spec.max_pos:
        print(f"note: context + gen-len exceeds the model's {src.spec.max_pos} trained positions "
              f"(RoPE runs past it in both)", file=sys.stderr)
    t0 = time.perf_counter()
    cells = run_grid(args, src, model, tokens)
    payload = build_payload(args, src, model, text_desc, threads, load_before, cells,
                            time.perf_counter() - t0)
    for p in write_results(Path(args.out), STEM, payload, render_md(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))  # one error line for any failure, signals included (utils/guard.py)
