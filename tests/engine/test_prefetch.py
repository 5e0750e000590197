"""A query-aware policy's blocks are selected one (layer, GPU batch) cell ahead from the cell's
exact early query, so their recovery overlaps the compute before it (engine/prefetch.py)."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine import cell, prefetch
from flexgen_sparpr.engine.schedule import step_schedule
from flexgen_sparpr.engine.cell import KVReader
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # the second is left-padded
GEN = 6


def generate(model_dir, tmp_path, *, ngb: int, overlap: bool = True, sep_layer: bool = True, device: str = "cpu"):
    costs = CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9}, live=False)
    pol = SparPR(keep_ratio=0.3, min_keep_tokens=0, costs=costs)
    cfg = EngineConfig(device=device, dtype="float32", block_size=8, offload_dir=str(tmp_path), direct_io=True)
    policy = Policy(gpu_batch_size=len(PROMPTS) // ngb, num_gpu_batches=ngb, cache_gpu_percent=0,
                    overlap=overlap, sep_layer=sep_layer)
    with Engine(resolve_source(str(model_dir), ""), policy, cfg) as eng:
        eng.set_kv_policy(pol)
        st = eng.prefill(PROMPTS, GEN, keep_logits=True)
        eng.decode(st)
        return torch.stack(st.tokens, 1).tolist(), st.logits, pol.stats()["totals"]


@pytest.fixture
def spy(monkeypatch):
    """Counts the early selections made, the decode attention cells, and those that were
    handed their blocks already fetched (rather than selecting at compute time)."""
    seen = {"early": 0, "steps": 0, "prefetched": 0}
    real_early, real_read = prefetch.early_selection, KVReader.read

    def early(*args, **kw):
        sel = real_early(*args, **kw)
        seen["early"] += sel is not None
        return sel

    def read(self, t, layer, q, fetched, w, pads):  # every decode cell of a selecting policy
        seen["steps"] += 1
        seen["prefetched"] += fetched is not None
        return real_read(self, t, layer, q, fetched, w, pads)
    monkeypatch.setattr(cell, "early_selection", early)
    monkeypatch.setattr(KVReader, "read", read)
    return seen


@pytest.mark.parametrize("sep_layer", [True, False])
def test_two_gpu_batches_prefetch_every_selection_and_change_nothing(tiny_model_dir, tmp_path, spy, sep_layer,
                                                                     device):
    ref_tokens, ref_logits, ref_totals = generate(tiny_model_dir, tmp_path / "a", ngb=2, overlap=False,
                                                  sep_layer=sep_layer, device=device)
    spy.update(early=0, steps=0, prefetched=0)
    tokens, logits, totals = generate(tiny_model_dir, tmp_path / "b", ngb=2, sep_layer=sep_layer, device=device)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # every decode attention step (2 layers x 2 GPU batches x GEN - 1 steps) got its blocks early
    assert spy["steps"] == spy["prefetched"] == spy["early"] == 2 * 2 * (GEN - 1)
    assert totals["calls"] == ref_totals["calls"] == spy["steps"]  # selected once per cell
    assert totals["tokens_read"] == ref_totals["tokens_read"]


def test_one_gpu_batch_waits_for_the_real_query(tiny_model_dir, tmp_path, spy):
    """With one GPU batch the next cell's input is still being computed: no early selection."""
    generate(tiny_model_dir, tmp_path, ngb=1)
    assert spy["early"] == spy["prefetched"] == 0 and spy["steps"] == 2 * (GEN - 1)


