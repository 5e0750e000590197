"""SparPR in an I/O-bound regime measured on this machine: the disk tier's reads capped by the
kernel (cgroup v1 blkio, bench/throttle.py; nothing sleeps), then this engine's dense vs SparPR,
upstream FlexGen vs upstream + apply_sparpr, and the time model checked against every run.

The cap: by default the read bandwidth that gives this CPU the laptop's FLOP-per-byte balance
(bench/balance.py: this machine's profiled FLOP/s x the laptop's effective KV link / its FLOP/s,
x the KV bytes here over there: both float16 now; hardware files --here-hardware,
--there-hardware and the laptop's cache split --there-cache-percent); --read-mbps gives caps
(a sweep) instead. Not root or no blkio: runs unthrottled, with a note in the results.

Per (cap, gen_len, context), interleaved: dense and SparPR (fresh engines, OPT dummy weights,
batch --batch, KV all on the disk tier with O_DIRECT), upstream FlexGen (flexgen==0.1.8, CPU
patches) with its KV on its disk tier and its page cache dropped after each of its disk
synchronisations (upstream/patches.py uncached_disk_tier: it has no O_DIRECT), and upstream +
apply_sparpr at the same keep ratio. Counted per run: blocks selected / copied / recomputed,
fallbacks, spans, bytes and requests per link, and the kernel's own count of bytes read from the
disk (blkio.throttle.io_service_bytes).

Time model (runtime/timemodel.py): calibrated once on a separate dense + SparPR pair at
--calib-context (other prompts, same cap), then it predicts every engine run from its trace and
the hardware file with the disk read bandwidth set to the cap; the error is predicted / measured
- 1. Upstream's runs have no trace: not modelled.

SparPR step / IO = median decode step / (disk bytes per step / the cap). Writes
<out>/<stem>.json and <out>/<stem>.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import add_opt_bench_args, die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402
from flexgen_sparpr.bench.throttled_report import render_md, summarize  # noqa: E402
from flexgen_sparpr.bench.throttled_runs import HERE_HW, THERE_HW, cell, engine_run, time_model, upstream_run  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    add_opt_bench_args(ap, gen_len=32)
    ap.add_argument("--gen-lens", default=None, help="several gen_lens, comma-separated (overrides --gen-len)")
    ap.add_argument("--read-mbps", default=None, help="read caps in MB/s, comma-separated (default: the balanced cap)")
    ap.add_argument("--here-hardware", default=str(HERE_HW), help="this machine's hardware file (default: %(default)s)")
    ap.add_argument("--there-hardware", default=str(THERE_HW), help="the machine to balance like (default: %(default)s)")
    ap.add_argument("--there-cache-percent", default="0,95,5",
                    help="its KV cache's compute,CPU,disk percent (default: the laptop policy's 0,95,5)")
    ap.add_argument("--calib-context", type=int, default=512, help="context of the calibration pair (default: 512)")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream FlexGen (with and without SparPR)")
    ap.add_argument("--upstream-timeout", type=int, default=1800, help="seconds per upstream run (default: 1800)")
    ap.add_argument("--offload-dir", default="/tmp/offload-throttled",
                    help="disk tier folder, on the disk to throttle; removed at the end (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and prompts (default: 0)")
    ap.add_argument("--out", default=str(REPO / "results/sparpr/throttled"), help="output folder (default: %(default)s)")
    ap.add_argument("--stem", default="throttled", help="output file stem (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        args.contexts = int_list(args.contexts)
        args.gen_lens = int_list(args.gen_lens) if args.gen_lens else [args.gen_len]
        args.caps = [float(x) for x in args.read_mbps.split(",")] if args.read_mbps else None
        args.there_cache_percent = tuple(float(x) for x in args.there_cache_percent.split(","))
    except ValueError:
        die("--contexts/--gen-lens need positive integers, --read-mbps and --there-cache-percent numbers")
    if args.caps is not None and not all(c > 0 for c in args.caps):
        die(f"--read-mbps must be > 0 (got {args.read_mbps})")
    if len(args.there_cache_percent) != 3 or abs(sum(args.there_cache_percent) - 100) > 1e-6:
        die("--there-cache-percent must be three percents summing to 100")
    if min(args.gen_lens) < 2 or args.batch < 1 or args.calib_context < args.block_size:
        die("--gen-len(s) must be >= 2, --batch >= 1, --calib-context >= --block-size")
    if not 0 < args.keep_ratio <= 1 or not 0 < args.min_keep <= 1 or not 0 < args.gamma <= 1:
        die("--keep-ratio, --min-keep and --gamma must be in (0, 1]")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.bench.balance import balanced_read
    from flexgen_sparpr.bench.throttle import open_throttle
    from flexgen_sparpr.bench.latency_model import hardware_file
    from flexgen_sparpr.bench.offload import opt_source
    from flexgen_sparpr.errors import ConfigError
    from flexgen_sparpr.weights.resolve import ModelNotFound

    try:
        here, there = hardware_file(args.here_hardware), hardware_file(args.there_hardware)
        balance = balanced_read(here, there, args.there_cache_percent)
        src = opt_source(args.model, max(args.contexts) + max(args.gen_lens), args.seed)
    except (ConfigError, ModelNotFound, ValueError) as exc:
        die(str(exc))
    caps = args.caps or [round(balance.read_mbps, 1)]
    offload = Path(args.offload_dir).expanduser()
    offload.mkdir(parents=True, exist_ok=True)
    args.offload_dir = str(offload)
    os.environ["FLEXGEN_SPARPR_CACHE"] = str(offload / "probe-cache")  # SparPR probes the disk under the cap
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "machine": machine_info(),
               "balance": {**balance.to_dict(), "here_hardware": args.here_hardware,
                           "there_hardware": args.there_hardware}, "runs": []}
    try:
        with timer() as wall:
            for mbps in caps:
                th, note = open_throttle(mbps, offload)
                try:
                    if th is not None:
                        th.attach(os.getpid())
                    cap_Bps = mbps * 1e6 if th is not None else None
                    count = (lambda: th.read_bytes()) if th is not None else (lambda: None)
                    hw = dataclasses.replace(here, disk_read_bw=cap_Bps or here.disk_read_bw)
                    shutil.rmtree(offload / "probe-cache", ignore_errors=True)
                    calib = [engine_run(src, args, args.calib_context, min(args.gen_lens), p, args.seed + 1)["trace"]
                             for p in ("dense", "sparpr")]
                    cal, model = time_model(calib, hw, f"dense + SparPR at {args.calib_context}, "
                                            f"seed {args.seed + 1}, cap {mbps:g} MB/s")
                    for gen in args.gen_lens:
                        for ctx in args.contexts:
                            row = {"read_mbps": mbps, "throttled": th is not None, "note": note, "gen_len": gen,
                                   "context": ctx, "calibration": cal.to_dict(), "cells": {}}
                            kinds = ["dense", "sparpr"] + ([] if args.no_upstream else ["upstream", "upstream+sparpr"])
                            for kind in kinds:
                                before = count()
                                if kind in ("dense", "sparpr"):
                                    r = engine_run(src, args, ctx, gen, kind, args.seed)
                                else:
                                    r = upstream_run(args, ctx, gen, kind == "upstream+sparpr")
                                after = count()
                                c = cell(kind, r, None if before is None else after - before, cap_Bps,
                                         model if kind in ("dense", "sparpr") else None)
                                row["cells"][kind] = c
                                print(f"{mbps:g} MB/s gen {gen} ctx {ctx} {kind}: " + (
                                    f"e2e {c['e2e_s']:.1f} s, disk {c['disk_read_bytes'] / 1e6:.0f} MB"
                                    + (f", model {100 * c['model_error']:+.0f} %" if "model_error" in c else "")
                                    if c["ok"] else f"error: {c['error']}"), flush=True)
                            payload["runs"].append(row)
                finally:
                    if th is not None:
                        th.close()
        payload["wall_s"] = wall()
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    payload["summary"] = summarize(payload, args.keep_ratio)
    for p in write_results(Path(args.out), args.stem, payload, render_md(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
