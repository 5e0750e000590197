"""The SparPR paper's own comparison: upstream FlexGen (flexgen==0.1.8) with and without
`apply_sparpr` (flexgen_sparpr/upstream/sparpr_hook.py: its decode cache loading moves only the
selected blocks), same executor, same placement, interleaved per context in fresh processes.

On CUDA upstream runs as shipped (the device capped with --gpu-mem); on the CPU with the CPU
patches, its disk tier's page cache dropped after each disk synchronisation (it has no
O_DIRECT) and, with --read-mbps, its disk reads capped by the kernel (bench/throttle.py). keep
ratio 1.0 would be upstream itself, bit for bit (tests/upstream/test_sparpr_hook.py).
Writes <out>/<stem>.json and .md: prefill, decode and end-to-end seconds, the cut, the KV bytes
its decode loads moved (the hook's count; upstream's whole-cache loads from the placement) and,
when throttled, the kernel's count of bytes read from the disk.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.upstream_sparpr import one, render_md  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, machine_info, timer, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="opt-125m", help="an OPT size (default: opt-125m)")
    ap.add_argument("--contexts", default="1024,2048,4096", help="prompt lengths (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences (default: 4)")
    ap.add_argument("--gen-len", type=int, default=32, help="new tokens, >= 2 (default: 32)")
    ap.add_argument("--keep-ratio", type=float, default=0.25, help="SparPR's keep ceiling (default: 0.25)")
    ap.add_argument("--min-keep", type=float, default=0.1, help="SparPR's floor (default: 0.1)")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per block (default: 64)")
    ap.add_argument("--percent", default="100,0,0,0,100,0",
                    help="upstream's --percent: weights GPU,CPU, cache GPU,CPU, activations GPU,CPU (default: KV on disk)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: auto")
    ap.add_argument("--gpu-mem", type=float, default=None, help="cap the CUDA device at this many GiB")
    ap.add_argument("--read-mbps", type=float, default=None, help="cap disk reads at this many MB/s (root, cgroup v1)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per upstream run (default: 1200)")
    ap.add_argument("--offload-dir", default="/tmp/offload-upstream-sparpr", help="upstream's disk tier; removed")
    ap.add_argument("--out", default=str(REPO / "results"), help="output folder (default: results)")
    ap.add_argument("--stem", default="upstream_sparpr", help="output file stem (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        args.contexts = int_list(args.contexts)
        args.percent = tuple(int(float(x)) for x in args.percent.split(","))
    except ValueError:
        die("--contexts needs positive integers and --percent six numbers")
    if len(args.percent) != 6 or args.gen_len < 2 or args.batch < 1 or not 0 < args.keep_ratio <= 1:
        die("--percent needs six numbers, --gen-len >= 2, --batch >= 1, --keep-ratio in (0, 1]")
    if args.read_mbps is not None and not args.read_mbps > 0:
        die(f"--read-mbps must be > 0 (got {args.read_mbps})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from flexgen_sparpr.bench.throttle import open_throttle
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    offload = Path(args.offload_dir).expanduser()
    offload.mkdir(parents=True, exist_ok=True)
    th, note = open_throttle(args.read_mbps, offload)
    rows = []
    try:
        if th is not None:
            th.attach(os.getpid())  # the children follow
        with timer() as wall:
            for ctx in args.contexts:
                row = {"context": ctx}
                for kind, sp in (("upstream", False), ("upstream+sparpr", True)):
                    before = th.read_bytes() if th else None
                    r = one(args, ctx, sp, device)
                    r["kernel_disk_read_bytes"] = th.read_bytes() - before if th else None
                    row[kind] = r
                    print(f"ctx {ctx} {kind}: " + (f"e2e {r['total_s']:.1f} s, decode {r['decode_s']:.1f} s"
                                                   if r.get("ok") else f"error: {r.get('error')}"), flush=True)
                u, s = row["upstream"], row["upstream+sparpr"]
                if u.get("ok") and s.get("ok"):
                    row["cut"] = 1 - s["total_s"] / u["total_s"]
                    row["decode_cut"] = 1 - s["decode_s"] / u["decode_s"]
                    row["bytes_ratio"] = s["kv_read_bytes"] / max(1, u["kv_read_bytes"])
                rows.append(row)
    finally:
        if th is not None:
            th.close()
        shutil.rmtree(offload, ignore_errors=True)
    dev = torch.cuda.get_device_name(0) if device == "cuda" else machine_info()["cpu_model"]
    # upstream's executor builds no LLM, so no "resolved": its placement and the hook's knobs are the
    # flags in the config; the commit names this checkout's hook (upstream/sparpr_hook.py)
    payload = {"config": {**vars(args), "engine_commit": engine_commit()}, "machine": machine_info(),
               "device": device, "device_name": dev,
               "throttle": th.describe() if th else None, "throttle_note": note, "rows": rows, "wall_s": wall()}
    for p in write_results(Path(args.out), args.stem, payload, render_md(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    from flexgen_sparpr.utils.guard import guarded
    sys.exit(guarded(main))