def test_early_and_late_selection_agree(tiny_model_dir, tmp_path, monkeypatch):
    """The early query is the real one: the same tokens as selecting at compute time."""
    early = generate(tiny_model_dir, tmp_path / "a", ngb=2)
    monkeypatch.setattr(cell, "early_selection", lambda *a, **kw: None)
    late = generate(tiny_model_dir, tmp_path / "b", ngb=2)
    assert early[0] == late[0]
    for a, b in zip(early[1], late[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_gather_ring_takes_two_buffers_in_turn():
    """Cells take the ring's buffers in turn (one computing, one prefetching); they start as
    zeros, grow when short, and are reused (no fresh tensor per cell)."""
    from flexgen_sparpr.engine.recovery import GatherRing
    ring, cpu = GatherRing(), torch.device("cpu")
    a = ring.take((2, 3), torch.float32, cpu)
    b = ring.take((2, 3), torch.float32, cpu)
    assert a.data_ptr() != b.data_ptr() and not a.any() and not b.any()
    a.fill_(1.0)
    c = ring.take((2, 3), torch.float32, cpu)
    assert c.data_ptr() == a.data_ptr() and bool((c == 1).all())  # reused, stale but finite
    d = ring.take((4, 4), torch.float32, cpu)  # larger than buffer b: a new, larger one
    assert d.shape == (4, 4) and d.data_ptr() != b.data_ptr()
    assert ring.take((1, 6), torch.float32, cpu).data_ptr() == a.data_ptr()  # fits: reused


@pytest.mark.parametrize("name", ["quest", "flexgen-topk"])
def test_other_query_aware_policies_select_early_too(name, tiny_model_dir, tmp_path, monkeypatch, spy):
    """Every policy that needs the query takes the early path with 2 GPU batches, with the same
    tokens as selecting at compute time."""
    def run(out):
        args = {"keep_ratio": 0.3, "min_keep_tokens": 0} | ({"dense_layers": 0} if name == "quest" else {})  # both layers sparse
        cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(out), kv_policy=name, policy_args=args)
        policy = Policy(gpu_batch_size=1, num_gpu_batches=2, cache_gpu_percent=0)
        with Engine(resolve_source(str(tiny_model_dir), ""), policy, cfg) as eng:
            st = eng.prefill(PROMPTS, GEN, keep_logits=True)
            eng.decode(st)
            return torch.stack(st.tokens, 1).tolist(), st.logits
    early = run(tmp_path / "a")
    assert spy["early"] == spy["prefetched"] == spy["steps"] == 2 * 2 * (GEN - 1)
    monkeypatch.setattr(cell, "early_selection", lambda *a, **kw: None)
    late = run(tmp_path / "b")
    assert early[0] == late[0]
    for a, b in zip(early[1], late[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_cache_reads_gather_the_next_reading_cell_two_cells_early():
    """With separate attention and MLP cells, the gather for layer j+1's attention is started at
    layer j's attention, not its MLP; a gather that cannot start yet (a done future of None) is
    tried again at the next cell; a started one is taken once."""
    from concurrent.futures import Future

    from flexgen_sparpr.engine.io import Done
    kinds = ["embed", "attn", "mlp", "attn", "mlp", "head"]
    plan = step_schedule(tuple(kind == "attn" for kind in kinds), 1, 1)
    reads = prefetch.CacheReads(plan.reads)
    assert [c.read for c in plan.cells] == [1, 3, 3, None, None, None]
    assert reads.may_start(0, 1) and reads.may_start(2, 3)  # the next cell, or a cell that reads nothing
    assert not reads.may_start(1, 3)  # cell 1 has no gather of its own: it may read serially, into the ring
    started = []
    reads.start(3, lambda: Done(None))  # a query-aware policy still waiting: not recorded
    assert reads.take(3) is None
    pending = Future()
    reads.start(3, lambda: started.append(3) or pending)
    reads.start(3, lambda: started.append("again") or Future())  # already started: not again
    assert reads.may_start(3, 5) if plan.cells[3].read else True
    assert started == [3] and reads.take(3) is pending and reads.take(3) is None
    reads.start(1, lambda: Future())
    assert reads.may_start(1, 3)  # cell 1 holds its own gather: cell 3's may start two cells early


def test_planned_gathers_run_ahead_while_every_reading_cell_before_holds_its_own():
    """CacheReads.further: up to `ahead` gathers beyond the computing cell's, in order, each only when
    every reading cell from the current one on holds its own; one that cannot start ends the trying."""
    from concurrent.futures import Future

    kinds = ["embed"] + ["attn", "mlp"] * 5 + ["head"]
    plan = step_schedule(tuple(kind == "attn" for kind in kinds), 1, 1)
    assert plan.reads == (1, 3, 5, 7, 9)
    reads = prefetch.CacheReads(plan.reads, ahead=2)
    assert reads.further(1) is None  # cell 1 reads and has no gather of its own yet
    reads.start(1, Future)
    assert reads.further(1) == 3
    reads.start(3, Future)
    assert reads.further(1) == 5
    reads.start(5, Future)
    assert reads.further(1) is None  # two pending beyond cell 1: the limit
    reads.take(1)
    assert reads.further(2) is None  # cell 2 (an MLP) sees 3 and 5 pending: the limit
    reads.take(3)
    assert reads.further(4) == 7  # only 5 pending beyond cell 4
    reads.no_further = True  # a gather further on could not start (a query-aware policy)
    assert reads.further(4) is None
