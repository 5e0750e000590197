"""The bytes of one block table, and the only code that moves them.

Each sealed block lives on its home tier: raw in an arena per tier ([planes, B, Hkv, n*bs, D]
on compute, pinned host memory for the CPU tier), encoded as rows of codec.nbytes bytes on the
tiers the codec covers, or in a slot of the table's disk file. The open block is filled in a
buffer on compute (or in place in its compute arena slot). Storing a sealed block home and
reading blocks to the compute device happen here, each move counted per link
(`devices.counters`); the block table (kv/block_table.py) decides which blocks and where.

Raw blocks on disk are stored sequence-major: the file holds one region per sequence, in which
its share of each disk block ([planes, Hkv, bs, D]) follows the previous block's. So a read that
only some sequences need (a per-sequence selection) moves only their bytes, and adjacent blocks
one sequence selected are one read request (a span). Where a sequence's share cannot be read alone
(one sequence, or O_DIRECT with shares that are not whole pages) the file holds whole blocks
([B, planes, Hkv, bs, D] each), and adjacent blocks are still one request. Raw CPU blocks are
sliced in place, a span of them one copy. Encoded blocks always move whole. The link counters
count the bytes and the requests (`LinkCounters.requests`).
"""
from __future__ import annotations

import itertools

import torch

from ..storage.codec import Codec, RawCodec
from ..storage.disk import ALIGN, aligned_empty
from ..storage.tiers import Devices, Tier
from .disk_reads import read_disk, read_raw_disk

BIG_RUN = 8  # blocks: a disk run this long is copied out by its reader; shorter ones together, by index


