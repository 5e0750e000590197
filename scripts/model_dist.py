"""Modeled pipeline parallelism: OPT-30B and OPT-175B on 1/2/4/8 nodes of each hardware file
(MODELED, not measured: the time model, runtime/timemodel.py over runtime/stages.py).

For each (hardware file, model, node count) `--policy auto`'s search (runtime/stages.py
choose_stages) picks the layer split and each stage's placement (--percent) for the batch of
--gpu-batch-size x --micro-batches sequences, one micro-batch per GPU batch; stage time = its
compute + its own I/O per micro-batch + sending the hidden states on at the file's
interconnect_GBps; a pipeline step = the slowest stage x (micro-batches + stages - 1). One node is
the same search with one stage (placement.py's choice). Writes <out>/modeled.{json,md} with the
config and the engine commit (docs/distributed.md shows the table).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.pipeline_model import markdown, model_row  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, write_results  # noqa: E402

HW = ("configs/hardware/rtx3070ti-laptop-8gb.yaml", "configs/hardware/t4-flexgen.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="opt-30b,opt-175b", help="OPT size names (default: %(default)s)")
    ap.add_argument("--nodes", default="1,2,4,8", help="node counts = stages (default: %(default)s)")
    ap.add_argument("--hardware", default=",".join(HW), help="hardware files, one node each (default: the "
                    "RTX 3070 Ti laptop and FlexGen's T4 VM)")
    ap.add_argument("--prompt-len", type=int, default=512, help="(default: %(default)s)")
    ap.add_argument("--gen-len", type=int, default=32, help="(default: %(default)s)")
    ap.add_argument("--gpu-batch-size", type=int, default=8, help="(default: %(default)s)")
    ap.add_argument("--fallback-gpu-batch-size", type=int, default=1, help="tried where --gpu-batch-size fits "
                    "nowhere (default: %(default)s; 0: none)")
    ap.add_argument("--micro-batches", type=int, default=8, help="GPU batches = micro-batches (default: %(default)s)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--out", default=str(REPO / "results" / "distributed"), help="output folder (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        args.nodes = int_list(args.nodes)
    except ValueError:
        die("--nodes takes positive integers, e.g. 1,2,4,8")
    if min(args.prompt_len, args.gen_len, args.gpu_batch_size, args.micro_batches) < 1:
        die("lengths, --gpu-batch-size and --micro-batches must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.errors import ConfigError
    from flexgen_sparpr.bench.latency_model import hardware_file
    rows = []
    for path in args.hardware.split(","):
        try:
            hw = hardware_file(path)
        except (ConfigError, OSError) as e:
            die(f"--hardware {path}: {e}")
        for name in args.models.split(","):
            for n in args.nodes:
                rows.append(model_row(hw, name, n, args))
    config = {k: getattr(args, k) for k in ("models", "nodes", "hardware", "prompt_len", "gen_len", "gpu_batch_size",
                                            "fallback_gpu_batch_size", "micro_batches", "dtype")}
    config["engine_commit"] = engine_commit()
    config["command"] = " ".join(["python scripts/model_dist.py", *(argv if argv is not None else sys.argv[1:])]).strip()
    payload = {"config": config, "rows": rows}
    for p in write_results(Path(args.out), "modeled", payload, markdown(payload)):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
