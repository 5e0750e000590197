"""The bytes of one block table, and the only code that moves them.

Each sealed block lives on its home tier: raw in an arena per tier ([planes, B, Hkv, n*bs, D]
on compute, pinned host memory for the CPU tier), encoded as rows of codec.nbytes bytes on the
tiers the codec covers, or in a slot of the table's disk file. The open block is filled in a
buffer on compute (or in place in its compute arena slot). Storing a sealed block home and
reading blocks to the compute device happen here, each move counted per link
(`devices.counters`); the block table (kv/block_table.py) decides which blocks and where.

Raw blocks on disk are stored sequence-major ([B, planes, Hkv, bs, D] per slot), so a read that
only some sequences need (a per-sequence selection) moves only their bytes; raw CPU blocks are
sliced in place. Encoded blocks always move whole.
"""
from __future__ import annotations

import time

import torch

from ..storage.codec import Codec, RawCodec
from ..storage.disk import ALIGN
from ..storage.tiers import Devices, Tier


class TierStore:
    def __init__(self, *, name: str, block_shape: tuple[int, ...], dtype: torch.dtype, homes: list[Tier],
                 slots: list[int], devices: Devices, disk=None, codec: Codec,
                 coded_tiers: tuple[Tier, ...] | None = None):
        self.block_shape, self.dtype, self.devices = block_shape, dtype, devices
        self.homes, self.slots = homes, slots  # per block: home tier, index among its tier's blocks
        planes, batch, h, bs, d = block_shape
        self.bs = bs
        self.raw = RawCodec(block_shape, dtype)
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
                                     else devices.host.arena(shape, dtype))
        if n[Tier.DISK]:
            if disk is None:
                raise ValueError("KV blocks placed on disk but no --offload-dir store was given")
            self._disk = disk.new_file(f"kv-{name}", n[Tier.DISK], self.codec_of(Tier.DISK).nbytes)
        self._tail = torch.zeros(block_shape, dtype=dtype, device=dev)
        self.seq_nbytes = self.raw.nbytes // batch  # one sequence's share of a raw block
        # raw disk blocks can be read a sequence at a time (O_DIRECT: offsets on 4096 bytes)
        self._seq_disk = (self._disk is not None and Tier.DISK not in self.coded and batch > 1 and
                          (self.seq_nbytes % ALIGN == 0 or self._disk.direct_mode != "o_direct"))
        self.resident = Tier.COMPUTE not in self.coded and all(t == Tier.COMPUTE for t in homes)

    # --- facts ---
    def codec_of(self, tier: Tier) -> Codec:
        """The codec of the blocks homed on a tier."""
        return self.codec if tier in self.coded else self.raw

    def is_raw_on_compute(self, b: int) -> bool:
        return self.homes[b] == Tier.COMPUTE and Tier.COMPUTE not in self.coded

    def reads_rows(self, b: int) -> bool:
        """Whether a copy of sealed block b can move some of its sequences only."""
        home = self.homes[b]
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
        return self.in_place(b)

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
            data = blk
        else:
            data = self.codec.encode(blk, hint)
            rows = self.codec.exact_rows(data) if self.hold_exact_rows else None
            if rows is not None:  # on compute, like the block's summaries; made on the I/O stream
                self._exact_rows[b] = dev.streams.hand_off(rows)
        if home == Tier.DISK:
            host = (data if home in self.coded else data.transpose(0, 1).contiguous()).cpu()  # seq-major
            if dev.is_cuda:
                dev.counters.add("compute", "cpu", host.nbytes)
            self._disk.write(slot, host)
            dev.counters.add("cpu", "disk", host.nbytes)
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
    def resident_view(self, length: int) -> torch.Tensor:
        """A wholly resident cache's first `length` tokens, as a view: [planes, B, Hkv, length, D]."""
        return self._arena[Tier.COMPUTE][:, :, :, :length]

    def gather(self, blocks: list[int], lens: list[int], sealed: int, out: torch.Tensor | None,
               need: list[list[bool]] | None, zero_unread: bool) -> torch.Tensor:
        """Blocks (of lens tokens each; the first `sealed` blocks are sealed) into out (made when
        None or short): [planes, B, Hkv, T, D] on compute. need: [n][B], the sequences that need
        each block (None: all); see BlockTable.gather."""
        total = sum(lens)
        if out is None or out.shape[3] < total:
            out = torch.empty((*self.block_shape[:3], total, self.block_shape[4]), dtype=self.dtype,
                              device=self.devices.compute)
        disk_reads: list = []
        t = 0
        for i, (b, n) in enumerate(zip(blocks, lens)):
            dst = out[:, :, :, t:t + n]
            if n < self.bs:  # the partial open block is still on compute
                dst.copy_(self.writable(b)[:, :, :, :n])
            elif self.is_raw_on_compute(b):
                dst.copy_(self.in_place(b))
            elif need is not None and not any(need[i]) and b in self._exact_rows:
                self._fill_exact_rows(b, dst, zero_unread)  # no sequence reads it whole: nothing moves
            elif need is None or all(need[i]) or not self.reads_rows(b):
                self._load(b, sealed, dst, disk_reads=disk_reads)
            else:
                for r0, r1 in _runs([not x for x in need[i]]) if zero_unread else ():
                    dst[:, r0:r1].zero_()  # rows no sequence reads: zeros (masked out), never garbage
                self._load(b, sealed, dst, _runs(need[i]), disk_reads=disk_reads)
            t += n
        if disk_reads:
            self._read_disk(disk_reads)
        return out[:, :, :, :total]

    def _load(self, b: int, sealed: int, out: torch.Tensor, rows: list[tuple[int, int]] | None = None,
              disk_reads: list | None = None) -> None:
        """Copy sealed block b into out: [planes, B, Hkv, bs, D] on compute (any strides). rows:
        runs [r0, r1) of the sequences to read (None: all); only a block that `reads_rows` honours
        them (the other rows of out are left as they were). A disk read is queued on disk_reads
        when given (gather runs them together), else done now."""
        home, slot, dev = self.homes[b], self.slots[b], self.devices
        exact = self._exact.get(b) if b < self.codec.exact_first or b >= sealed - self.codec.exact_recent else None
        if rows is None or not self.reads_rows(b):
            rows = [(0, self.block_shape[1])]
        if exact is not None:  # a first or recent block kept exact: the copy, nothing crosses a link
            out.copy_(exact)
        elif home == Tier.DISK:
            if disk_reads is None:
                self._read_disk([(b, out, rows)])
            else:
                disk_reads.append((b, out, rows))
        elif home in self.coded:
            row = self._rows[home][slot]
            if home == Tier.CPU:
                row = dev.host.to_compute_new(row)
                dev.counters.add("cpu", "compute", row.nbytes)
            out.copy_(self.codec.decode(row))
        else:  # raw, on the CPU tier (or on compute, called directly)
            src = self.in_place(b)
            for r0, r1 in rows:
                if home == Tier.CPU:
                    dev.host.to_compute(out[:, r0:r1], src[:, r0:r1])
                    dev.counters.add("cpu", "compute", src[:, r0:r1].nbytes)
                else:
                    out[:, r0:r1].copy_(src[:, r0:r1])

    def _read_disk(self, jobs: list) -> None:
        """Disk blocks (b, out, rows), read concurrently (the store's read depth); the link's
        bandwidth is timed over the whole batch, so overlapping reads are not counted twice."""
        # the readers copy on the caller's stream, in its inference mode (storage/streams.py, rule 4)
        read = self.devices.streams.carry(lambda job: self._read_disk_block(*job))
        t0 = time.perf_counter()
        nbytes = sum(self._disk_store.map(read, jobs))
        self.devices.counters.add("disk", "cpu", nbytes, time.perf_counter() - t0)
        if self.devices.is_cuda:  # counted here, on the calling thread (LinkCounters.tag is per thread)
            self.devices.counters.add("cpu", "compute", nbytes)

    def _read_disk_block(self, b: int, out: torch.Tensor, rows: list[tuple[int, int]], decode: bool = True) -> int:
        """One disk block into out; encoded blocks whole (decoded, or as their encoded row when
        not `decode`), raw ones one read per run of sequences (sequence-major on disk). Returns
        the bytes read."""
        slot, dev, b_all = self.slots[b], self.devices, self.block_shape[1]
        coded = Tier.DISK in self.coded
        runs = [(0, b_all)] if coded else rows
        nbytes = 0
        for r0, r1 in runs:
            n = self.codec.nbytes if coded else (r1 - r0) * self.seq_nbytes
            host = dev.empty_host((n,), torch.uint8)
            if coded or (r0, r1) == (0, b_all):
                self._disk.read(slot, host)
            else:
                self._disk.read_at(slot, r0 * self.seq_nbytes, host)
            nbytes += n
            data = dev.host.to_compute_new(host)  # host: pinned by torch, so straight to the current stream
            if coded:
                out.copy_(self.codec.decode(data) if decode else data, non_blocking=not decode)
            else:
                planes, _, h, bs, d = self.block_shape
                out[:, r0:r1].copy_(data.view(self.dtype).view(r1 - r0, planes, h, bs, d).transpose(0, 1))
        return nbytes

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
        compute (for policies that attend the encoded form, e.g. DKV)."""
        dev, nb = self.devices, self.codec.nbytes
        out = torch.empty((len(blocks), nb), dtype=torch.uint8, device=dev.compute)
        disk_reads = []
        for i, b in enumerate(blocks):
            home, slot = self.homes[b], self.slots[b]
            if home not in self.coded:
                raise ValueError(f"block {b} is not a sealed encoded block")
            if home == Tier.DISK:
                disk_reads.append((b, out[i], None, False))  # read together, not decoded
            elif home == Tier.CPU:
                dev.host.to_compute(out[i], self._rows[home][slot])
                dev.counters.add("cpu", "compute", nb)
            else:
                out[i].copy_(self._rows[home][slot])
        if disk_reads:
            self._read_disk(disk_reads)
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
