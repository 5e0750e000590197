"""This engine beside llama.cpp on the same model (scripts/bench_llamacpp.py): SmolLM2-135M-Instruct,
whose prepared weights are the Q4_1 GGUF `make prepare` fetches (so both compute with the same weight
values: llama.cpp on its 4-bit blocks, this engine on the same codes packed for torch's int4 kernel
under the default --weight-format auto, or widened to float32 under raw). The same prompt ids
(a passkey hidden in Alice in Wonderland), greedy, batch 1, the same thread count, one after the
other: llama.cpp's prefill and one-token decode steps (llama-cpp-python, bench/peers.py), and
this engine at its defaults (KV resident) with dense attention and SparPR at one keep from one
prefill (`LLM.compare`). Per context: prefill and decode tokens/s of each, their ratios, and
where the greedy tokens first differ."""
from __future__ import annotations

import random
import statistics
from pathlib import Path

from ..api.llm import LLM
from ..weights.resolve import smollm2_dir
from .needle_prompt import NeedlePrompts, random_key
from .peers import llamacpp_greedy
from .results import md_table
from .texts import TEXTS

TEXT = TEXTS["alice29"].path  # the demo's text (tuning split: bench/texts.py)


def gguf_path() -> Path | None:
    """The prepared model's GGUF (kept beside its converted weights), if any."""
    found = sorted(smollm2_dir().glob("*.gguf"))
    return found[0] if found else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: equal over the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run_context(tokens: int, gen_len: int, threads: int, keep: float, seed: int,
                formats: tuple[str, ...] = ("auto",)) -> dict:
    """One context length: llama.cpp, then this engine's dense and SparPR runs on the same ids,
    once per weight format (--weight-format; auto: the engine's default)."""
    cell = {"tokens": None, "gen_len": gen_len, "resolved": {}, "engine": {}}
    for fmt in formats:
        with LLM("smollm2-135m", gpu_batch_size=1, quiet=True, weight_format=fmt) as llm:
            rng = random.Random(seed)
            ids = NeedlePrompts(llm.tokenizer, TEXT).build(tokens, 0.5, random_key(rng, 5), rng).ids
            label = f"sparpr@{keep:g}"
            runs = llm.compare([ids], {label: {"kv_policy": "sparpr", "keep_ratio": keep}}, max_new_tokens=gen_len,
                               stop=None)
            eng = llm.engine
            cell["resolved"][fmt] = {
                "compute_dtype": str(eng.dtype).removeprefix("torch."), "block_size": eng.cfg.block_size,
                "weight_format": eng.weight_format.describe(),
                "kv_dtype": str(eng.cfg.torch_kv_dtype(eng.dtype)).removeprefix("torch."),
                "placement": {"weights": list(llm.policy.weight_percents), "kv": list(llm.policy.cache_percents)},
                "sparpr": runs[label][1].kv_policy_stats.get("config")}
        cell["tokens"] = len(ids)
        for name, (outs, s) in runs.items():
            steps = s.step_times[0][1:]
            cell["engine"][f"{name}, weights {fmt}"] = {
                "prefill_s": s.prefill_s, "prefill_tok_s": len(ids) / s.prefill_s,
                "decode_tok_s": 1 / statistics.median(steps), "tokens": outs[0].token_ids}
    peer = cell["llamacpp"] = llamacpp_greedy(gguf_path(), ids, gen_len, threads)
    if peer["ok"]:
        peer["decode_tok_s"] = 1 / statistics.median(peer["step_s"])
        peer["prefill_tok_s"] = len(ids) / peer["prefill_s"]
        for row in cell["engine"].values():
            row["vs_llamacpp_decode"] = row["decode_tok_s"] / peer["decode_tok_s"]
            row["vs_llamacpp_prefill"] = row["prefill_tok_s"] / peer["prefill_tok_s"]
            row["first_difference"] = first_difference(row["tokens"], peer["tokens"])
    return cell


def _formats(payload: dict) -> str:
    """What auto resolved to, as recorded by the first cell."""
    first = payload["cells"][0]["resolved"] if payload["cells"] else {}
    return first.get("auto", {}).get("weight_format", "not run")


def render(payload: dict) -> str:
    cfg, m = payload["config"], payload["machine"]
    rows = []
    for c in payload["cells"]:
        p = c["llamacpp"]
        if not p["ok"]:
            rows.append([c["tokens"], "llama.cpp", "n/a", "n/a", "", "", p["error"]])
            continue
        rows.append([c["tokens"], "llama.cpp (Q4_1)", f"{p['prefill_tok_s']:.0f}", f"{p['decode_tok_s']:.1f}", "", "", ""])
        for name, r in c["engine"].items():
            diff = r["first_difference"]
            rows.append([c["tokens"], f"this engine, {name}",
                         f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}", f"{r['vs_llamacpp_prefill']:.2f}x",
                         f"{r['vs_llamacpp_decode']:.2f}x", "equal" if diff is None else f"from token {diff}"])
    return (f"# This engine beside llama.cpp (SmolLM2-135M-Instruct, engine {cfg['engine_commit']}, "
            f"llama-cpp-python {cfg['llamacpp_version']})\n\n"
            f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}; {cfg['threads']} threads each, "
            f"batch 1, greedy, {cfg['gen_len']} new tokens (decode tok/s: 1 / the median one-token step), "
            f"one after the other on the same prompt ids. llama.cpp reads the Q4_1 GGUF; this engine the same "
            f"weight values at its defaults, KV resident, with each --weight-format named in a row (auto, the "
            f"default: {_formats(payload)}; raw: float32). Produced by `scripts/bench_llamacpp.py`.\n\n"
            + md_table(["tokens", "run", "prefill tok/s", "decode tok/s", "prefill vs llama.cpp",
                        "decode vs llama.cpp", "greedy tokens vs llama.cpp"], rows))
