"""scripts/bench_api.py's two measurements: the same batch through `flexgen-sparpr run` (a fresh
process) and `LLM.generate` in this process, and a `flexgen-sparpr batch` job against its prompts
run one by one; each CLI run a child process of the console script's module."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .args import die
from .results import REPO


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
    """The batch through the CLI and through LLM.generate, interleaved --repeats times: each run's
    seconds, their medians, whether the two made the same tokens, and the configuration the LLM
    resolved (the CLI's children resolve the same flags in their own process: not read back)."""
    from .. import LLM
    from ..api.resolved import resolved
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
        config = resolved(llm)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "same_tokens"}
    return {"runs": rows, "median": med, "same_tokens": all(r["same_tokens"] for r in rows), "resolved": config}


def throughput(args, prompts: list[list[int]], tmp: Path, env: dict) -> dict:
    """One batch job against --serial of its prompts run alone (extrapolated to all of them)."""
    # every engine here is a CLI child process: no LLM in this one, so no "resolved" (the flags are in the config)
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
