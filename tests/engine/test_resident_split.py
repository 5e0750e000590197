"""A whole-cache read (dense) of a cache partly resident and partly offloaded: the resident blocks
are attended in place, the disk blocks where they land as read, only the rest gathered, the parts
merged by log-sum-exp (engine/cell.py `resident_split`, engine/attention.py `with_resident_blocks`).
The same numbers as attending everything gathered: against HF, and against the gathered path on
the same table."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine import attention, cell
from flexgen_sparpr.engine.attention import decode_attention_step, gathered_rest, open_block_part, with_resident_blocks
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.models import cpu_kernel, layers
from flexgen_sparpr.storage import aio
from flexgen_sparpr.storage.disk import DiskFile, aligned_empty
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source
from tests.conftest import tiny_llama
from tests.engine.test_vs_hf import LONG, forced_logits, hf_greedy

pytestmark = pytest.mark.skipif(cpu_kernel.kernel() is None, reason="the split reads resident rows in place "
                                "through the compiled CPU kernel, which is not built on this machine")
C, D = Tier.COMPUTE, Tier.DISK
HALF = dict(cache_gpu_percent=50, cache_cpu_percent=0)  # half the KV resident, half on disk


@pytest.fixture(scope="module")
def llama64_dir(tmp_path_factory):
    """A tiny Llama whose head dim (64) the CPU kernel takes."""
    return tiny_llama(tmp_path_factory.mktemp("llama64"), hidden=256, ffn=256)


@pytest.mark.parametrize("homes, resident", [([C, C, C, D, D, C], [0, 1, 2]),  # adjacent slots: a view
                                             ([C, D, C, D, C, C], [0, 4])],  # slots 0 and 2: by rows
                         ids=["adjacent-slots", "rows"])
def test_split_attention_equals_attending_everything_gathered(tmp_path, homes, resident):
    store = DiskStore(tmp_path / "o", direct=False)
    t = BlockTable(name="t", batch=2, num_kv_heads=2, head_dim=64, block_size=4, max_len=24, dtype=torch.float32,
                   homes=homes, devices=Devices(torch.device("cpu")), disk=store)
    k, v = torch.randn(2, 2, 2, 21, 64).unbind(0)
    for job in t.append(k, v):
        job()
    q, new = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 2, 1, 64)  # new: [2, B, Hkv, 1, D]
    pads = torch.tensor([0, 5])
    full, pos = t.gather()  # every block gathered, then the new token
    ref = decode_attention_step(q, torch.cat([full, new], 3), torch.cat([pos, pos.new_tensor([21])]), None, pads)
    rest, rpos = t.gather([x for x in range(6) if x not in resident])
    got = with_resident_blocks(t, resident, q, gathered_rest(torch.cat([rest, new], 3),
                                                            torch.cat([rpos, rpos.new_tensor([21])]), None, pads), pads)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    store.close()


@pytest.mark.parametrize("length", [21, 20, 23], ids=["open-block", "no-open-block", "seals-a-disk-block"])
@pytest.mark.parametrize("open_home", [C, D], ids=["open-on-compute", "open-on-disk"])
def test_open_block_read_where_it_is_filled_equals_it_gathered(tmp_path, length, open_home):
    """The rest of a split read is the open block at most (every sealed block resident or landed):
    the new token appended to it, then read in its arena slot or the open buffer (open_block_part,
    no gather), also when the append seals it (its store job then holds a copy); what attending
    every block gathered gives, with left padding."""
    store = DiskStore(tmp_path / "o", direct=False)
    homes = [C, D, D, C, D, open_home]
    t = BlockTable(name="t", batch=2, num_kv_heads=2, head_dim=64, block_size=4, max_len=24, dtype=torch.float32,
                   homes=homes, devices=Devices(torch.device("cpu")), disk=store, store_dtype=torch.float16)
    k, v = torch.randn(2, 2, 2, length, 64).unbind(0)
    for job in t.append(k, v):
        job()
    q, new = torch.randn(2, 4, 1, 64), torch.randn(2, 2, 2, 1, 64)  # new: [2, B, Hkv, 1, D]
    pads = torch.tensor([0, 5])
    full, pos = t.gather()
    ref = decode_attention_step(q, torch.cat([full, new], 3), torch.cat([pos, pos.new_tensor([length])]), None, pads)
    disk = [1, 2, 4]
    landed = t.store.land(disk, aligned_empty((t.store.landing_bytes(3),), torch.uint8))
    b, n = t.sealed, t.length - t.sealed * 4
    jobs = t.append(new[0], new[1])
    assert bool(jobs) == (length == 23 and open_home == D)  # sealed to disk: a job, on a copy
    got = with_resident_blocks(t, [0, 3], q, open_block_part(t, b, n + 1, pads), pads, (disk, landed))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for job in jobs:
        job()
    store.close()


@pytest.mark.parametrize("batch", [1, 2], ids=["whole-block-file", "sequence-major-file"])
def test_disk_blocks_attended_where_they_land_equal_attending_them_gathered(tmp_path, batch):
    """Disk blocks read as stored (float16) into one page-aligned buffer (TierReads.land) and
    attended there, in both disk layouts, with left padding: what attending every block gathered
    gives."""
    store = DiskStore(tmp_path / "o", direct=False)
    homes = [C, D, D, C, D, C]
    t = BlockTable(name="t", batch=batch, num_kv_heads=2, head_dim=64, block_size=4, max_len=24, dtype=torch.float32,
                   homes=homes, devices=Devices(torch.device("cpu")), disk=store, store_dtype=torch.float16)
    assert t.store.lands_disk() and t.store.seq_disk == (batch > 1)
    k, v = torch.randn(2, batch, 2, 21, 64).unbind(0)
    for job in t.append(k, v):
        job()
    q, new = torch.randn(batch, 4, 1, 64), torch.randn(2, batch, 2, 1, 64)  # new: [2, B, Hkv, 1, D]
    pads = torch.tensor([0, 5][:batch])
    full, pos = t.gather()  # every block gathered, then the new token
    ref = decode_attention_step(q, torch.cat([full, new], 3), torch.cat([pos, pos.new_tensor([21])]), None, pads)
    disk = [1, 2, 4]
    landed = t.store.land(disk, aligned_empty((t.store.landing_bytes(3),), torch.uint8))
    assert landed.shape == (batch, 3, 2, 2, 4, 64)
    torch.testing.assert_close(landed.permute(2, 0, 3, 1, 4, 5).flatten(3, 4).float(), t.gather(disk)[0], rtol=0, atol=0)
    rest, rpos = t.gather([0, 3, 5])  # the resident blocks and the open one gathered
    got = with_resident_blocks(t, [], q, gathered_rest(torch.cat([rest, new], 3),
                                                      torch.cat([rpos, rpos.new_tensor([21])]), None, pads),
                               pads, (disk, landed))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    store.close()


def test_half_resident_cache_splits_and_matches_hf(llama64_dir, tmp_path, monkeypatch):
    """Half the KV resident, half on disk: the resident blocks attended in place, the disk ones
    where they land, in one kernel call with the open block where it is filled and the new token,
    nothing gathered; HF's logits."""
    calls = []
    monkeypatch.setattr(cell, "with_resident_blocks",
                        lambda t, resident, *a: calls.append((len(resident), len(a[-1][0]))) or
                        attention.with_resident_blocks(t, resident, *a))
    parts = []
    monkeypatch.setattr(attention, "kernel_decode_parts", lambda q, p: parts.append(len(p)) or
                        layers.kernel_decode_parts(q, p))
    gathers = []
    monkeypatch.setattr(cell, "gather_selection", lambda *a, **k: gathers.append(1))
    src = resolve_source(str(llama64_dir), "")
    ref_tokens, ref_logits = hf_greedy(llama64_dir, LONG)
    eng = Engine(src, Policy(gpu_batch_size=2, **HALF),
                 EngineConfig(block_size=4, dtype="float32", kv_dtype="float32", offload_dir=str(tmp_path)))
    try:
        got = forced_logits(eng, LONG, ref_tokens)
        moved = eng.devices.counters.snapshot().get("disk->cpu", 0)
    finally:
        eng.close()
    assert calls and min(n for _, n in calls) > 0  # the disk blocks were attended where they landed
    assert min(r for r, _ in calls) > 0  # the resident ones in place
    assert parts and min(parts) == 3  # with the open block where it is filled (the new token in it), in one call
    assert not gathers  # nothing gathered
    assert moved > 0  # and the others read from disk
    assert float((got - ref_logits).abs().max() / ref_logits.abs().max()) < 1e-5


