"""A dense decode step starts the next step's first disk reads while its last layers, the head and
sampling run (engine/prefetch.py: CacheReads.further past the step's last reading cell, Carry): the
tokens, logits and each step's disk bytes are what they are without it, and reads carried to a
step that does not come, or finds its tables changed, are dropped."""
from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from flexgen_sparpr.engine import prefetch
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.schedule import step_schedule
from flexgen_sparpr.kv.policy import KVPolicy
from flexgen_sparpr.models import cpu_kernel
from flexgen_sparpr.storage import aio
from flexgen_sparpr.weights.resolve import resolve_source
from tests.conftest import tiny_llama
from tests.engine.test_generate import record_steps

PROMPTS = [list(range(3, 103)), list(range(120, 195))]  # the second is left-padded
GEN = 7
BLOCK = 16  # a sequence's share of a block is whole pages (packed on disk): its blocks land in flight


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory):
    """A tiny Llama whose head dim (64) the CPU kernel takes: dense's disk blocks are attended where
    they land (engine/cell.py resident_split), read in flight, counted when waited for."""
    return tiny_llama(tmp_path_factory.mktemp("llama64"), hidden=256, ffn=256)


def _o_direct(folder) -> bool:
    p = folder / "probe.bin"
    p.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(p, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        p.unlink()


def run(model_dir, tmp_path, monkeypatch, *, carry: bool, ngb: int):
    """Tokens, logits, per-step link bytes, and how many steps took carried reads."""
    if not carry:
        monkeypatch.setattr(KVPolicy, "plans_ahead", property(lambda self: False))
    taken, real_take, made, real_init = [], prefetch.Carry.take, [], prefetch.Carry.__init__

    def take(self, *a):
        got = real_take(self, *a)
        taken.append(got is not None)
        return got

    def init(self, *a):
        made.append(1)
        real_init(self, *a)
    monkeypatch.setattr(prefetch.Carry, "take", take)
    monkeypatch.setattr(prefetch.Carry, "__init__", init)
    folder = tmp_path / ("carry" if carry else "plain")
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=BLOCK, offload_dir=str(folder), direct_io=True)
    policy = Policy(gpu_batch_size=len(PROMPTS) // ngb, num_gpu_batches=ngb, cache_gpu_percent=0,
                    cache_cpu_percent=0)
    with Engine(resolve_source(str(model_dir), ""), policy, cfg) as eng:
        steps = record_steps(eng)
        st = eng.prefill(PROMPTS, GEN, keep_logits=True)
        eng.decode(st)
        assert eng._carry is None  # the last step's carried reads were dropped with the generation
    monkeypatch.undo()
    assert len(made) == len(taken)  # the generation's last step started no reads for a step to come
    return torch.stack(st.tokens, 1).tolist(), torch.stack(st.logits), steps, taken


@pytest.mark.skipif(not aio.available(), reason="carried reads land through native AIO (Linux)")
@pytest.mark.skipif(cpu_kernel.kernel() is None, reason="disk blocks land (and so carry) only where the compiled "
                    "CPU kernel attends them, which is not built on this machine")
@pytest.mark.parametrize("ngb", [1, 2])
def test_carried_reads_change_nothing_but_when_they_start(llama64_dir, tmp_path, monkeypatch, ngb):
    if not _o_direct(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT: no read lands in flight, none is carried")
    tokens, logits, steps, taken = run(llama64_dir, tmp_path, monkeypatch, carry=True, ngb=ngb)
    tokens0, logits0, steps0, taken0 = run(llama64_dir, tmp_path, monkeypatch, carry=False, ngb=ngb)
    assert tokens == tokens0
    assert torch.equal(logits, logits0)
    assert steps == steps0  # each step counts the bytes it attends, read when they were
    assert taken and all(taken)  # every decode step after the first took the reads carried to it
    assert len(taken) == GEN - 2  # prefill, then GEN - 1 decode steps: all but the first take a carry
    assert not any(taken0)


class _Read(Future):
    def __init__(self):
        super().__init__()
        self.dropped = False

    def drop(self):
        self.dropped = True


class _Table:
    def __init__(self, length=10, rewinds=0):
        self.length, self.rewinds = length, rewinds


def test_a_carry_is_taken_only_by_the_step_it_was_started_for():
    plan = step_schedule((False, True, False, True, False), 1, 1)
    policy, t = object(), _Table()
    for change, usable in [(None, True), ("length", False), ("rewinds", False), ("table", False),
                           ("policy", False), ("plan", False)]:
        reads = {1: _Read()}
        carry = prefetch.Carry(reads, plan, policy, {(1, 0): t})
        t.length, t.rewinds = 10, 0
        tables, pol, pl = {(1, 0): t}, policy, plan
        if change == "length":
            t.length = 11
        elif change == "rewinds":
            t.rewinds = 1
        elif change == "table":
            tables = {(1, 0): _Table()}
        elif change == "policy":
            pol = object()
        elif change == "plan":
            pl = step_schedule((False, True, True, False), 1, 1)
        got = carry.take(pl, pol, tables)
        assert (got == reads) if usable else got is None, change
        assert reads[1].dropped != usable, change


def test_past_the_last_reading_cell_further_goes_on_into_the_next_step():
    kinds = ["embed"] + ["attn", "mlp"] * 3 + ["head"]
    plan = step_schedule(tuple(kind == "attn" for kind in kinds), 1, 1)
    assert plan.reads == (1, 3, 5)
    span = len(plan.cells)
    reads = prefetch.CacheReads(plan.reads, ahead=2, span=span)
    for m in plan.reads:
        reads.start(m, Future)
    reads.take(1)
    reads.take(3)
    assert reads.further(4) is None  # beyond=None: no next step
    assert reads.further(4, lambda m: False) is None  # the next step's first may not start yet
    assert reads.further(4, lambda m: True) == span + 1  # 5 pending: one more under ahead 2
    reads.start(span + 1, Future)
    assert reads.further(4, lambda m: True) is None  # 5 and the next step's 1: the limit
    reads.take(5)
    assert reads.further(6, lambda m: m < 5) == span + 3
    f = Future()
    reads.start(span + 3, lambda: f)
    assert set(reads.carried()) == {1, 3} and reads.carried()[3] is f
    nxt = prefetch.CacheReads(plan.reads, ahead=2, span=span, pending=reads.carried())
    assert nxt.pending == reads.carried() and nxt.take(3) is f
