"""Spans: adjacent offloaded blocks one sequence reads are one request; the bytes, the values
and the generated tokens are those of block-by-block reads (TierStore.span_reads = False)."""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies import make_policy
from flexgen_sparpr.kv.tier_store import TierStore
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

C, P, D = Tier.COMPUTE, Tier.CPU, Tier.DISK
B, HKV, HD, BS = 3, 2, 32, 16  # one sequence's share of a float32 block: 2*2*16*32*4 = 8192 bytes (2 pages)


@dataclass
class UnfoldedDevices(Devices):
    """The CPU tier keeps its own arena, as on CUDA (so CPU spans run here)."""

    def effective(self, tier: Tier) -> Tier:
        return tier


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def store(request):
    root = Path(tempfile.mkdtemp(prefix="fgsp-spans-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None))
    s = DiskStore(root / "o", direct=request.param)
    yield s
    s.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def per_block(monkeypatch):
    """A switch: spans off (every block its own request) inside `with per_block():`."""
    class Switch:
        def __enter__(self):
            monkeypatch.setattr(TierStore, "span_reads", False)

        def __exit__(self, *exc):
            monkeypatch.setattr(TierStore, "span_reads", True)
    return Switch


def table(homes, store, devices=None, batch=B):
    t = BlockTable(name=f"t{id(homes)}", batch=batch, num_kv_heads=HKV, head_dim=HD, block_size=BS,
                   max_len=len(homes) * BS, dtype=torch.float32, homes=homes,
                   devices=devices or Devices(torch.device("cpu")), disk=store)
    k, v = torch.randn(2, batch, HKV, len(homes) * BS - 5, HD).unbind(0)
    for job in t.append(k, v):
        job()
    return t, torch.stack([k, v])


def reads(t, blocks, seqs):
    """gather(blocks, seqs) -> (kv, disk->cpu bytes, disk->cpu requests, cpu->compute requests)."""
    c = t.devices.counters
    c.reset()
    kv, _ = t.gather(blocks, seqs=seqs)
    return kv.clone(), c.snapshot().get("disk->cpu", 0), c.requests().get("disk->cpu", 0), \
        c.requests().get("cpu->compute", 0)


SEQS = torch.tensor([[1, 1, 1, 0, 0, 0, 1],  # sequence 0: blocks 0-2 (one span)
                     [0, 1, 1, 0, 1, 0, 1],  # sequence 1: blocks 1-2, 4 (two)
                     [1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)  # sequence 2: block 0, blocks 3-5 (two)


def test_a_span_per_sequence_run_of_adjacent_disk_blocks(store, per_block):
    t, ref = table([D] * 6 + [C], store)
    assert t.store.reads_rows(0)
    blocks = list(range(7))
    kv, nbytes, req, _ = reads(t, blocks, SEQS)
    with per_block():
        kv1, nbytes1, req1, _ = reads(t, blocks, SEQS)
    assert req == 1 + 2 + 2 and req1 == int(SEQS[:, :6].sum())
    assert nbytes == nbytes1 == t.store.seq_nbytes * int(SEQS[:, :6].sum())
    torch.testing.assert_close(kv, kv1, rtol=0, atol=0)
    for s in range(B):
        for b in range(7):
            want = ref[:, s, :, b * BS:(b + 1) * BS]
            got = kv[:, s, :, b * BS:(b + 1) * BS]
            torch.testing.assert_close(got, want if SEQS[s, b] else torch.zeros_like(want), rtol=0, atol=0)


def test_a_whole_read_is_one_request_per_sequence(store, per_block):
    t, ref = table([D] * 6 + [C], store)
    kv, nbytes, req, _ = reads(t, list(range(7)), None)
    with per_block():
        _, nbytes1, req1, _ = reads(t, list(range(7)), None)
    assert (req, req1) == (B, 6 * B) and nbytes == nbytes1 == 6 * t.store.raw.nbytes
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    _, _, req, _ = reads(t, [0, 1, 3, 4, 5, 6], None)  # block 2 left out: two spans
    assert req == 2 * B


def test_whole_block_files_read_a_span_at_once(store):
    """One sequence: the file holds whole blocks, and adjacent ones are still one request."""
    t, ref = table([D] * 5 + [C], store, batch=1)
    kv, nbytes, req, _ = reads(t, [0, 1, 2, 4, 5], None)
    assert req == 2 and nbytes == 4 * t.store.raw.nbytes
    torch.testing.assert_close(kv, torch.cat([ref[:, :, :, :3 * BS], ref[:, :, :, 4 * BS:]], 3), rtol=0, atol=0)


def test_cpu_spans_are_one_copy(per_block):
    devices = UnfoldedDevices(torch.device("cpu"))
    t, ref = table([P] * 6 + [C], None, devices=devices)
    kv, _, _, req = reads(t, list(range(7)), None)
    assert req == 1
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    kv, _, _, req = reads(t, list(range(7)), SEQS)
    with per_block():
        kv1, _, _, req1 = reads(t, list(range(7)), SEQS)
    assert (req, req1) == (5, int(SEQS[:, :6].sum()))
    torch.testing.assert_close(kv, kv1, rtol=0, atol=0)


def _copies(fn) -> int:
    """aten copy_ calls fn makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def test_resident_blocks_in_adjacent_slots_are_one_copy(store, per_block):
    """Half the KV resident: its whole blocks in adjacent compute slots copy as one run (not a
    copy per block), with the same values, beside the disk blocks' spans."""
    t, ref = table([C] * 4 + [D] * 2 + [C], store)
    blocks = list(range(7))
    run = _copies(lambda: t.gather(blocks))
    kv, _ = t.gather(blocks)
    with per_block():
        one_each = _copies(lambda: t.gather(blocks))
        kv1, _ = t.gather(blocks)
    assert one_each - run == 3  # blocks 0-3: one copy instead of four
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    torch.testing.assert_close(kv1, ref, rtol=0, atol=0)
    kv, _ = t.gather([0, 1, 3, 4, 5, 6])  # block 2 left out: two runs, placed one after the other
    torch.testing.assert_close(kv, torch.cat([ref[:, :, :, :2 * BS], ref[:, :, :, 3 * BS:]], 3), rtol=0, atol=0)


PROMPTS = [list(range(5, 70)), list(range(9, 70)), list(range(3, 66)), list(range(11, 69))]


@pytest.mark.parametrize("policy", ["dense", "sparpr"])
def test_tokens_and_bytes_equal_block_by_block(tiny_opt_dir, tmp_path, per_block, policy):
    """A generation with the KV cache on disk: spans change the requests, nothing else."""
    src = resolve_source(str(tiny_opt_dir), "")
    cfg = EngineConfig(block_size=8, offload_dir=str(tmp_path), device="cpu", dtype="float32", direct_io=True)
    runs = []
    for spans in (True, False):
        with Engine(src, Policy(gpu_batch_size=4, cache_gpu_percent=0, cache_cpu_percent=0), cfg) as eng:
            if policy != "dense":
                eng.set_kv_policy(make_policy(policy, keep_ratio=0.5, min_keep_tokens=0, quest_only=True, summary_tokens=0))
            st = eng.prefill(PROMPTS, 6)
            eng.devices.counters.reset()
            if spans:
                res = eng.decode(st)
            else:
                with per_block():
                    res = eng.decode(st)
            c = eng.devices.counters
            runs.append((res.tokens, c.snapshot()["disk->cpu"], c.requests()["disk->cpu"]))
    (tok, nbytes, req), (tok1, nbytes1, req1) = runs
    assert tok == tok1 and nbytes == nbytes1
    assert req < req1
