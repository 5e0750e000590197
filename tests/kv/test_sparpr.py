"""SparPR through the real engine and on hand-made block tables (the policy matrix in
test_policies.py runs it too)."""
from __future__ import annotations

import json

import pytest
import torch

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.engine import cell
from flexgen_sparpr.engine.config import ConfigError, EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies.base import token_budget
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.storage.tiers import Tier
from flexgen_sparpr.weights.resolve import resolve_source

from tests.kv.sparpr_tables import CPU, fill, fixed

PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # 40 and 29 tokens: the second is left-padded
GEN = 8


class CopyIsDear(CostModel):
    """Copying an offloaded block costs an hour, rebuilding it a microsecond: all are rebuilt."""

    def copy_s(self, nbytes, tier, devices):
        return 0.0 if tier == Tier.COMPUTE else 3600.0

    def recompute_s(self, *args, **kwargs):
        return 1e-6


def generate(model_dir, tmp_path, policy=None, on_disk=True):
    # stored exact: keep 1 must equal dense to 1e-5, and a rebuilt block the stored one
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), kv_dtype="float32")
    with Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=2, cache_gpu_percent=0 if on_disk else 100),
                cfg) as eng:
        if policy is not None:
            eng.set_kv_policy(policy)
        return eng.generate(PROMPTS, GEN, keep_logits=True)


def assert_same(got, ref):
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


# --- through the engine ---
def test_keep_one_equals_dense_with_the_probed_costs(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path / "cache"))  # probe afresh, not in ~/.cache
    pol = SparPR(keep_ratio=1.0)
    assert_same(generate(tiny_model_dir, tmp_path, pol), generate(tiny_model_dir, tmp_path))
    assert pol.costs is not None and list((tmp_path / "cache").glob("probe-*.json"))
    assert json.dumps(pol.stats(), allow_nan=False)


def test_recomputed_kv_equals_stored_kv(tiny_model_dir, tmp_path, monkeypatch):
    """Every offloaded block rebuilt from its checkpoint (copying made dear): the rebuilt K/V
    equal the stored K/V, and the generation equals dense."""
    pol = SparPR(keep_ratio=1.0, costs=CopyIsDear(disk_read_Bps=1.0, matmul_flops={"float32": 1.0}, live=False))
    tables, checked = [], []
    real_select, real_rebuild = pol.select, cell.rebuild_kv

    def select(table, layer, q):
        tables.append(table)
        return real_select(table, layer, q)

    def rebuild(f, arch, w, pads):
        real_rebuild(f, arch, w, pads)
        if f.hidden is not None:
            stored, pos = tables[-1].gather(sorted(f.sel.recompute))
            assert torch.equal(pos, f.pos[f.slots])
            torch.testing.assert_close(f.kv[:, :, :, f.slots], stored, atol=1e-5, rtol=0)
            checked.append(len(f.sel.recompute))
    monkeypatch.setattr(pol, "select", select)
    monkeypatch.setattr(cell, "rebuild_kv", rebuild)
    assert_same(generate(tiny_model_dir, tmp_path, pol), generate(tiny_model_dir, tmp_path))
    totals = pol.stats()["totals"]
    assert checked and totals["blocks_recomputed"] == sum(checked) and totals["blocks_copied"] == 0
    assert totals["fallbacks"] == 0