def test_disk_blocks_read_in_flight_from_the_compute_thread_give_the_reader_threads_logits(llama64_dir, tmp_path,
                                                                                         monkeypatch):
    """With O_DIRECT and native AIO, the compute thread puts the disk blocks' reads in flight itself
    (KVReader._land_later: no I/O-pool task reads them, engine/cell.py Landing) and waits for them
    at the cell; where no AIO context can be had, the I/O pool reads them into the same landing
    buffer. The logits are the same either way."""
    src = resolve_source(str(llama64_dir), "")
    ref_tokens, _ = hf_greedy(llama64_dir, LONG)
    with DiskFile(tmp_path / "probe.bin", 1, 4096, direct=True) as f:
        if not f.reads_in_flight():
            pytest.skip("no O_DIRECT here (or no native AIO): the disk blocks are read by the I/O pool")
    landings = []
    real = cell.KVReader._land_later
    monkeypatch.setattr(cell.KVReader, "_land_later", lambda self, *a: landings.append(real(self, *a)) or landings[-1])

    def run(tag):
        landings.clear()
        eng = Engine(src, Policy(gpu_batch_size=2, **HALF),
                     EngineConfig(block_size=4, dtype="float32", kv_dtype="float32", offload_dir=str(tmp_path / tag),
                                  direct_io=True))
        try:
            return forced_logits(eng, LONG, ref_tokens)
        finally:
            eng.close()
    in_flight = run("aio")
    assert landings and all(isinstance(x, cell.Landing) for x in landings)
    monkeypatch.setattr(aio, "submit", lambda *a, **k: None)  # no context to be had: the I/O pool reads them
    pooled = run("pool")
    assert landings and not any(isinstance(x, cell.Landing) for x in landings)
    torch.testing.assert_close(in_flight, pooled, rtol=0, atol=0)
