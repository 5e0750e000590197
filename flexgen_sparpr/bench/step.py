"""The decode step benchmark (scripts/bench_step.py): dense vs SparPR at the engine's defaults,
where each step's time goes, the KV resident, all on disk or half on disk (O_DIRECT),
SmolLM2-135M, `LLM.compare` (one prefill, then each policy decodes the same fixed number of steps
from it).

Per cell: the median decode step of each policy and its parts (select, read, rebuild, io_wait,
compute), the KV bytes read from disk per step, SparPR's effective keep, and the two ratios the
decode-step targets name:
  resident:  SparPR step / dense step                      (target <= 1.10 at batch 1, 1.05 at 4)
  disk, half-disk: dense step / max(resident dense step, disk bytes / disk bandwidth)   (target <= 1.3)
and, beside it, the same with the floor's resident step measured while another process reads the
disk at full speed ("resident-busy" cells, bench/busy_disk.py): what this machine's compute gives
up while its disk reads, which no engine overlapping reads with compute can avoid.
The disk bandwidth is measured on the offload folder with O_DIRECT 4 MiB reads (what `profile`
records as disk_read_GBps) on the spot: just before and just after each disk cell (a VM's disk
drifts by a third within minutes), the floor taking their mean. Once per grid it is checked
against `dd iflag=direct` reading a file of the same size."""
from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from ..api.measure import disk_bandwidth
from ..api.llm import LLM
from .needle_prompt import NeedlePrompts, random_key
from ..api.resolved import resolved
from .busy_disk import BusyDisk, write_scratch
from .args import OneLineParser
from .results import REPO, md_table, publish
from .sweep import REFERENCE
from .texts import TEXTS

KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "q8", "q4")  # --kv-dtype's values (engine/config.py)
# --percent per placement: all the KV resident, all on disk (make run's), half of it on disk (the target's wording);
# resident-busy: all resident, the disk read at full speed by another process through the cell (BusyDisk)
PLACEMENTS = {"resident": [100, 0, 100, 0, 100, 0], "disk": [100, 0, 0, 0, 100, 0], "half-disk": [100, 0, 50, 0, 100, 0],
              "resident-busy": [100, 0, 100, 0, 100, 0]}
ON_DISK = ("disk", "half-disk")  # the placements whose KV is read from disk (a floor each, a cell per --kv-dtypes)
SAID = {"resident-busy": "resident, disk busy"}  # a placement as its table row names it
PARTS = ("select", "read", "rebuild", "io_wait", "compute")
TEXT = TEXTS["alice29"].path  # the demo's text (tuning split: bench/texts.py)