def test_a_prefill_summarises_its_blocks_once_per_table(tiny_opt_dir, tmp_path, monkeypatch):
    """The prefill's sealed blocks are summarised in one call per table (on_prefill, with the
    padding known), not once per block as each seals; a decode step's sealed block, once (by the
    compiled encode where it is built, else by summarise)."""
    pol, calls = SparPR(keep_ratio=0.3, min_keep_tokens=0, costs=fixed()), []
    real, real_seal = pol.summarise, pol.seal_in_place
    monkeypatch.setattr(pol, "summarise", lambda t, keys, valid: calls.append(keys.shape[2]) or real(t, keys, valid))
    monkeypatch.setattr(pol, "seal_in_place", lambda *a: real_seal(*a) and not calls.append(1))  # one block, encoded
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path))
    with Engine(resolve_source(str(tiny_opt_dir), ""), Policy(gpu_batch_size=2), cfg) as eng:
        eng.set_kv_policy(pol)
        st_ = eng.prefill(PROMPTS, 16)
        assert calls == [40 // 8] * len(eng.tables)  # 5 sealed blocks, one call per (layer, batch)
        calls.clear()
        for i in range(8):  # the steps caching positions 40..47: the 8th seals block 5
            eng.step(st_)
            assert calls == ([1] * len(eng.tables) if i == 7 else []), i


@pytest.mark.parametrize("rebuild", [False, True], ids=["copy", "recompute"])
def test_scoring_reads_no_offloaded_block(tiny_opt_dir, tmp_path, rebuild):
    """Cache on disk: each decode step moves exactly its selected sealed blocks' bytes (their
    checkpoints' when rebuilt); scoring the blocks moves nothing. Read afresh every step (no
    arena: tests/engine/test_recall.py covers what the arena saves)."""
    costs = CopyIsDear(disk_read_Bps=1.0, matmul_flops={"float32": 1.0}, live=False) if rebuild else fixed()
    pol = SparPR(keep_ratio=0.3, min_keep_tokens=0, costs=costs, fallback=False)
    picked = []
    real_select = pol.select
    pol.select = lambda t, layer, q: picked.append((t, real_select(t, layer, q))) or picked[-1][1]
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path))
    with Engine(resolve_source(str(tiny_opt_dir), ""), Policy(gpu_batch_size=2, cache_gpu_percent=0), cfg) as eng:
        eng.set_kv_policy(pol)
        eng.reader.recall = None
        st_ = eng.prefill(PROMPTS, GEN)
        while len(st_.tokens) < GEN:
            picked.clear()
            before = eng.devices.counters.snapshot().get("disk->cpu", 0)
            st_.max_new = len(st_.tokens) + 1
            eng.decode(st_)
            moved = eng.devices.counters.snapshot().get("disk->cpu", 0) - before
            want = 0
            for t, sel in picked:
                off = 0
                for b in sel.blocks:
                    n = t.block_len(b)
                    # the sequences whose mask keeps a token of b: only their rows of b move
                    readers = int(sel.mask[:, :, off:off + n].any(dim=2).any(dim=1).sum())
                    off += n
                    if b < t.length // t.bs and t.homes[b] == Tier.DISK:
                        want += t.checkpoints.store.codec_of(Tier.DISK).nbytes if b in sel.recompute else t.store.read_bytes(b, readers)
                assert len(sel.blocks) < t.num_blocks and bool(sel.recompute) == rebuild
            assert moved == want > 0
    steps = pol.stats()["steps"]
    assert len(steps) == GEN - 1 and all(s["calls"] == 2 for s in steps)  # 2 layers x 1 GPU batch


def test_quest_only_copies_at_the_ceiling_without_probing(tiny_llama_dir, tmp_path):
    pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, quest_only=True)
    assert not pol.needs_checkpoints and not (pol.dynamic_budget or pol.recompute or pol.fallback)
    generate(tiny_llama_dir, tmp_path, pol)
    totals = pol.stats()["totals"]
    assert pol.costs is None and totals["blocks_recomputed"] == totals["fallbacks"] == 0
    assert all(s["keep_target"] == 0.5 for s in pol.stats()["steps"])


