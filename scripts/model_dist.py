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
from flexgen_sparpr.bench.results import engine_commit, md_table, write_results  # noqa: E402

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


def model_row(hw, name: str, nodes: int, args) -> dict:
    row = _row(hw, name, nodes, args.gpu_batch_size, args)
    if not row["fits"] and args.fallback_gpu_batch_size > 0:
        again = _row(hw, name, nodes, args.fallback_gpu_batch_size, args)
        row = again if again["fits"] else row
    return row


def _row(hw, name: str, nodes: int, gpu_batch_size: int, args) -> dict:
    from flexgen_sparpr.errors import ConfigError
    from flexgen_sparpr.models.spec import opt_spec
    from flexgen_sparpr.runtime.placement import NoPlacementFits, Workload
    from flexgen_sparpr.runtime.stages import choose_stages
    batch = gpu_batch_size * args.micro_batches
    wl = Workload(opt_spec(name), args.prompt_len, args.gen_len, batch, args.dtype)
    row = {"hardware": hw.name, "model": name, "nodes": nodes, "gpu_batch_size": gpu_batch_size, "batch": batch}
    try:
        plan = choose_stages(wl, hw, nodes, args.micro_batches, gpu_batch_size)
    except (NoPlacementFits, ConfigError, ValueError) as e:
        return {**row, "fits": False, "why": str(e)}
    return {**row, "fits": True, "stage_layers": list(plan.split.counts), "percents": [list(p) for p in plan.percents],
            "prefill_s": plan.prefill_s, "decode_step_s": plan.decode_step_s, "total_s": plan.total_s,
            "throughput_tok_s": batch * args.gen_len / plan.total_s, "bottleneck": plan.bottleneck}


def markdown(payload: dict) -> str:
    cfg, rows = payload["config"], []
    base = {(r["hardware"], r["model"], r["gpu_batch_size"]): r for r in payload["rows"] if r["nodes"] == 1 and r["fits"]}
    for r in payload["rows"]:
        if not r["fits"]:
            rows.append([r["hardware"], r["model"], r["nodes"], "-", "does not fit", "-", "-", "-", "-", "-", "-"])
            continue
        one = base.get((r["hardware"], r["model"], r["gpu_batch_size"]))
        pct = "; ".join(" ".join(map(str, p)) for p in dict.fromkeys(tuple(p) for p in r["percents"]))
        rows.append([r["hardware"], r["model"], r["nodes"], f"{r['gpu_batch_size']} x {cfg['micro_batches']}", ",".join(map(str, r["stage_layers"])) if r["nodes"] > 1
                     else "all", pct, f"{r['prefill_s']:.1f}", f"{r['decode_step_s']:.3f}",
                     f"{r['throughput_tok_s']:.2f}", f"{r['throughput_tok_s'] / one['throughput_tok_s']:.1f}x"
                     if one else "-", r["bottleneck"]])
    head = ["hardware (per node)", "model", "nodes", "batch", "layers per stage", "--percent (distinct, per stage)",
            "prefill s", "decode step s", "tokens/s", "vs 1 node", "bound by"]
    return (f"# MODELED pipeline parallelism (not measured)\n\n"
            f"The time model's prediction (runtime/timemodel.py, runtime/stages.py): {cfg['dtype']}, prompt "
            f"{cfg['prompt_len']} + {cfg['gen_len']} new tokens, batch = GPU batch {cfg['gpu_batch_size']} x "
            f"{cfg['micro_batches']} micro-batches (GPU batch {cfg['fallback_gpu_batch_size']} where "
            f"{cfg['gpu_batch_size']} fits nowhere), dense KV; split and placements chosen by `--policy auto` "
            f"with the world size; activations between nodes at each file's interconnect_GBps. Engine "
            f"{cfg['engine_commit']}. Produced by `{cfg['command']}`.\n\n" + md_table(head, rows) +
            "\n- does not fit: no split and placement fits the node's memory and disk at either GPU batch size. "
            "vs 1 node: against one node at the same batch.\n- The model is uncalibrated for these machines (their hardware files' sheet-derived "
            "figures); on this 2-core box its pipeline form is checked by scripts/bench_dist.py.\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    from flexgen_sparpr.errors import ConfigError
    from flexgen_sparpr.runtime.hardware import load_hardware
    rows = []
    for path in args.hardware.split(","):
        try:
            hw = load_hardware(path if Path(path).is_absolute() else REPO / path)
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
