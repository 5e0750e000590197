"""The decode step per weight format and compute dtype (scripts/bench_weights.py): SmolLM2-135M,
dense, KV resident, the weights resident or streamed from disk (O_DIRECT) every step, one prompt per
batch row (passkeys in the demo's text), the median of a fixed number of decode steps.

Rows: float32 weights (`--weight-format raw`: FlexGen's uncompressed weights), FlexGen's
`--compress-weight`, the defaults (`auto`: the start-up probe's pick), and `--dtype bfloat16` with
raw and with auto weights. Per cell the ratios the weight-bytes targets name:
  --compress-weight against raw on the same placement   (never slower; >= 1.5x with the weights on disk)
  --compress-weight against the defaults                (what a user gets without the flag)
  bfloat16 against float32, same weight format          (>= 1.0x where the CPU has bfloat16)"""
from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from ..api.llm import LLM
from ..api.resolved import resolved
from .args import OneLineParser, die
from .needle_prompt import NeedlePrompts, random_key
from .results import REPO, md_table, publish
from .texts import TEXTS

TEXT = TEXTS["alice29"].path  # the demo's text (tuning split: bench/texts.py)
RUNS = {  # label -> the LLM options it names (everything else at the defaults)
    "float32, raw": {"weight_format": "raw"},
    "float32, --compress-weight": {"compress_weight": True},
    "float32, auto (default)": {},
    "bfloat16, raw": {"dtype": "bfloat16", "weight_format": "raw"},
    "bfloat16, auto": {"dtype": "bfloat16"},
}
PLACEMENTS = {"resident": [100, 0, 100, 0, 100, 0], "disk": [0, 0, 100, 0, 100, 0]}  # weights' tier; KV resident


def run_cell(tokens: int, batch: int, placement: str, label: str, steps: int, offload: str, seed: int) -> dict:
    """One run: the median decode step, disk bytes a step, and the configuration it resolved to."""
    with LLM("smollm2-135m", gpu_batch_size=batch, percent=PLACEMENTS[placement], direct_io=True,
             offload_dir=offload, quiet=True, **RUNS[label]) as llm:
        rng = random.Random(seed)
        book = NeedlePrompts(llm.tokenizer, TEXT)
        ids = [book.build(tokens, (i + 1) / (batch + 1), random_key(rng, 5), rng).ids for i in range(batch)]
        llm.generate(ids, max_new_tokens=steps + 1, stop=None)
        s = llm.last_stats
        decode = s.step_times[0][1:]
        return {"tokens": len(ids[0]), "batch": batch, "placement": placement, "run": label,
                "options": RUNS[label], "resolved": resolved(llm), "step_s": statistics.median(decode),
                "steps": len(decode), "prefill_s": s.prefill_s,
                "disk_bytes_per_step": s.bytes_moved.get("disk->cpu", 0) / max(1, len(decode) + 1),
                "parts_s": s.decode_step_parts}


def _step(cells: list[dict], c: dict, label: str) -> float | None:
    return next((o["step_s"] for o in cells if o["run"] == label and o["tokens"] == c["tokens"]
                 and o["batch"] == c["batch"] and o["placement"] == c["placement"]), None)


def add_ratios(cells: list[dict]) -> None:
    """Each run's step against raw float32, the defaults and its float32 twin on the same placement."""
    for c in cells:
        for key, other in (("vs_raw", "float32, raw"), ("vs_default", "float32, auto (default)")):
            o = _step(cells, c, other)
            c[key] = o / c["step_s"] if o else None
        if c["run"].startswith("bfloat16"):
            twin = _step(cells, c, "float32, raw" if c["run"].endswith("raw") else "float32, auto (default)")
            c["vs_float32"] = twin / c["step_s"] if twin else None


def _x(v) -> str:
    return f"{v:.2f}x" if v else ""


def render(payload: dict) -> str:
    cfg, m = payload["config"], payload["machine"]
    rows = [[c["tokens"], c["batch"], c["placement"], c["run"], c["resolved"]["weight_format"], f"{c['step_s']:.4f}",
             f"{c['disk_bytes_per_step'] / 2 ** 20:.1f}", _x(c["vs_raw"]), _x(c["vs_default"]), _x(c.get("vs_float32"))]
            for c in payload["cells"]]
    return (f"# Decode step per weight format and dtype (SmolLM2-135M, engine {cfg['engine_commit']})\n\n"
            f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']} ({m['torch_threads']} threads). "
            f"Dense, KV resident, the weights resident or on disk (O_DIRECT, read every step); median of "
            f"{cfg['steps']} decode steps, the median of {cfg.get('rounds', 1)} rounds (a cell's runs taken in turn "
            f"each round); each run names only the options in its row, the rest at the defaults "
            f"(each cell's resolved configuration is in the json). Speed-ups are the other run's step over "
            f"this one's (above 1: this one is faster). Produced by `scripts/bench_weights.py`.\n\n"
            + md_table(["tokens", "batch", "weights on", "run", "weight format", "step s", "disk MiB/step",
                        "vs raw float32", "vs defaults", "bfloat16 vs float32"], rows))


def parser(doc: str) -> OneLineParser:
    """scripts/bench_weights.py's command line."""
    ap = OneLineParser(description=doc)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--placements", nargs="+", choices=list(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--steps", type=int, default=12, help="decode steps each run times (median taken)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each cell runs, its runs taken in turn each round (the cell: the median round); "
                         "formats that differ by a few per cent are not told apart by the hour they ran in")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offload-dir", default=str(Path(tempfile.gettempdir()) / "flexgen-sparpr-bench-weights"))
    ap.add_argument("--out", default=str(REPO / "results" / "weights"))
    return ap


def median_round(rounds: list[dict]) -> dict:
    """A cell from its rounds: the round with the median step, every round's step beside it."""
    best = sorted(rounds, key=lambda c: c["step_s"])[(len(rounds) - 1) // 2]
    return {**best, "round_steps_s": [c["step_s"] for c in rounds]}


def run_grid(args) -> int:
    """Every (length, batch, placement) group, its runs in turn, `rounds` times over; then
    <out>/weights.json and weights.md."""
    if args.rounds < 1 or args.steps < 1:
        die("--rounds and --steps take a positive count")
    cells = []
    for tokens in args.lengths:
        for batch in args.batches:
            for placement in args.placements:
                rounds: dict[str, list[dict]] = {label: [] for label in args.runs}
                for r in range(args.rounds):
                    for label in args.runs:
                        c = run_cell(tokens, batch, placement, label, args.steps, args.offload_dir, args.seed)
                        rounds[label].append(c)
                        print(f"{tokens} x{batch} {placement} {label} round {r + 1}: {c['step_s']:.4f} s", flush=True)
                cells += [median_round(rounds[label]) for label in args.runs]
    add_ratios(cells)
    publish(args.out, "weights", {**vars(args), "model": "smollm2-135m"}, cells, render)
    return 0