def disk_read_Bps(folder: Path) -> tuple[float, str]:
    """O_DIRECT sequential read bandwidth of `folder` (bytes/s) and the read mode used."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode(False):
        bw = disk_bandwidth(folder, nbytes=256 << 20, direct=True, chunk_bytes=4 << 20)
    return bw["read_GBps"] * 1e9, bw["mode"]


def dd_read_Bps(folder: Path, nbytes: int = 256 << 20) -> float | None:
    """`dd iflag=direct bs=4M` reading an `nbytes` file of random bytes in `folder` (bytes/s, as dd
    times itself), or None where dd or O_DIRECT is not there; the file is removed."""
    if shutil.which("dd") is None:
        return None
    path = folder / f"dd-{os.getpid()}.bin"
    try:
        write_scratch(path, nbytes)
        r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"], capture_output=True,
                           text=True, env={**os.environ, "LC_ALL": "C"})
        m = re.search(r"^(\d+) bytes.*copied, ([\d.]+) s", r.stderr, re.M)
        return int(m[1]) / float(m[2]) if r.returncode == 0 and m and float(m[2]) > 0 else None
    finally:
        path.unlink(missing_ok=True)


def run_cell(tokens: int, batch: int, placement: str, keeps: list[float], steps: int, offload: str,
             seed: int, kv_dtype: str = "auto") -> dict:
    """One (tokens, batch, placement, --kv-dtype) cell: dense and SparPR at each keep from one
    prefill. kv_dtype: how the disk tier's blocks are stored (q8 / q4: quantized; "auto": the
    engine's default; the compute tier's stay in the compute dtype). resident-busy: the whole cell
    (its prefill too) runs beside a BusyDisk reader, whose rate the cell records."""
    busy = BusyDisk(Path(offload)) if placement == "resident-busy" else contextlib.nullcontext()
    with busy, LLM("smollm2-135m", gpu_batch_size=batch, percent=PLACEMENTS[placement], direct_io=True,
             offload_dir=offload, quiet=True, kv_dtype=kv_dtype) as llm:
        rng = random.Random(seed)
        book = NeedlePrompts(llm.tokenizer, TEXT)
        prompts = [book.build(tokens, (i + 1) / (batch + 1), random_key(rng, 5), rng).ids for i in range(batch)]
        runs = llm.compare(prompts, {f"sparpr@{k:g}": {"kv_policy": "sparpr", "keep_ratio": k} for k in keeps},
                           max_new_tokens=steps + 1, stop=None)
        config = resolved(llm)
        config["compared"] = {label: s.kv_policy_stats.get("config") for label, (_, s) in runs.items() if label != REFERENCE}
    cell = {"tokens": tokens, "batch": batch, "placement": placement, "kv_dtype": kv_dtype, "resolved": config,
            "prefill_s": runs[REFERENCE][1].prefill_s, "policies": {}}
    if placement == "resident-busy":
        cell["busy_read_Bps"] = busy.read_Bps  # None: O_DIRECT refused here, nothing read beside the cell
    for label, (_, s) in runs.items():
        decode = s.step_times[0][1:]
        row = {"step_s": statistics.median(decode), "steps": len(decode), "steps_s": list(decode),
               "disk_bytes_per_step": s.bytes_moved.get("disk->cpu", 0) / len(decode),
               "parts_s": s.decode_step_parts}
        if label != REFERENCE:
            row["effective_keep"] = s.kv_policy_stats["totals"]["effective_keep"]
            row["step_fallback"] = s.kv_policy_stats.get("step_fallback")  # its choice and the steps it timed
        cell["policies"][label] = row
    return cell


def defaults_said(cells: list[dict]) -> str:
    """The configuration the cells ran at, as the engine resolved it."""
    said = [c.get("resolved", c) for c in cells]  # files written before `resolved` kept these three at the top
    blocks = sorted({c["block_size"] for c in said})
    kv = sorted({c["kv_dtype"] for c in said})
    weights = sorted({c.get("weight_format", "raw (before --weight-format)") for c in said})
    return (f"engine defaults (block {', '.join(map(str, blocks))}, KV stored {', '.join(kv)}, weights "
            f"{'; '.join(weights)}) but the placement; "
            "disk: O_DIRECT")


def _dense_step(cells: list[dict], c: dict, placement: str) -> float | None:
    """Dense's step in the cell of `placement` at c's tokens and batch (None: no such cell)."""
    r = next((r for r in cells if r["placement"] == placement and r["tokens"] == c["tokens"]
              and r["batch"] == c["batch"] and r.get("kv_dtype", "auto") == "auto"), None)
    return None if r is None or (placement == "resident-busy" and not r.get("busy_read_Bps")) \
        else r["policies"][REFERENCE]["step_s"]


def add_ratios(cells: list[dict], read_Bps: float) -> None:
    """Each policy's step over dense's, and each disk cell's dense step over its floor, and over
    its floor with the disk busy where a resident-busy cell at its tokens and batch read beside it."""
    for c in cells:
        dense = c["policies"][REFERENCE]
        for p in c["policies"].values():
            p["vs_dense"] = p["step_s"] / dense["step_s"]
        if c["placement"] not in ON_DISK:
            continue
        bw = statistics.mean(c.get("disk_read_Bps_around", [read_Bps]))  # the cell's own (files before it: the grid's)
        for key, placement in (("dense_vs_floor", "resident"), ("dense_vs_busy_floor", "resident-busy")):
            compute = _dense_step(cells, c, placement)
            if compute is not None:
                c[key] = dense["step_s"] / max(compute, dense["disk_bytes_per_step"] / bw)


def render(payload: dict) -> str:
    cfg, m = payload["config"], payload["machine"]
    rows = []
    for c in payload["cells"]:
        for label, p in c["policies"].items():
            parts = " / ".join(f"{p['parts_s'].get(k, 0) * 1e3:.0f}" for k in PARTS)
            kv = c.get("kv_dtype", "auto")
            rows.append([c["tokens"], c["batch"], SAID.get(c["placement"], c["placement"]) + ("" if kv == "auto" else f", {kv}"), label, f"{p['step_s']:.3f}", f"{p['vs_dense']:.2f}x",
                         f"{p['disk_bytes_per_step'] / 2 ** 20:.1f}", _keep_said(p), parts,
                         _floor_said(c) if label == REFERENCE else ""])
    dd = cfg.get("dd_read_Bps", False)
    dd = "" if dd is False else " (dd iflag=direct: " + ("not measured" if dd is None else f"{dd / 1e9:.2f} GB/s") + ")"
    said = "" if cfg.get("per_cell_bandwidth") is None else (
        " before the grid; each disk cell's floor uses the mean of its own, measured just before and after it"
        " (beside its ratio)")
    if any("busy_read_Bps" in c for c in payload["cells"]):
        said += ("; \"disk busy\": the same over max(dense's step in the \"resident, disk busy\" cell, run while "
                 "another process read this disk with O_DIRECT at full speed, bytes / bandwidth)")
    return (f"# Decode step, dense vs SparPR (SmolLM2-135M, engine {cfg['engine_commit']})\n\n"
            f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']} ({m['torch_threads']} threads); "
            f"disk {cfg['disk_read_Bps'] / 1e9:.2f} GB/s O_DIRECT read{said}{dd}. {cfg['defaults']}; median of "
            f"{cfg['steps']} decode steps. Produced by `scripts/bench_step.py`.\n\n"
            + md_table(["tokens", "batch", "KV", "policy", "step s", "vs dense", "disk MiB/step", "keep",
                        "select / read / rebuild / io_wait / compute ms", "dense vs floor"], rows))


def _keep_said(p: dict) -> str:
    """A row's effective keep, and how many of its steps the step fallback ran dense, where any."""
    fallback = p.get("step_fallback") or {}
    dense = fallback.get("dense_steps")
    return f"{p.get('effective_keep', 1):.2f}" + (f", {dense} of {fallback['steps']} steps dense" if dense else "")


