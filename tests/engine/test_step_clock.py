"""Where a step's time goes (engine/step_clock.py): every step's parts add up to its wall time,
and each part is booked where it happens (a query-aware policy selects and reads, dense does not)."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.step_clock import PARTS, StepClock, median_parts
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 43)), list(range(50, 79))]


def parts(model_dir, tmp_path, kv_policy: str, **policy) -> list[dict]:
    eng = Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=2, **policy),
                 EngineConfig(device="cpu", block_size=4, kv_policy=kv_policy, offload_dir=str(tmp_path),
                              policy_args={"keep_ratio": 0.3, "min_keep_tokens": 0} if kv_policy != "dense" else {}))
    try:
        res = eng.generate(PROMPTS, 6)
    finally:
        eng.close()
    assert len(res.step_parts) == len(res.step_times)
    for p, total in zip(res.step_parts, res.step_times):
        assert set(p) == set(PARTS) and all(v >= 0 for v in p.values())
        assert sum(p.values()) == pytest.approx(total, rel=1e-6, abs=1e-9)
    return res.step_parts[1:]  # the decode steps


def test_parts_add_up_and_are_booked_where_they_happen(tiny_llama_dir, tmp_path):
    dense = parts(tiny_llama_dir, tmp_path, "dense")
    assert all(p["select"] == 0 and p["read"] == 0 and p["rebuild"] == 0 for p in dense)  # read in place
    sparse = parts(tiny_llama_dir, tmp_path, "sparpr")
    assert all(p["select"] > 0 and p["read"] > 0 for p in sparse)
    on_disk = parts(tiny_llama_dir, tmp_path, "dense", cache_gpu_percent=0, cache_cpu_percent=0)
    assert all(p["select"] == 0 and p["io_wait"] > 0 for p in on_disk)  # prefetched on the I/O pool, waited for


def test_the_clock_files_a_step_and_starts_the_next():
    clock = StepClock()
    with clock.timed("select"):
        torch.ones(8).sum()
    first = clock.close(1.0)
    assert first["select"] > 0 and first["compute"] == pytest.approx(1.0 - first["select"])
    assert clock.close(0.5) == {"select": 0.0, "read": 0.0, "rebuild": 0.0, "io_wait": 0.0, "compute": 0.5}
    assert median_parts([{"select": 1.0}, {"select": 3.0}])["select"] == 2.0 and median_parts([]) == {}