class TierStore:
    span_reads = True  # False: every block is a request of its own (what spans are compared with)
    placed_reads = True  # False: each raw disk run copied out by its reader (what one indexed copy is compared with)

    def __init__(self, *, name: str, block_shape: tuple[int, ...], dtype: torch.dtype, homes: list[Tier],
                 slots: list[int], devices: Devices, disk=None, codec: Codec,
                 coded_tiers: tuple[Tier, ...] | None = None, store_dtype: torch.dtype | None = None):
        self.block_shape, self.dtype, self.devices = block_shape, dtype, devices
        # raw blocks homed on the CPU and disk tiers are stored in store_dtype (--kv-dtype: float16
        # halves the bytes every offloaded read moves), converted on compute; compute-tier blocks,
        # the open block and what gather returns are in the compute dtype
        self.store_dtype = store_dtype or dtype
        self.homes, self.slots = homes, slots  # per block: home tier, index among its tier's blocks
        planes, batch, h, bs, d = block_shape
        self.bs = bs
        self.raw = RawCodec(block_shape, dtype)
        self.stored_raw = RawCodec(block_shape, self.store_dtype)  # a raw block on the CPU or disk tier
        self.codec = codec  # how the coded tiers' blocks are stored (what a copy from them moves)
        # tiers whose sealed blocks are stored encoded (default: every tier, when the codec encodes)
        self.coded = frozenset() if not codec.compressed else frozenset(coded_tiers or tuple(Tier))
        # exact copies of the newest sealed encoded blocks (a lossy codec's recency window), on compute
        self._exact: dict[int, torch.Tensor] = {}
        # the codec's per-block hints (`codec.takes_hints`: DKV's token importance [B, bs]), set
        # before the block's store job runs (a prefill's on_prefill hooks run before its store
        # jobs are submitted), used once
        self.hints: dict[int, torch.Tensor] = {}
        # also keep each encoded block's exact rows (codec.exact_rows) on compute, for a policy that
        # attends them without moving the block (set before blocks are stored)
        self.hold_exact_rows = False
        self._exact_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (idx [B, m], kv)
        n = {t: homes.count(t) for t in Tier}
        dev = devices.compute
        self._arena, self._rows, self._disk, self._disk_store = {}, {}, None, disk
        for tier in (Tier.COMPUTE, Tier.CPU):
            if not n[tier]:
                continue
            if tier in self.coded:
                shape = (n[tier], self.codec.nbytes)
                self._rows[tier] = (torch.empty(shape, dtype=torch.uint8, device=dev) if tier == Tier.COMPUTE
                                    else devices.host.arena(shape, torch.uint8))
            else:
                shape = (planes, batch, h, n[tier] * bs, d)
                self._arena[tier] = (torch.zeros(shape, dtype=dtype, device=dev) if tier == Tier.COMPUTE
                                     else devices.host.arena(shape, self.store_dtype))
        self._tail = torch.zeros(block_shape, dtype=dtype, device=dev)
        self.seq_nbytes = self.stored_raw.nbytes // batch  # one sequence's share of a raw block
        # raw disk blocks are stored (and read) a sequence at a time (O_DIRECT: offsets on 4096 bytes)
        self._seq_disk = (n[Tier.DISK] > 0 and Tier.DISK not in self.coded and batch > 1 and disk is not None and
                          (self.seq_nbytes % ALIGN == 0 or not disk.direct))
        self._n_disk = n[Tier.DISK]
        if n[Tier.DISK]:
            if disk is None:
                raise ValueError("KV blocks placed on disk but no --offload-dir store was given")
            groups, piece = (batch, self.seq_nbytes) if self._seq_disk else (1, self.codec_of(Tier.DISK).nbytes)
            self._disk = disk.new_file(f"kv-{name}", n[Tier.DISK] * groups, piece, packed=True)
        self.resident = Tier.COMPUTE not in self.coded and all(t == Tier.COMPUTE for t in homes)

    # --- facts ---
    def codec_of(self, tier: Tier) -> Codec:
        """The codec of the blocks homed on a tier."""
        if tier in self.coded:
            return self.codec
        return self.raw if tier == Tier.COMPUTE else self.stored_raw

    def is_raw_on_compute(self, b: int) -> bool:
        return self.homes[b] == Tier.COMPUTE and Tier.COMPUTE not in self.coded

    def reads_rows(self, b: int) -> bool:
        """Whether a copy of sealed block b can move some of its sequences only."""
        return self.reads_rows_on(self.homes[b])

    def reads_rows_on(self, home: Tier) -> bool:
        """Whether a copy of a sealed block homed on this tier can move some of its sequences only."""
        return home not in self.coded and (home == Tier.CPU or (home == Tier.DISK and self._seq_disk))

    def read_bytes(self, b: int, nseq: int) -> int:
        """Bytes a copy of sealed block b for nseq of its sequences moves from its home."""
        full = self.codec_of(self.homes[b]).nbytes
        return self.seq_nbytes * nseq if self.reads_rows(b) else full

    def nbytes_on(self, tier: Tier, sealed: int) -> int:
        """Bytes of the first `sealed` blocks homed on a tier (for reports)."""
        return self.codec_of(tier).nbytes * sum(1 for b in range(sealed) if self.homes[b] == tier)

    @property
    def disk_file(self):
        """The table's disk file (storage/disk.py), or None."""
        return self._disk

    @property
    def disk_store(self):
        """The offload folder's store (its readers and read depth), or None."""
        return self._disk_store

    @property
    def seq_disk(self) -> bool:
        """Whether raw disk blocks are stored (and read) a sequence at a time."""
        return self._seq_disk

    # --- writing ---
    def in_place(self, b: int) -> torch.Tensor:
        """Raw block b where it lives (its arena slot): [planes, B, Hkv, bs, D], no copy."""
        s = self.slots[b] * self.bs
        return self._arena[self.homes[b]][:, :, :, s:s + self.bs]

    def on_host(self, b: int) -> torch.Tensor:
        """CPU-homed block b, raw, on the host: its arena slot (no copy), or its encoded row decoded
        there (--compress-cache and --cold-codec store the CPU tier encoded: it has no raw arena)."""
        if Tier.CPU in self.coded:
            return self.codec.decode(self._rows[Tier.CPU][self.slots[b]])
        return self.in_place(b).to(self.dtype)

    def writable(self, b: int) -> torch.Tensor:
        """Where block b is filled: its arena slot if it lives raw on compute, else the open buffer."""
        if self.homes[b] == Tier.COMPUTE and Tier.COMPUTE in self._arena:
            return self.in_place(b)
        return self._tail

    def seal(self, b: int, kv: torch.Tensor):
        """Block b, now full in kv (writable(b)), goes home: returns its store job (run it on the
        I/O pool; wait for it before the next read), or None when it is home already."""
        self._exact_rows.pop(b, None)  # a rewound run's rows for this block are stale; its store refills
        home = self.homes[b]
        if home == Tier.COMPUTE and home not in self.coded:
            return None
        first, recent = self.codec.exact_first, self.codec.exact_recent
        if (recent or b < first) and home in self.coded:
            self._exact[b] = kv.clone()
            later = sorted(x for x in self._exact if x >= first)  # the first blocks stay
            for old in later[:-(recent + 1)]:  # one spare survives a rewind
                del self._exact[old]
        blk = kv.clone()  # the open buffer is reused at once; the store reads a private copy
        return lambda: self._store(b, blk)

    def _store(self, b: int, blk: torch.Tensor) -> None:
        home, slot, dev = self.homes[b], self.slots[b], self.devices
        hint = self.hints.pop(b, None)
        if home not in self.coded:
            data = blk.to(self.store_dtype)  # converted on compute: the link moves the stored bytes
        else:
            data = self.codec.encode(blk, hint)
            rows = self.codec.exact_rows(data) if self.hold_exact_rows else None
            if rows is not None:  # on compute, like the block's summaries; made on the I/O stream
                self._exact_rows[b] = dev.streams.hand_off(rows)
        if home == Tier.DISK:
            if home in self.coded:
                host, pieces = data.cpu(), 1
                self._disk.write(slot, host)
            else:  # [B, planes, Hkv, bs, D]: each sequence's share apart, page-aligned for O_DIRECT
                host = aligned_empty((data.shape[1], data.shape[0], *data.shape[2:]), data.dtype)
                host.copy_(data.transpose(0, 1))
                pieces = host.shape[0] if self._seq_disk else 1
                for r in range(pieces):
                    self._disk.write(r * self._n_disk + slot, host[r] if self._seq_disk else host)
            if dev.is_cuda:
                dev.counters.add("compute", "cpu", host.nbytes)
            dev.counters.add("cpu", "disk", host.nbytes, requests=pieces)
        elif home in self.coded:
            if home == Tier.CPU:
                dev.host.to_host(self._rows[home][slot], data)
                dev.counters.add("compute", "cpu", data.nbytes)
            else:
                self._rows[home][slot].copy_(data)
        else:  # raw on the CPU tier
            s = slot * self.bs
            dev.host.to_host(self._arena[home][:, :, :, s:s + self.bs], data)
            dev.counters.add("compute", "cpu", data.nbytes)

    # --- reading ---
    def resident_arena(self) -> torch.Tensor:
        """A wholly resident cache's arena, every slot: [planes, B, Hkv, capacity, D], contiguous."""
        return self._arena[Tier.COMPUTE]

    def resident_view(self, length: int) -> torch.Tensor:
        """A wholly resident cache's first `length` tokens, as a view: [planes, B, Hkv, length, D]."""
        return self._arena[Tier.COMPUTE][:, :, :, :length]

    def gather(self, blocks: list[int], lens: list[int], sealed: int, out: torch.Tensor | None,
               need: list[list[bool]] | None, zero_unread: bool) -> torch.Tensor:
        """Blocks (of lens tokens each; the first `sealed` blocks are sealed) into out (made when
        None or short): [planes, B, Hkv, T, D] on compute. need: [n][B], the sequences that need
        each block (None: all); see BlockTable.gather. Adjacent offloaded blocks go as spans."""
        total = sum(lens)
        if out is None or out.shape[3] < total:
            out = torch.empty((*self.block_shape[:3], total, self.block_shape[4]), dtype=self.dtype,
                              device=self.devices.compute)
        starts = list(itertools.accumulate(lens, initial=0))
        disk_reads: list = []  # encoded disk spans: (first slot, slots, sink)
        # raw disk runs (first slot, slots, first row, first block), read as ranges of a packed file
        raw_reads = [] if self.placed_reads and self._disk is not None and self._disk.is_packed else None
        i = 0
        while i < len(blocks):
            b, n, t = blocks[i], lens[i], starts[i]
            dst = out[:, :, :, t:t + n]
            exact = self._exact_copy(b, sealed)
            if n < self.bs:  # the partial open block is still on compute
                dst.copy_(self.writable(b)[:, :, :, :n])
            elif self.is_raw_on_compute(b):
                dst.copy_(self.in_place(b))
            elif need is not None and not any(need[i]) and b in self._exact_rows:
                self._fill_exact_rows(b, dst, zero_unread)  # no sequence reads it whole: nothing moves
            elif exact is not None:  # a first or recent block kept exact: the copy, nothing crosses a link
                dst.copy_(exact)
            elif self.homes[b] == Tier.DISK or self.homes[b] not in self.coded:  # disk, or raw CPU
                j = self._span_end(blocks, i, sealed, need)
                self._read_span(blocks[i:j], out[:, :, :, t:starts[j]], None if need is None else need[i:j],
                                zero_unread, disk_reads, raw_reads, t)
                i = j
                continue
            else:  # an encoded row on compute or the CPU
                row = self._rows[self.homes[b]][self.slots[b]]
                if self.homes[b] == Tier.CPU:
                    row = self.devices.host.to_compute_new(row)
                    self.devices.counters.add("cpu", "compute", row.nbytes)
                dst.copy_(self.codec.decode(row))
            i += 1
        if disk_reads:
            read_disk(self, disk_reads)
        if raw_reads:
            read_raw_disk(self, raw_reads, out)
        return out[:, :, :, :total]

    def view(self, b: int, n: int, sealed: int) -> torch.Tensor | None:
        """Block b's first n tokens on compute with no copy, [planes, B, Hkv, n, D]: the open block's
        buffer, a raw block in the compute arena, or the exact copy kept of an encoded block; else
        None (it must be gathered)."""
        if n < self.bs:
            return self.writable(b)[:, :, :, :n]
        if self.is_raw_on_compute(b):
            return self.in_place(b)
        return self._exact_copy(b, sealed)

    def _exact_copy(self, b: int, sealed: int) -> torch.Tensor | None:
        """The exact copy kept of encoded block b (the codec's first and recent blocks), or None."""
        if b < self.codec.exact_first or b >= sealed - self.codec.exact_recent:
            return self._exact.get(b)
        return None

    def _span_end(self, blocks: list[int], i: int, sealed: int, need: list[list[bool]] | None) -> int:
        """End (exclusive) of the span of gather entries from i: adjacent sealed blocks of one home,
        stored one after the other (a CPU arena always; a disk file when packed), none of them read
        from an exact copy instead."""
        home, j = self.homes[blocks[i]], i + 1
        if not self.span_reads or (home == Tier.DISK and not self._disk.is_packed):
            return j
        while (j < len(blocks) and blocks[j] == blocks[j - 1] + 1 and blocks[j] < sealed and
               self.homes[blocks[j]] == home and self._exact_copy(blocks[j], sealed) is None and
               not (need is not None and not any(need[j]) and blocks[j] in self._exact_rows)):
            j += 1
        return j

    def _read_span(self, span: list[int], out: torch.Tensor, need: list[list[bool]] | None, zero_unread: bool,
                   disk_reads: list, raw_reads: list | None = None, at: int = -1) -> None:
        """Adjacent sealed blocks of one home (disk, or raw CPU) into out: [planes, B, Hkv, k*bs, D].
        One request per run of blocks a sequence needs (disk, sequence-major), or per span for all
        sequences (CPU and whole-block disk files, when every sequence needs every block); a disk
        request is queued on disk_reads."""
        home, k, bs, b_all = self.homes[span[0]], len(span), self.bs, self.block_shape[1]
        if home in self.coded:  # encoded disk blocks: one request, decoded block by block
            nb = self.codec.nbytes
            disk_reads.append((self.slots[span[0]], k, lambda data: [
                out[:, :, :, x * bs:(x + 1) * bs].copy_(self.codec.decode(data[x * nb:(x + 1) * nb]))
                for x in range(k)]))
            return
        whole = need is None or not self.reads_rows(span[0]) or all(all(x) for x in need)
        if whole and (home == Tier.CPU or not self._seq_disk):
            runs = [((0, b_all), 0, k)]
        else:
            if zero_unread and not whole:
                for x in range(k):
                    for r0, r1 in _runs([not v for v in need[x]]):
                        out[:, r0:r1, :, x * bs:(x + 1) * bs].zero_()  # rows no sequence reads: zeros, never garbage
            runs = [((r, r + 1), a, e) for r in range(b_all)
                    for a, e in _runs([whole or need[x][r] for x in range(k)])]
        for (r0, r1), a, e in runs:
            dst = out[:, r0:r1, :, a * bs:e * bs]
            if home == Tier.CPU:
                s = self.slots[span[a]] * bs
                src = self._arena[Tier.CPU][:, r0:r1, :, s:s + (e - a) * bs]
                self.devices.host.to_compute(dst, src)
                self.devices.counters.add("cpu", "compute", src.nbytes)
            else:
                slot = (r0 if self._seq_disk else 0) * self._n_disk + self.slots[span[a]]
                if raw_reads is not None and at % bs == 0 and e - a < BIG_RUN:  # placed with the others in one copy
                    raw_reads.append((slot, e - a, r0, at // bs + a))
                else:
                    disk_reads.append((slot, e - a, self._raw_sink(dst, e - a, r1 - r0)))

    def _raw_sink(self, dst: torch.Tensor, count: int, rows: int):
        """What a raw disk span's bytes go through: [count, rows, planes, Hkv, bs, D] on disk ->
        dst: [planes, rows, Hkv, count*bs, D]."""
        planes, _, h, bs, d = self.block_shape
        return lambda data: dst.unflatten(3, (count, bs)).copy_(
            data.view(self.store_dtype).view(count, rows, planes, h, bs, d).permute(2, 1, 3, 0, 4, 5))

    def holds_exact_rows(self) -> bool:
        """Whether any encoded block's exact rows are held on compute (`hold_exact_rows`)."""
        return bool(self._exact_rows)

    def exact_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encoded block b's exact rows held on compute (`hold_exact_rows`): (idx: [B, m] token
        index within the block, kv: [2, B, Hkv, m, D]), or None."""
        return self._exact_rows.get(b)

    def _fill_exact_rows(self, b: int, out: torch.Tensor, zero_unread: bool) -> None:
        """out: [2, B, Hkv, bs, D] <- block b's exact rows at their positions (the other rows zeros,
        or left as they are when not zero_unread: a caller's mask must leave them out)."""
        idx, kv = self._exact_rows[b]
        if zero_unread:
            out.zero_()
        out.scatter_(3, idx[None, :, None, :, None].expand(kv.shape), kv.to(out.dtype))

    def rows(self, blocks: list[int]) -> torch.Tensor:
        """Encoded rows of sealed blocks on coded tiers, not decoded: [n, codec.nbytes] uint8 on
        compute (for policies that attend the encoded form, e.g. DKV). Read-only: blocks that
        live encoded on compute in consecutive slots come back as a view of their arena (no copy)."""
        dev, nb = self.devices, self.codec.nbytes
        if blocks and all(self.homes[b] == Tier.COMPUTE for b in blocks) and Tier.COMPUTE in self.coded:
            s0 = self.slots[blocks[0]]
            if all(self.slots[b] == s0 + i for i, b in enumerate(blocks)):
                return self._rows[Tier.COMPUTE][s0:s0 + len(blocks)]
        out = torch.empty((len(blocks), nb), dtype=torch.uint8, device=dev.compute)
        disk_reads = []
        for i, b in enumerate(blocks):
            home, slot = self.homes[b], self.slots[b]
            if home not in self.coded:
                raise ValueError(f"block {b} is not a sealed encoded block")
            if home == Tier.DISK:
                disk_reads.append((slot, 1, out[i].copy_))  # read together, not decoded
            elif home == Tier.CPU:
                dev.host.to_compute(out[i], self._rows[home][slot])
                dev.counters.add("cpu", "compute", nb)
            else:
                out[i].copy_(self._rows[home][slot])
        if disk_reads:
            read_disk(self, disk_reads)
        return out

    # --- rewinding ---
    def mark(self) -> torch.Tensor:
        """The open buffer's contents (later appends reuse it)."""
        return self._tail.clone()

    def rewind(self, tail: torch.Tensor) -> None:
        self._tail.copy_(tail)

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()
            self._disk = None


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[r0, r1) runs of True in flags."""
    runs, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i))
            start = None
    return runs