def _floor_said(c: dict) -> str:
    """A disk cell's dense step over its floor, the bandwidth around the cell it used, and the
    ratio over the floor with the disk busy; a resident-busy cell's reader rate."""
    if "busy_read_Bps" in c:
        rate = c["busy_read_Bps"]
        return "reader: none (no O_DIRECT)" if not rate else f"reader {rate / 1e9:.2f} GB/s"
    if "dense_vs_floor" not in c:
        return ""
    around = c.get("disk_read_Bps_around")
    said = f"{c['dense_vs_floor']:.2f}x" + ("" if around is None else
                                            f" ({' / '.join(f'{b / 1e9:.2f}' for b in around)} GB/s)")
    return said + (f"; disk busy {c['dense_vs_busy_floor']:.2f}x" if "dense_vs_busy_floor" in c else "")


def parser(doc: str) -> OneLineParser:
    """scripts/bench_step.py's command line."""
    ap = OneLineParser(description=doc)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000],
                    help="prompt tokens (8000: room for the decode steps in an 8192-position model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.25, 0.1], help="SparPR keep ratios")
    ap.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=["auto"],
                    help="--kv-dtype of the disk cells, each its own cell (q8 / q4: quantized blocks; the resident "
                         "cells keep the compute dtype and run once)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps each policy runs (median taken; 24: past "
                    "SparPR's first measured choice of sparse or dense steps, made by step 9 at the latest)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-bench-step"))
    ap.add_argument("--out", default=str(REPO / "results" / "step"))
    return ap


def run_grid(args) -> int:
    """The disk's bandwidth, every (length, batch, placement, KV dtype) cell in turn, then
    <out>/step.json and step.md."""
    read_Bps, mode = disk_read_Bps(Path(args.offload_dir))
    dd = dd_read_Bps(Path(args.offload_dir))
    print(f"disk: {read_Bps / 1e9:.2f} GB/s O_DIRECT read ({mode}); dd iflag=direct: "
          + ("not measured" if dd is None else f"{dd / 1e9:.2f} GB/s"), flush=True)
    cells = []
    for tokens in args.lengths:
        for batch in args.batches:
            for placement in args.placements:
                for kv in (args.kv_dtypes if placement in ON_DISK else ["auto"]):
                    before = disk_read_Bps(Path(args.offload_dir))[0] if placement in ON_DISK else None
                    cell = run_cell(tokens, batch, placement, args.keeps, args.steps, args.offload_dir, args.seed, kv)
                    if before is not None:
                        cell["disk_read_Bps_around"] = [before, disk_read_Bps(Path(args.offload_dir))[0]]
                    cells.append(cell)
                    print(f"{tokens} x{batch} {placement} {kv}: " + ", ".join(
                        f"{k} {v['step_s']:.3f}s" for k, v in cell["policies"].items()), flush=True)
    add_ratios(cells, read_Bps)
    publish(args.out, "step", {**vars(args), "model": "smollm2-135m", "defaults": defaults_said(cells),
                               "disk_read_Bps": read_Bps, "dd_read_Bps": dd, "per_cell_bandwidth": True}, cells, render)
    return 0
