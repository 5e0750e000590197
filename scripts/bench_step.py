"""The decode step, dense vs SparPR, at the engine's defaults: where its time goes, KV resident or
on disk (O_DIRECT), at 2k / 4k / 8000 tokens, batch 1 and 4 (SmolLM2-135M, `LLM.compare`: one
prefill, then each policy decodes the same fixed number of steps from it).

Per cell: the median decode step of each policy and its parts (select, read, rebuild, io_wait,
compute), the KV bytes read from disk per step, SparPR's effective keep, and the two ratios the
decode-step targets name:
  resident:  SparPR step / dense step                      (target <= 1.10 at batch 1, 1.05 at 4)
  disk:      dense step / max(resident dense step, disk bytes / disk bandwidth)   (target <= 1.3)
The disk bandwidth is measured here, on the offload folder, with O_DIRECT 4 MiB reads (what
`profile` records as disk_read_GBps).

Writes <out>/step.json (every cell, the configuration, engine commit and machine) and step.md.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import engine_commit, machine_info, md_table, write_results  # noqa: E402

from flexgen_sparpr import LLM  # noqa: E402
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key  # noqa: E402
from flexgen_sparpr.utils.guard import guarded  # noqa: E402
from flexgen_sparpr.storage.disk_store import disk_bandwidth  # noqa: E402
from flexgen_sparpr.utils.args import OneLineParser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLACEMENTS = {"resident": [100, 0, 100, 0, 100, 0], "disk": [100, 0, 0, 0, 100, 0]}
PARTS = ("select", "read", "rebuild", "io_wait", "compute")


def run_cell(tokens: int, batch: int, placement: str, keeps: list[float], steps: int, offload: str, seed: int) -> dict:
    with LLM("smollm2-135m", gpu_batch_size=batch, percent=PLACEMENTS[placement], direct_io=True,
             offload_dir=offload, quiet=True) as llm:
        rng = random.Random(seed)
        book = NeedlePrompts(llm.tokenizer, ROOT / "tests" / "data" / "alice29.txt")
        prompts = [book.build(tokens, (i + 1) / (batch + 1), random_key(rng, 5), rng).ids for i in range(batch)]
        runs = llm.compare(prompts, {f"sparpr@{k:g}": {"kv_policy": "sparpr", "keep_ratio": k} for k in keeps},
                           max_new_tokens=steps + 1, stop=None)
        kv_dtype = str(llm.engine.cfg.torch_kv_dtype(llm.engine.dtype)).removeprefix("torch.")
    cell = {"tokens": tokens, "batch": batch, "placement": placement, "kv_dtype": kv_dtype,
            "prefill_s": runs["dense"][1].prefill_s, "policies": {}}
    for label, (_, s) in runs.items():
        decode = s.step_times[0][1:]
        row = {"step_s": statistics.median(decode), "steps": len(decode),
               "disk_bytes_per_step": s.bytes_moved.get("disk->cpu", 0) / len(decode),
               "parts_s": s.decode_step_parts}
        if label != "dense":
            row["effective_keep"] = s.kv_policy_stats["totals"]["effective_keep"]
        cell["policies"][label] = row
    return cell


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000],
                    help="prompt tokens (8000: room for the decode steps in an 8192-position model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.1], help="SparPR keep ratios")
    ap.add_argument("--steps", type=int, default=8, help="decode steps each policy runs (median taken)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-bench-step"))
    ap.add_argument("--out", default=str(ROOT / "results" / "step"))
    args = ap.parse_args()
    Path(args.offload_dir).mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False):
        bw = disk_bandwidth(Path(args.offload_dir), nbytes=256 << 20, direct=True, chunk_bytes=4 << 20)
    read_Bps = bw["read_GBps"] * 1e9
    print(f"disk: {bw['read_GBps']:.2f} GB/s O_DIRECT read ({bw['mode']})", flush=True)
    cells = []
    for tokens in args.lengths:
        for batch in args.batches:
            for placement in args.placements:
                cell = run_cell(tokens, batch, placement, args.keeps, args.steps, args.offload_dir, args.seed)
                cells.append(cell)
                print(f"{tokens} x{batch} {placement}: " + ", ".join(
                    f"{k} {v['step_s']:.3f}s" for k, v in cell["policies"].items()), flush=True)
    for c in cells:  # the ratios the targets name
        res = next((r for r in cells if r["placement"] == "resident" and r["tokens"] == c["tokens"]
                    and r["batch"] == c["batch"]), None)
        dense = c["policies"]["dense"]
        for label, p in c["policies"].items():
            p["vs_dense"] = p["step_s"] / dense["step_s"]
        if c["placement"] == "disk" and res is not None:
            floor = max(res["policies"]["dense"]["step_s"], dense["disk_bytes_per_step"] / read_Bps)
            c["dense_vs_floor"] = dense["step_s"] / floor
    payload = {"config": {**vars(args), "model": "smollm2-135m", "defaults": "engine defaults (block 16, "
                          "--kv-dtype auto) but the placement; disk: O_DIRECT", "disk_read_Bps": read_Bps,
                          "engine_commit": engine_commit()},
               "machine": machine_info(), "cells": cells}
    write_results(Path(args.out), "step", payload, render(payload))
    print(f"wrote {args.out}/step.json and step.md")
    return 0


def render(payload: dict) -> str:
    cfg, m = payload["config"], payload["machine"]
    rows = []
    for c in payload["cells"]:
        for label, p in c["policies"].items():
            parts = " / ".join(f"{p['parts_s'].get(k, 0) * 1e3:.0f}" for k in PARTS)
            rows.append([c["tokens"], c["batch"], c["placement"], label, f"{p['step_s']:.3f}", f"{p['vs_dense']:.2f}x",
                         f"{p['disk_bytes_per_step'] / 2 ** 20:.1f}", f"{p.get('effective_keep', 1):.2f}", parts,
                         f"{c['dense_vs_floor']:.2f}x" if label == "dense" and "dense_vs_floor" in c else ""])
    return (f"# Decode step, dense vs SparPR (SmolLM2-135M, engine {cfg['engine_commit']})\n\n"
            f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']} ({m['torch_threads']} threads); "
            f"disk {cfg['disk_read_Bps'] / 1e9:.2f} GB/s O_DIRECT read. {cfg['defaults']}; median of "
            f"{cfg['steps']} decode steps. Produced by `scripts/bench_step.py`.\n\n"
            + md_table(["tokens", "batch", "KV", "policy", "step s", "vs dense", "disk MiB/step", "keep",
                        "select / read / rebuild / io_wait / compute ms", "dense vs floor"], rows))


if __name__ == "__main__":
    sys.exit(guarded(main))
