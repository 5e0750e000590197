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

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, md_table, write_results  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def mixed_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n slices of the book's token ids, lengths uniform in [lo, hi], starts at random."""
    ids = tokenizer.encode((REPO / "tests" / "data" / "alice29.txt").read_text(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def cli(args, sub: list[str], env: dict) -> float:
    """Wall seconds of one console-script process; dies with its error line if it fails."""
    cmd = [sys.executable, "-m", "flexgen_sparpr", *sub, "--model", args.model, "--gen-len", str(args.gen_len),
           "--offload-dir", args.offload_dir, "--quiet"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        die(f"{' '.join(sub[:1])} failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return time.perf_counter() - t0


def overhead(args, prompts: list[list[int]], tmp: Path, env: dict) -> dict:
    from flexgen_sparpr import LLM
    ids, out = tmp / "one_batch.json", tmp / "run.json"
    ids.write_text(json.dumps(prompts))
    sub = ["run", "--prompt-ids-file", str(ids), "--gpu-batch-size", str(len(prompts)), "--warmup", "false",
           "--no-log", "--verbose", "0", "--output-json", str(out)]
    rows = []
    with LLM(args.model, gpu_batch_size=len(prompts), offload_dir=args.offload_dir, quiet=True) as llm:
        for _ in range(args.repeats):  # interleaved: a change in the machine's load hits both alike
            wall = cli(args, sub, env)
            t = json.loads(out.read_text())["timings"]
            cli_ids = json.loads(out.read_text())["output_ids"]
            outs = llm.generate(prompts, args.gen_len, stop=None)
            s = llm.last_stats
            rows.append({"cli_process_s": wall, "cli_engine_s": t["prefill_s"] + t["decode_s"],
                         "api_engine_s": s.prefill_s + s.decode_s, "api_call_s": s.wall_s,
                         "same_tokens": [o.token_ids for o in outs] == cli_ids})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "same_tokens"}
    return {"runs": rows, "median": med, "same_tokens": all(r["same_tokens"] for r in rows)}


def throughput(args, prompts: list[list[int]], tmp: Path, env: dict) -> dict:
    inp, outp = tmp / "prompts.jsonl", tmp / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    batch_s = cli(args, ["batch", "--input", str(inp), "--output", str(outp), "--gpu-batch-size", str(args.batch),
                         "--verbose", "0"], env)
    batched = {r["id"]: r["token_ids"] for r in map(json.loads, outp.read_text().splitlines())}
    serial_s, same = [], 0
    one, out = tmp / "one.json", tmp / "one_out.json"
    for i, p in enumerate(prompts[:args.serial]):
        one.write_text(json.dumps([p]))
        serial_s.append(cli(args, ["run", "--prompt-ids-file", str(one), "--gpu-batch-size", "1", "--warmup", "false",
                                   "--no-log", "--verbose", "0", "--output-json", str(out)], env))
        same += json.loads(out.read_text())["output_ids"][0] == batched[f"p{i}"]
    n, k = len(prompts), len(serial_s)
    serial_all = sum(serial_s) * n / k
    return {"batch_job_s": batch_s, "batch_tokens_per_s": n * args.gen_len / batch_s,
            "serial_measured": k, "serial_measured_s": sum(serial_s), "serial_all_s": serial_all,
            "serial_extrapolated": k < n, "serial_tokens_per_s": n * args.gen_len / serial_all,
            "speedup": serial_all / batch_s, "same_tokens": f"{same} of {k}"}


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
