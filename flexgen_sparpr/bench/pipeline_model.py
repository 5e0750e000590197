"""scripts/model_dist.py's rows and report: `--policy auto`'s stage search (runtime/stages.py) for
one (hardware file, model, node count), retried at a fallback GPU batch where the first fits
nowhere, and the MODELED table."""
from __future__ import annotations

from ..errors import ConfigError
from ..models.spec import opt_spec
from ..runtime.placement import NoPlacementFits, Workload
from ..runtime.stages import choose_stages
from .results import md_table


def model_row(hw, name: str, nodes: int, args) -> dict:
    """The modeled row of `name` on `nodes` nodes of `hw` ("fits": False and why, where nothing fits)."""
    row = _row(hw, name, nodes, args.gpu_batch_size, args)
    if not row["fits"] and args.fallback_gpu_batch_size > 0:
        again = _row(hw, name, nodes, args.fallback_gpu_batch_size, args)
        row = again if again["fits"] else row
    return row


def _row(hw, name: str, nodes: int, gpu_batch_size: int, args) -> dict:
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
    """The MODELED table, each row against one node at the same batch."""
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
