"""BlockTable: appends across blocks, gathers (order, positions, subsets, the resident view),
homes on every tier round-tripping, compressed homes, capacity, mark/rewind."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Devices, Tier

C, P, D = Tier.COMPUTE, Tier.CPU, Tier.DISK
B, HKV, HD = 2, 3, 16


@dataclass
class UnfoldedDevices(Devices):
    """A CPU machine laid out like a CUDA one: the CPU tier keeps its own arena (so the
    CPU-home store/load code runs here too)."""

    def effective(self, tier: Tier) -> Tier:
        return tier


@pytest.fixture
def disk(tmp_path):
    store = DiskStore(tmp_path / "offload")
    yield store
    store.close()


def make(homes, bs=4, max_len=None, *, compress=False, devices=None, disk=None, name="t"):
    return BlockTable(name=name, batch=B, num_kv_heads=HKV, head_dim=HD, block_size=bs,
                      max_len=max_len or len(homes) * bs, dtype=torch.float32, homes=list(homes),
                      devices=devices or Devices(torch.device("cpu")), disk=disk, compress=compress)


def fill(table, sizes, seed=0):
    """Append chunks of the given sizes (running the store jobs); returns the reference kv
    [2, B, Hkv, T, D] and the number of store jobs each append returned."""
    g = torch.Generator().manual_seed(seed)
    ks, vs, njobs = [], [], []
    for s in sizes:
        k = torch.randn(B, HKV, s, HD, generator=g)
        v = torch.randn(B, HKV, s, HD, generator=g)
        jobs = table.append(k, v)
        njobs.append(len(jobs))
        for j in jobs:
            j()
        ks.append(k)
        vs.append(v)
    return torch.stack([torch.cat(ks, 2), torch.cat(vs, 2)]), njobs


def block_of(ref, b, bs):
    return ref[:, :, :, b * bs:(b + 1) * bs]


# --- writing and reading in order ---------------------------------------------------------
@pytest.mark.parametrize("sizes", [[6, 1, 1, 3, 5], [1] * 16, [16], [4, 4, 4, 4], [3, 13]])
def test_append_across_block_boundaries(sizes):
    t = make([C] * 4, bs=4)
    ref, _ = fill(t, sizes)
    assert t.length == 16 and t.num_blocks == 4
    kv, pos = t.gather()
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    assert pos.tolist() == list(range(16))


def test_partial_tail_block():
    t = make([C] * 3, bs=4, max_len=12)
    ref, _ = fill(t, [7, 3])
    assert t.length == 10 and t.num_blocks == 3
    assert [t.block_len(b) for b in range(3)] == [4, 4, 2]
    kv, pos = t.gather()
    assert kv.shape == (2, B, HKV, 10, HD)
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    kv2, pos2 = t.gather([2])
    torch.testing.assert_close(kv2, ref[:, :, :, 8:10], rtol=0, atol=0)
    assert pos2.tolist() == [8, 9]


def test_partial_tail_of_an_offloaded_block_is_read_from_the_tail(disk):
    t = make([D, D, D], bs=4, disk=disk)
    ref, njobs = fill(t, [5, 1])
    assert njobs == [1, 0]  # only block 0 sealed
    kv, pos = t.gather()
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    assert pos.tolist() == list(range(6))


def test_resident_fast_path_returns_a_view_of_the_arena():
    t = make([C] * 4, bs=4)
    assert t.store.resident
    ref, njobs = fill(t, [5, 2])
    assert njobs == [0, 0]  # raw compute homes need no store job
    kv, pos = t.gather()
    arena = t.store._arena[Tier.COMPUTE]
    assert kv.data_ptr() == arena.data_ptr()  # no copy
    assert kv.shape[3] == 7
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    assert pos.tolist() == list(range(7))
    # a subset is a copy, not a view
    sub, _ = t.gather([0])
    assert sub.data_ptr() != arena.data_ptr()


@pytest.mark.parametrize("homes", [[C] * 4, [D, D, C, C]])
def test_subset_gather_order_and_positions(homes, disk):
    t = make(homes, bs=4, disk=disk)
    ref, _ = fill(t, [14])
    for blocks in ([0, 2], [1, 3], [3], [0, 1, 2, 3], []):
        kv, pos = t.gather(blocks)
        want_pos = [p for b in blocks for p in range(b * 4, min(b * 4 + 4, 14))]
        assert pos.tolist() == want_pos
        assert kv.shape[3] == len(want_pos)
        torch.testing.assert_close(kv, ref[:, :, :, want_pos], rtol=0, atol=0)


@pytest.mark.parametrize("homes", [[C] * 4, [D, C, D, C]])
def test_views_equal_gather_and_copy_only_what_is_not_on_compute(homes, disk):
    """views(): a block on compute raw or the open block comes as a view of where it lives; runs of
    the others are gathered; together they hold what gather() gives, in order."""
    t = make(homes, bs=4, disk=disk)
    ref, _ = fill(t, [14])
    for blocks in ([0, 1, 2, 3], [0, 3], [1, 2], [2]):
        got = t.views(blocks)
        kv = torch.cat([v for v, _ in got], dim=3)
        pos = torch.cat([p for _, p in got])
        want, want_pos = t.gather(blocks)
        torch.testing.assert_close(kv, want, rtol=0, atol=0)
        assert pos.tolist() == want_pos.tolist()
        for v, p in got:
            on_compute = all(homes[i // 4] == C or i // 4 == 3 for i in p.tolist())  # block 3: the open one
            shares = v.untyped_storage().data_ptr() in (t.store._arena[C].untyped_storage().data_ptr(),
                                                        t.store._tail.untyped_storage().data_ptr())
            assert shares == on_compute
    assert len(t.views([0, 1, 2, 3])) == 4  # a view per block on compute, a gather per run of the rest


def test_gather_into_a_larger_out_buffer(disk):
    t = make([D, C, C], bs=4, disk=disk)
    ref, _ = fill(t, [9])
    out = torch.full((2, B, HKV, 20, HD), float("nan"))
    kv, pos = t.gather([0, 2], out)
    assert kv.data_ptr() == out.data_ptr()  # filled in place, trimmed to the gathered tokens
    assert kv.shape[3] == 5
    torch.testing.assert_close(kv, ref[:, :, :, [0, 1, 2, 3, 8]], rtol=0, atol=0)


def test_capacity_overflow_raises():
    t = make([C] * 3, bs=4, max_len=10)
    assert t.capacity == 12
    fill(t, [12])
    with pytest.raises(ValueError, match="full"):
        t.append(torch.zeros(B, HKV, 1, HD), torch.zeros(B, HKV, 1, HD))
    assert t.length == 12
    t2 = make([C] * 3, bs=4, max_len=10)
    with pytest.raises(ValueError):
        t2.append(torch.zeros(B, HKV, 13, HD), torch.zeros(B, HKV, 13, HD))
    assert t2.length == 0


def test_construction_errors(disk):
    with pytest.raises(ValueError, match="homes"):
        make([C, C], bs=4, max_len=9)
    with pytest.raises(ValueError, match="disk"):
        make([D, C], bs=4, disk=None)


# --- homes on every tier ------------------------------------------------------------------
@pytest.mark.parametrize("devices_cls", [Devices, UnfoldedDevices])
def test_disk_and_cpu_homes_round_trip_exactly(devices_cls, disk):
    devices = devices_cls(torch.device("cpu"))
    homes = [D, D, P, P, C, C]
    t = make(homes, bs=4, devices=devices, disk=disk)
    assert not t.store.resident
    ref, njobs = fill(t, [5, 3, 1, 9, 4])  # 22 tokens: 5 sealed blocks + 2 in the tail
    sealed_off_compute = sum(1 for b in range(5) if t.homes[b] != C)
    assert sum(njobs) == sealed_off_compute
    kv, pos = t.gather()
    torch.testing.assert_close(kv, ref, rtol=0, atol=0)
    assert pos.tolist() == list(range(22))
    for b in range(5):  # every block alone, too
        kvb, _ = t.gather([b])
        torch.testing.assert_close(kvb, block_of(ref, b, 4), rtol=0, atol=0)


def test_link_counters_per_home(disk):
    devices = UnfoldedDevices(torch.device("cpu"))
    t = make([D, D, P, C], bs=4, devices=devices, disk=disk)
    fill(t, [16])
    nb = 2 * B * HKV * 4 * HD * 4  # one raw float32 block
    snap = devices.counters.snapshot()
    assert snap.get("cpu->disk", 0) == 2 * nb  # two blocks stored to disk
    assert snap.get("compute->cpu", 0) == 1 * nb  # one block stored to the CPU arena
    devices.counters.reset()
    t.gather()
    snap = devices.counters.snapshot()
    assert snap.get("disk->cpu", 0) == 2 * nb
    assert snap.get("cpu->compute", 0) == 1 * nb
    assert t.nbytes_on(D) == 2 * nb and t.nbytes_on(P) == nb and t.nbytes_on(C) == nb


def _quant_bound(ref_block):
    """4-bit asymmetric quantisation along head_dim (one group here, head_dim < 64):
    |x - x^| <= (max - min) / 15 / 2 per row, plus float slack."""
    rng = ref_block.amax(-1, keepdim=True) - ref_block.amin(-1, keepdim=True)
    return rng / 30 + 1e-6


@pytest.mark.parametrize("devices_cls", [Devices, UnfoldedDevices])
def test_compressed_homes_round_trip_within_quantisation_error(devices_cls, disk):
    devices = devices_cls(torch.device("cpu"))
    t = make([D, D, P, C, C], bs=4, devices=devices, disk=disk, compress=True)
    assert not t.store.resident and t.store.codec.compressed
    ref, njobs = fill(t, [6, 7, 5])  # 18 tokens: 4 sealed blocks + 2 raw in the tail
    assert sum(njobs) == 4  # compressed blocks are stored on every tier, compute included
    kv, pos = t.gather()
    assert pos.tolist() == list(range(18))
    err = (kv - ref).abs()
    assert bool((err <= _quant_bound(ref)).all())
    assert err[:, :, :, :16].max() > 0  # really quantised
    torch.testing.assert_close(kv[:, :, :, 16:], ref[:, :, :, 16:], rtol=0, atol=0)  # raw tail
    assert t.nbytes_on(D) == 2 * t.store.codec.nbytes
    raw = 2 * B * HKV * 4 * HD * 4
    assert t.store.codec.nbytes < raw


def test_on_seal_hooks_see_each_sealed_block_in_order(disk):
    t = make([D, C, C], bs=4, disk=disk)
    seen = []
    t.on_seal.append(lambda b, kv: seen.append((b, kv.clone())))
    ref, _ = fill(t, [3, 3, 4, 1])
    assert [b for b, _ in seen] == [0, 1]
    for b, kv in seen:
        torch.testing.assert_close(kv, block_of(ref, b, 4), rtol=0, atol=0)


@pytest.mark.parametrize("homes", [[C] * 4, [D, D, D, C]])
def test_mark_and_rewind(homes, disk):
    t = make(homes, bs=4, disk=disk)
    first, _ = fill(t, [6], seed=1)
    m = t.mark()
    fill(t, [7], seed=2)  # overwrites the tail and seals blocks 1, 2
    t.rewind(m)
    assert t.length == 6
    second, _ = fill(t, [5], seed=3)
    kv, pos = t.gather()
    torch.testing.assert_close(kv, torch.cat([first, second], 3), rtol=0, atol=0)
    assert pos.tolist() == list(range(11))


def test_close_removes_the_disk_file(disk):
    t = make([D, C], bs=4, disk=disk, name="x")
    path = t.store.disk_file.path
    assert path.exists()
    t.close()
    t.close()  # twice is fine
    assert not path.exists()


# --- per-sequence reads ---------------------------------------------------------------------
@pytest.mark.parametrize("devices_cls", [Devices, UnfoldedDevices])
def test_gather_with_seqs_reads_only_the_needed_rows(devices_cls, disk):
    """Raw disk and CPU blocks move only the rows of the sequences that need them; the other
    rows are zeros, never stale data; compute blocks and the open block come whole."""
    devices = devices_cls(torch.device("cpu"))
    t = make([P, D, P, D, C], bs=4, devices=devices, disk=disk)
    ref, _ = fill(t, [18])  # blocks 0-3 sealed, block 4 open (2 tokens)
    seqs = torch.tensor([[True, False, False, True, True],
                         [False, False, True, True, False]])  # seqs: [B, 5]
    devices.counters.reset()
    kv, pos = t.gather(list(range(5)), seqs=seqs)
    assert pos.tolist() == list(range(18))
    for b in range(5):
        for s in range(B):
            got, want = kv[:, s, :, b * 4:(b + 1) * 4], ref[:, s, :, b * 4:(b + 1) * 4]
            whole = b == 4 or not t.store.reads_rows(b)
            torch.testing.assert_close(got, want if whole or seqs[s, b] else torch.zeros_like(want), rtol=0, atol=0)
    snap = devices.counters.snapshot()
    row = 2 * HKV * 4 * HD * 4  # one sequence's rows of a raw float32 block
    assert t.store.seq_nbytes == row and t.store.read_bytes(3, 2) == 2 * row
    assert snap.get("disk->cpu", 0) == row * (0 + 2)  # block 1: nobody, block 3: both
    assert snap.get("cpu->compute", 0) == (row * (1 + 1) if devices_cls is UnfoldedDevices else 0)


def test_o_direct_per_sequence_reads_need_aligned_rows(tmp_path):
    """Under O_DIRECT a sequence's rows are read alone only when they fill whole 4096-byte pages;
    otherwise the block moves whole (and read_bytes says so)."""
    store = DiskStore(tmp_path / "o", direct=True)
    try:
        for hd, aligned in ((32, True), (12, False)):  # 2*2*16*hd*4 bytes: 8192 or 3072 per sequence
            t = BlockTable(name=f"d{hd}", batch=3, num_kv_heads=2, head_dim=hd, block_size=16, max_len=48,
                           dtype=torch.float32, homes=[D] * 3, devices=Devices(torch.device("cpu")), disk=store)
            k, v = torch.randn(2, 3, 2, 40, hd).unbind(0)
            for job in t.append(k, v):
                job()
            if t.store.disk_file.direct_mode != "o_direct":
                pytest.skip(f"{tmp_path} refuses O_DIRECT")
            assert t.store.reads_rows(0) == aligned
            seqs = torch.tensor([[True, False], [False, False], [True, True]])
            t.devices.counters.reset()
            kv, _ = t.gather([0, 1], seqs=seqs)
            full = t.store.raw.nbytes
            want = t.store.seq_nbytes * 3 if aligned else 2 * full
            assert t.devices.counters.snapshot()["disk->cpu"] == want
            torch.testing.assert_close(kv[0, 2], k[2, :, :32], rtol=0, atol=0)
            torch.testing.assert_close(kv[1, 0, :, :16], v[0, :, :16], rtol=0, atol=0)
            if aligned:
                assert not kv[:, 1].any() and not kv[:, 0, :, 16:].any()
    finally:
        store.close()


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "reader-copies"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_scattered_per_sequence_disk_reads_land_where_they_belong(tmp_path, placed, direct, monkeypatch):
    """A selection's scattered runs, per sequence, short and long (a run of BIG_RUN blocks goes
    through its reader's copy): the same bytes in the same places whether the short runs are placed
    by one indexed copy or copied by their readers; the stored dtype converted on the way."""
    from flexgen_sparpr.kv import tier_reads, tier_store
    monkeypatch.setattr(tier_store.TierStore, "placed_reads", placed)
    store = DiskStore(tmp_path / "offload", direct=direct)
    try:
        n, bs, hd = 24, 16, 64  # a sequence's share of a float16 block: 2 x 2 x 16 x 64 x 2 = 8 KiB (pages)
        t = BlockTable(name="s", batch=B, num_kv_heads=HKV, head_dim=hd, block_size=bs, max_len=n * bs,
                       dtype=torch.float32, homes=[Tier.DISK] * n, devices=Devices(torch.device("cpu")), disk=store,
                       store_dtype=torch.float16)
        g = torch.Generator().manual_seed(1)
        k, v = torch.randn(2, B, HKV, n * bs - 3, hd, generator=g)
        for job in t.append(k, v):
            job()
        ref = torch.stack([k, v]).half().float()  # what float16 storage keeps
        blocks = [0, 2, 3, 5, *range(8, 8 + tier_reads.BIG_RUN), 17, 19, 20, 23]
        seqs = torch.tensor([[i % 3 != 1 for i in range(len(blocks))],
                             [i % 2 == 0 or 8 <= blocks[i] < 16 for i in range(len(blocks))]])  # [B, n]
        kv, pos = t.gather(blocks, seqs=seqs)
        for x, b in enumerate(blocks):
            for s in range(B):
                got = kv[:, s, :, x * bs:x * bs + t.block_len(b)]
                want = ref[:, s, :, b * bs:b * bs + t.block_len(b)]
                whole = b == n - 1  # the open block: on compute, whole, in the compute dtype
                exp = torch.stack([k, v])[:, s, :, b * bs:b * bs + t.block_len(b)] if whole else \
                    (want if seqs[s, x] else torch.zeros_like(want))
                torch.testing.assert_close(got, exp, rtol=0, atol=0)
    finally:
        store.close()
