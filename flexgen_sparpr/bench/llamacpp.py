"""This engine beside llama.cpp on the same model (scripts/bench_llamacpp.py): SmolLM2-135M-Instruct,
whose prepared weights are the Q4_1 GGUF `make prepare` fetches (so both compute with the same weight
values: llama.cpp on its 4-bit blocks, this engine on the same codes packed for torch's int4 kernel
under the default --weight-format auto, or widened to float32 under raw). The same prompt ids
(passkeys hidden in Alice in Wonderland at evenly spread depths), greedy, a batch of 1 or more
prompts, the same thread count, one after the other: llama.cpp's prefill and decode steps (one
context with a KV cache per prompt: llama-cpp-python, bench/peers.py), and this engine at its
defaults (KV resident, one GPU batch of them all) with dense attention and SparPR at one keep from
one prefill (`LLM.compare`). Per context and batch: prefill and decode tokens/s of each (decode:
batch / the median step), their ratios, and where the greedy tokens first differ."""
from __future__ import annotations

import random
import statistics
from pathlib import Path

from ..api.llm import LLM
from ..weights.resolve import smollm2_dir
from .membound import read_bandwidth, sparpr_code_bytes, step_bytes
from .needle_prompt import NeedlePrompts, random_key
from .peers import llamacpp_greedy
from ..api.resolved import resolved
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


def median_step_keep(stats: dict) -> float:
    """The share of the cache SparPR's median decode step read (its steps' effective keeps): the step
    the decode rate and the floor stand for. The run's total over-counts it: SparPR's measured step
    fallback times a few whole steps dense before it settles on sparse ones (kv/policies/sparpr_steps.py)."""
    return statistics.median(s["effective_keep"] for s in stats["steps"])


def run_context(tokens: int, gen_len: int, threads: int, keep: float, seed: int,
                formats: tuple[str, ...] = ("auto",), batch: int = 1, read_Bps: float | None = None) -> dict:
    """One context length and batch: llama.cpp, then this engine's dense and SparPR runs on the
    same ids, once per weight format (--weight-format; auto: the engine's default). read_Bps: set
    each engine step against the memory read bandwidth (bench/membound.py), measured again right
    after each format's runs, so a slow hour slows the floor with the steps (None: no floor)."""
    cell = {"tokens": None, "batch": batch, "gen_len": gen_len, "resolved": {}, "engine": {}}
    for fmt in formats:
        with LLM("smollm2-135m", gpu_batch_size=batch, quiet=True, weight_format=fmt) as llm:
            rng = random.Random(seed)
            book = NeedlePrompts(llm.tokenizer, TEXT)
            ids = [book.build(tokens, (i + 1) / (batch + 1), random_key(rng, 5), rng).ids for i in range(batch)]
            label = f"sparpr@{keep:g}"
            runs = llm.compare(ids, {label: {"kv_policy": "sparpr", "keep_ratio": keep}}, max_new_tokens=gen_len,
                               stop=None)
            cell["resolved"][fmt] = {**resolved(llm), "sparpr": runs[label][1].kv_policy_stats.get("config")}
            bw = read_bandwidth(threads) if read_Bps else None  # the bus as the steps just found it
            for name, (outs, s) in runs.items():
                steps = s.step_times[0][1:]
                row = cell["engine"][f"{name}, weights {fmt}"] = {
                    "prefill_s": s.prefill_s, "prefill_tok_s": sum(map(len, ids)) / s.prefill_s,
                    "decode_tok_s": batch / statistics.median(steps), "tokens": [o.token_ids for o in outs]}
                config = (s.kv_policy_stats or {}).get("config")
                keep_read = median_step_keep(s.kv_policy_stats) if name == label else 1.0
                # a step the measured fallback ran dense scores nothing: no codes read
                codes = sparpr_code_bytes(config, llm.spec.head_dim) if name == label and keep_read < 1 else 0
                row["step_bytes"] = step_bytes(llm, len(ids[0]), batch, keep_read, codes)
                if bw:
                    row["read_GBps"] = bw / 1e9
                    row["floor_s"] = sum(row["step_bytes"].values()) / bw
                    row["vs_floor"] = statistics.median(steps) / row["floor_s"]
        cell["tokens"] = len(ids[0])
    peer = cell["llamacpp"] = llamacpp_greedy(gguf_path(), ids, gen_len, threads)
    if peer["ok"]:
        peer["decode_tok_s"] = batch / statistics.median(peer["step_s"])
        peer["prefill_tok_s"] = sum(map(len, ids)) / peer["prefill_s"]
        for row in cell["engine"].values():
            row["vs_llamacpp_decode"] = row["decode_tok_s"] / peer["decode_tok_s"]
            row["vs_llamacpp_prefill"] = row["prefill_tok_s"] / peer["prefill_tok_s"]
            row["first_difference"] = [first_difference(a, b) for a, b in zip(row["tokens"], peer["tokens"])]
    return cell