# --- on hand-made tables ---
def test_gqa_scores_each_query_head_against_its_kv_heads_summary():
    t = BlockTable(name="r", batch=1, num_kv_heads=2, head_dim=4, block_size=4, max_len=32, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 8, devices=CPU)
    fill(t, 26, seed=7)  # 6 sealed blocks, 2 open tokens
    q = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(8))  # 2 query heads per KV head
    pol = SparPR(keep_ratio=0.8, min_keep_tokens=0, costs=fixed(), head_score="sum", summary="mean")
    sel = pol.select(t, 0, q)
    keys = t.gather()[0][0, 0]  # keys: [Hkv, L, D]
    score = {b: sum(float(q[0, h, 0] @ keys[h // 2, b * 4:(b + 1) * 4].mean(0)) for h in range(4)) for b in range(6)}
    budget = token_budget(0.8, 26, pol.floor(t))  # 21: sink 4 + recent 4 + open 2 + 2 more blocks
    best = sorted((b for b in range(1, 5)), key=lambda b: -score[b])[:(budget - 10) // 4]
    assert sel.blocks == sorted([0, *best, 5, 6])
    assert sel.mask is None and sum(t.block_len(b) for b in sel.blocks) == 10 + 4 * len(best)  # one sequence: whole blocks


@pytest.mark.parametrize("bad", [dict(min_keep=0), dict(min_keep=1.5), dict(gamma=0), dict(gamma=1.2),
                                 dict(recent_blocks=-1), dict(keep_ratio=0)])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        SparPR(**bad)


def test_cli_passes_sparpr_flags_only_to_sparpr():
    def engine_args(*argv):  # the policy's fields, as the engine gets them
        pol = resolve(build_parser().parse_args(list(argv)))[2].kv_policy
        return {f: v for f, v in vars(pol).items() if not f.startswith("_") and f in pol.__dataclass_fields__}
    args = engine_args("--kv-policy", "sparpr", "--keep-ratio", "0.5", "--min-keep", "0.2", "--gamma", "0.8",
                       "--no-fallback", "--quest-only", "--percent", "100", "0", "0", "0", "100", "0",
                       "--offload-dir", "/somewhere")
    # --quest-only turns the three runtime decisions off
    assert args == dict(keep_ratio=0.5, min_keep_tokens=768, min_keep=0.2, gamma=0.8, recent_blocks=1,
                        dynamic_budget=False,
                        recompute=False, fallback=False, step_fallback=False, quest_only=True, head_score="softmax",
                        summary="lowrank",
                        summary_rank=0.5, summary_tokens=4, summaries_on="compute",
                        per_sequence=True, per_head=False, checkpoints="auto", costs=None, probe_dir="/somewhere")
    assert engine_args("--kv-policy", "sparpr", "--checkpoints", "always")["checkpoints"] == "always"
    assert engine_args("--kv-policy", "sparpr", "--summaries-on", "cpu")["summaries_on"] == "cpu"
    assert engine_args("--kv-policy", "sparpr", "--no-recompute")["probe_dir"] is None
    assert engine_args("--kv-policy", "sparpr", "--summary-tokens", "16")["summary_tokens"] == 16
    assert engine_args("--kv-policy", "sparpr", "--summary-tokens", "128")["summary_tokens"] == 128  # one a block
    for bad in ("-1", "12"):  # 12 does not divide the default block size 64
        with pytest.raises(ConfigError, match="--summary-tokens"):
            engine_args("--kv-policy", "sparpr", "--summary-tokens", bad)
    assert engine_args("--kv-policy", "quest") == dict(keep_ratio=1.0, min_keep_tokens=768, dense_layers=2)
    with pytest.raises(ConfigError, match="--min-keep is a knob of sparpr; --kv-policy quest ignores it"):
        engine_args("--kv-policy", "quest", "--min-keep", "0.2")
    assert SparPR(**args).quest_only and not SparPR(**args).needs_checkpoints


def test_batch_reads_one_shared_block_set_with_each_sequences_best_first():
    """Blocks move for the whole batch: every sequence attends every chosen block (no moved
    byte goes unread), and each sequence's best block is among them."""
    t = BlockTable(name="b", batch=2, num_kv_heads=2, head_dim=4, block_size=4, max_len=64, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 16, devices=CPU)
    fill(t, 48, seed=10)  # 12 sealed blocks: sink 0, window 11, candidates 1..10
    q = torch.randn(2, 2, 1, 4, generator=torch.Generator().manual_seed(11))
    pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=fixed(), per_sequence=False, head_score="sum", summary="mean",
                 summary_tokens=0)
    sel = pol.select(t, 0, q)
    keys = t.gather()[0][0]  # keys: [B, Hkv, L, D]
    for s in range(2):
        score = [sum(float(q[s, h, 0] @ keys[s, h, b * 4:(b + 1) * 4].mean(0)) for h in range(2)) for b in range(12)]
        assert max(range(1, 11), key=lambda b: score[b]) in sel.blocks
        assert int(sel.mask[s, 0].sum()) == 4 * len(sel.blocks) <= token_budget(0.5, 48, pol.floor(t))
    assert torch.equal(sel.mask[0], sel.mask[1])


def test_run_writes_the_policys_step_stats_to_output_json(tmp_path, monkeypatch):
    from flexgen_sparpr.cli.main import main
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out.json"
    argv = ["run", "--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "40", "--gen-len", "4",
            "--gpu-batch-size", "2", "--warmup", "false", "--no-log", "--verbose", "0", "--block-size", "8",
            "--percent", "100", "0", "0", "0", "100", "0", "--offload-dir", str(tmp_path / "off"),
            "--kv-policy", "sparpr", "--keep-ratio", "0.5", "--min-keep-tokens", "0", "--output-json", str(out)]
    assert main(argv) == 0
    stats = json.loads(out.read_text())["kv_policy_stats"]
    assert stats["config"]["keep_ratio"] == 0.5 and len(stats["steps"]) == 3  # decode steps
    assert stats["totals"]["calls"] == 3 * 12 and stats["totals"]["est_bytes"]["disk->cpu"] > 0
    assert stats["costs"]["disk_read_Bps"] > 0 and list((tmp_path / "cache").glob("probe-*.json"))


def test_dkv_cold_blocks_get_the_prefills_importance(tiny_llama_dir, tmp_path, monkeypatch):
    """--kv-policy sparpr --cold-codec dkv: every block sealed by the prefill is encoded with the
    query-aware importance (DKV's residual pick), none without it."""
    from flexgen_sparpr.kv.dkv.codec import DKVCodec
    calls = []
    real = DKVCodec.encode

    def encode(self, kv, importance=None):
        calls.append(importance is not None)
        return real(self, kv, importance=importance)
    monkeypatch.setattr(DKVCodec, "encode", encode)
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), kv_policy="sparpr",
                       policy_args={"keep_ratio": 0.5, "min_keep_tokens": 0, "costs": fixed()}, cold_codec="dkv",
                       codec_args={"rank": 2, "residuals": 2, "residual_pick": "attention"})
    with Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=2, cache_gpu_percent=0), cfg) as eng:
        eng.prefill(PROMPTS, 2)
        sealed = sum(t.length // t.bs for t in eng.tables.values())
    assert len(calls) == sealed > 0 and all(calls)
