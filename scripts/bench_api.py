"""The Python API's cost against the command line, and the batch job's throughput.

1. Overhead: one batch of prompts, the same job through `flexgen-sparpr run` (a fresh process,
   --prompt-ids-file, its --output-json timings) and through `LLM.generate` in this process
   (`last_stats`), interleaved --repeats times. The CLI runs through the API, so the engine's
   seconds should match; the API's call wall time beside them shows what batching, sorting and
   detokenising add.
2. Throughput: --prompts SmolLM2 prompts of mixed length (slices of Alice in Wonderland,
   tests/data/alice29.txt, seeded) as one `flexgen-sparpr batch` job, against the same prompts run
   one by one through `flexgen-sparpr run` (--serial of them, extrapolated to all when fewer):
   wall seconds from process start to the last output, and how many outputs agree token for token.

Writes <out>/api_overhead.{json,md} with the config, the engine commit and the machine's load.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.api_cost import mixed_prompts, overhead, throughput  # noqa: E402
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, md_table, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or folder (default: smollm2-135m)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts of the batch job (default: 64)")
    ap.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens (default: 16)")
    ap.add_argument("--max-len", type=int, default=512, help="longest prompt, tokens (default: 512)")
    ap.add_argument("--gen-len", type=int, default=16, help="tokens generated per prompt, no stop (default: 16)")
    ap.add_argument("--batch", type=int, default=8, help="the batch job's --gpu-batch-size (default: 8)")
    ap.add_argument("--serial", type=int, default=None, help="prompts run one by one through the CLI "
                    "(default: all; fewer are extrapolated to all, and the result says so)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the overhead job (default: 3)")
    ap.add_argument("--seed", type=int, default=0, help="picks the prompts")
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-bench-api"))
    ap.add_argument("--out", default=str(REPO / "results" / "api"), help="output folder")
    args = ap.parse_args(argv)
    args.serial = args.prompts if args.serial is None else args.serial
    if min(args.prompts, args.batch, args.repeats, args.serial, args.gen_len) < 1 or args.serial > args.prompts \
            or not 1 <= args.min_len <= args.max_len:
        die("--prompts, --batch, --repeats, --gen-len must be >= 1, --serial in [1, --prompts], "
            "1 <= --min-len <= --max-len")
    from flexgen_sparpr.config.prompts import load_tokenizer
    from flexgen_sparpr.weights.resolve import resolve_source
    tok = load_tokenizer(resolve_source(args.model, None, None, 0).tokenizer_dir)
    prompts = mixed_prompts(tok, args.prompts, args.min_len, args.max_len, args.seed)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench-api-") as d:
        over = overhead(args, prompts[:args.batch], Path(d), env)
        print(f"overhead: {over['median']}", flush=True)
        thr = throughput(args, prompts, Path(d), env)
        print(f"throughput: {thr}", flush=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["engine_commit"] = engine_commit()
    payload = {"config": config, "machine": machine_info(), "overhead": over, "throughput": thr}
    m = over["median"]
    md = (f"# The Python API against the CLI, and the batch job\n\n{args.model}, engine {config['engine_commit']}, "
          f"load average {payload['machine']['load_average']} (`scripts/bench_api.py`).\n\n"
          f"## Overhead: one batch of {args.batch} prompts, {args.gen_len} new tokens, median of {args.repeats}\n\n"
          + md_table(["", "engine s (prefill + decode)", "whole s"],
                     [["CLI `run` (fresh process)", f"{m['cli_engine_s']:.2f}", f"{m['cli_process_s']:.2f}"],
                      ["`LLM.generate` (loaded)", f"{m['api_engine_s']:.2f}", f"{m['api_call_s']:.2f}"]])
          + f"\nSame tokens: {over['same_tokens']}.\n\n"
          f"## Throughput: {args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.gen_len} new each\n\n"
          + md_table(["", "wall s", "tokens/s"],
                     [[f"`batch` job, --gpu-batch-size {args.batch}", f"{thr['batch_job_s']:.1f}",
                       f"{thr['batch_tokens_per_s']:.1f}"],
                      ["one `run` per prompt" + (f" ({thr['serial_measured']} run, extrapolated)"
                                                 if thr["serial_extrapolated"] else ""),
                       f"{thr['serial_all_s']:.1f}", f"{thr['serial_tokens_per_s']:.1f}"]])
          + f"\nSpeed-up {thr['speedup']:.1f}x; same tokens as the batch job: {thr['same_tokens']} "
          "(batched rows are left-padded: float sums may differ in the last bits).\n")
    for p in write_results(Path(args.out), "api_overhead", payload, md):
        print(p)
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
