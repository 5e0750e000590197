"""`flexgen-sparpr profile`: measure this machine and write a hardware YAML file."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..runtime.hardware import dump_hardware, save_hardware
from ..storage.tiers import resolve_device
from ..utils.args import OneLineParser
from ..config.flags import DEFAULTS


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="flexgen-sparpr profile",
        description="Measure host<->device bandwidth (pinned and pageable, each way; CUDA only), disk "
        "read/write bandwidth with the page cache bypassed, matmul throughput per dtype and free memory "
        "per tier, and write them as a hardware YAML file (use it with `run --hardware FILE` or "
        "`run --policy auto --hardware FILE`).")
    p.add_argument("--out", help="hardware file to write (default: print it to stdout)")
    p.add_argument("--offload-dir", default=DEFAULTS["offload_dir"],
                   help=f"folder whose disk is measured (default {DEFAULTS['offload_dir']})")
    p.add_argument("--device", default="auto", help="compute device: auto (CUDA if present, else CPU), "
                   "cpu, cuda, cuda:N")
    p.add_argument("--quick", action="store_true", help="small transfers: a few seconds, noisier figures")
    return p


def compute_device(name: str) -> torch.device:
    try:
        return resolve_device(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def profile(argv=None) -> None:
    from ..runtime.profile import measure

    args = build_parser().parse_args(argv)
    device = compute_device(args.device)
    if Path(args.offload_dir).expanduser().exists() and not Path(args.offload_dir).expanduser().is_dir():
        raise ConfigError(f"--offload-dir is not a folder: {args.offload_dir}")
    say = lambda msg: print(msg, flush=True) if args.out else None  # noqa: E731 (stdout holds the file otherwise)
    t0 = time.perf_counter()
    hw = measure(device, args.offload_dir, quick=args.quick, say=say)
    if args.out:
        save_hardware(hw, args.out)
        print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s; compute {hw.compute}, "
              f"disk read {hw.disk_read_bw / 1e9:.2f} GB/s, write {hw.disk_write_bw / 1e9:.2f} GB/s)")
    else:
        print(dump_hardware(hw), end="")