def agreement(diffs) -> str:
    """Where each prompt's greedy tokens first differ from llama.cpp's, said in a few words."""
    diffs = diffs if isinstance(diffs, list) else [diffs]  # a batch-1 cell written before batches: one index
    if all(d is None for d in diffs):
        return "equal"
    if len(diffs) == 1:
        return f"from token {diffs[0]}"
    return ", ".join(f"p{i} " + ("equal" if d is None else f"from {d}") for i, d in enumerate(diffs))  # p0: the first prompt


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
            rows.append([c["tokens"], c.get("batch", 1), "llama.cpp", "n/a", "n/a", "", "", p["error"], "", ""])
            continue
        b = c.get("batch", 1)
        rows.append([c["tokens"], b, "llama.cpp (Q4_1)", f"{p['prefill_tok_s']:.0f}", f"{p['decode_tok_s']:.1f}", "", "",
                     "", "", ""])
        for name, r in c["engine"].items():
            rows.append([c["tokens"], b, f"this engine, {name}",
                         f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}", f"{r['vs_llamacpp_prefill']:.2f}x",
                         f"{r['vs_llamacpp_decode']:.2f}x", agreement(r["first_difference"]), *_floor(r)])
    return (f"# This engine beside llama.cpp (SmolLM2-135M-Instruct, engine {cfg['engine_commit']}, "
            f"llama-cpp-python {cfg['llamacpp_version']})\n\n"
            f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}; {cfg['threads']} threads each, "
            f"greedy, {cfg['gen_len']} new tokens per prompt (decode tok/s: batch / the median decode step), "
            f"one after the other on the same prompt ids; llama.cpp keeps a KV cache per prompt, flash attention "
            f"off (llama-cpp-python's default; faster here). llama.cpp reads the Q4_1 GGUF; this engine the same "
            f"weight values at its defaults, KV resident, with each --weight-format named in a row (auto, the "
            f"default: {_formats(payload)}; raw: float32; bfloat16: 2-byte weights; int8: a scale per row). Produced by `scripts/bench_llamacpp.py`.\n\n"
            + md_table(["tokens", "batch", "run", "prefill tok/s", "decode tok/s", "prefill vs llama.cpp",
                        "decode vs llama.cpp", "greedy tokens vs llama.cpp", "MB read / step", "step / floor"],
                       rows) + _floor_note(cfg, payload["cells"]))


def _floor(r: dict) -> list[str]:
    """A row's bytes a step must read and its step over the memory-bound floor (blank: not recorded)."""
    if "step_bytes" not in r:
        return ["", ""]
    mb = f"{sum(r['step_bytes'].values()) / 1e6:.0f}"
    return [mb, f"{r['vs_floor']:.1f}x" if "vs_floor" in r else ""]


def _floor_note(cfg: dict, cells: list[dict]) -> str:
    if not cfg.get("read_GBps"):
        return ""
    bws = [r["read_GBps"] for c in cells for r in c["engine"].values() if "read_GBps" in r]
    when = (f"measured right after each weight format's runs, {min(bws):.1f}-{max(bws):.1f} GB/s "
            f"({cfg['read_GBps']:.1f} at the start)" if bws else f"{cfg['read_GBps']:.1f} GB/s")
    return (f"\nFloor: the bytes a step must read (the weights it multiplies, the KV tokens its attention reads (SparPR: "
            f"its median step's share of them), SparPR's 4-bit key codes; bench/membound.py) over the memory read bandwidth, {when}: the best of "
            f"three float32 sums over 1 GiB on {cfg['threads']} threads.\n")
