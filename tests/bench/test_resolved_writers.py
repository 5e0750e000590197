"""The writers with no quick script run of their own record what their engines resolved
(api/resolved.py), one per configuration: device_tokens.run, decode_vs_hf.run_grid,
dkv_runs.run_config, dkv_speed.interleaved and ablations.needle_run, each on the tiny Llama."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexgen_sparpr.weights.resolve import resolve_source
from tests.scripts.resolved_check import check_resolved

torch.manual_seed(0)
PROMPTS = torch.randint(4, 300, (2, 40)).tolist()


class Tok:
    """Decodes ids as their numbers: the answers' text is not what these tests look at."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def trials():
    return [SimpleNamespace(ids=p, key="12345", depth=0.5) for p in PROMPTS]


@pytest.fixture
def src(tiny_llama_dir):
    return resolve_source(str(tiny_llama_dir), "")


def test_device_tokens_run_returns_its_configuration(src):
    from flexgen_sparpr.bench.device_tokens import run
    tokens, logits, conf = run(src, PROMPTS, 3, "cpu", "float32", {"cache_gpu_percent": 0, "cache_cpu_percent": 100})
    assert len(tokens) == 2 and logits.shape[:2] == (2, 3)
    check_resolved(conf, policy="dense", block_size=64, compute_dtype="float32")
    assert conf["placement"]["kv"] == [0, 100, 0]


def test_decode_vs_hf_cells_carry_their_llms_configuration(src, tiny_llama_dir):
    from flexgen_sparpr.bench.decode_vs_hf import run_grid
    from flexgen_sparpr.bench.peers import load_hf
    model = load_hf(tiny_llama_dir, "float32", "cpu")
    args = SimpleNamespace(batches=[1, 2], lengths=[16], device="cpu", dtype="float32", gen_len=3, repeats=1)
    cells = run_grid(args, src, model, list(range(4, 200)))
    assert [c["resolved"]["placement"]["gpu_batch_size"] for c in cells] == [1, 2]  # one LLM per batch size
    for c in cells:
        check_resolved(c["resolved"], policy="dense", compute_dtype="float32", device="cpu")


def test_dkv_runs_record_the_policy_each_record_decoded_with(src, tmp_path):
    from flexgen_sparpr.bench.dkv_runs import run_config
    args = SimpleNamespace(rank=4, residuals=2, residual_pick="attention", block=8, topk=2, dense_layers=0,
                           route="lowrank", pick_follow=None, keep=[0.5], gen_len=3)
    recs = run_config(src, "dense", args, trials(), Tok(), str(tmp_path))
    recs += run_config(src, "sparpr", args, trials(), Tok(), str(tmp_path))
    assert [r["config"] for r in recs] == ["dense", "sparpr@0.5"]
    check_resolved(recs[0]["resolved"], policy="dense", block_size=8)
    sp = check_resolved(recs[1]["resolved"], policy="sparpr", block_size=8)
    assert sp["kv_policy"]["keep_ratio"] == 0.5 and sp["placement"]["kv"] == [0, 0, 100]


def test_dkv_speed_records_both_engines(src):
    from flexgen_sparpr.bench.dkv_speed import interleaved
    args = SimpleNamespace(batch=2, block=32, gen_len=3, rounds=1, dkv_exact_routed=0)  # block: the dkv rank's floor
    run = interleaved(src, Tok(), trials(), args)
    check_resolved(run["resolved"]["dense"], policy="dense", block_size=32)
    check_resolved(run["resolved"]["dkv"], policy="dkv", block_size=32)


def test_ablations_needle_run_records_each_prefills_engine(src, tmp_path):
    from flexgen_sparpr.bench.ablations import needle_run
    args = SimpleNamespace(needle_batch=1, needle_block_size=8, offload_dir=str(tmp_path))
    answers, confs = needle_run(src, Tok(), trials(), args, "sparpr", {"keep_ratio": 0.5, "min_keep_tokens": 0, "probe_dir": str(tmp_path)})
    assert len(answers) == len(confs) == 2  # --needle-batch 1: a prefill, and an engine, per trial
    for conf in confs:
        check_resolved(conf, policy="sparpr", block_size=8)
        assert conf["placement"]["kv"] == [0, 0, 100] and conf["kv_policy"]["keep_ratio"] == 0.5
