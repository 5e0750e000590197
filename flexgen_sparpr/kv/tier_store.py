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


import torch

from ..storage.codec import Codec, RawCodec
from ..storage.disk import ALIGN, aligned_empty
from ..storage.tiers import Devices, Tier
from .tier_reads import TierReads


class TierStore(TierReads):
    span_reads = True  # False: every block is a request of its own (what spans are compared with)
    placed_reads = True  # False: each raw disk run copied out by its reader (what one indexed copy is compared with)

    def __init__(self, *, name: str, block_shape: tuple[int, ...], dtype: torch.dtype, homes: list[Tier],
                 slots: list[int], devices: Devices, disk=None, codec: Codec,
                 coded_tiers: tuple[Tier, ...] | None = None, store_dtype: torch.dtype | None = None,
                 resident_dtype: torch.dtype | None = None):
        self.block_shape, self.dtype, self.devices = block_shape, dtype, devices
        # raw blocks homed on compute are stored in resident_dtype (None: the compute dtype): float16
        # on a CPU whose decode-attention kernel reads it (kv_tables.build_tables) halves the bytes
        # every decode step reads; only resident_view / resident_arena hand them out as they are
        self.resident_dtype = resident_dtype or dtype
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
        self._ranges_memo: tuple | None = None  # the last landed blocks and their requests (tier_reads.py)
        for tier in (Tier.COMPUTE, Tier.CPU):
            if not n[tier]:
                continue
            if tier in self.coded:
                shape = (n[tier], self.codec.nbytes)
                self._rows[tier] = (torch.empty(shape, dtype=torch.uint8, device=dev) if tier == Tier.COMPUTE
                                    else devices.host.arena(shape, torch.uint8))
            else:
                shape = (planes, batch, h, n[tier] * bs, d)
                self._arena[tier] = (torch.zeros(shape, dtype=self.resident_dtype, device=dev) if tier == Tier.COMPUTE
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
        """Raw block b where it lives (its arena slot): [planes, B, Hkv, bs, D], no copy (in its tier's
        dtype: store_dtype on the CPU tier, resident_dtype on compute)."""
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
        buf, row = self.write_at(b)
        return buf if buf is self._tail else buf[:, :, :, row:row + self.bs]

    def write_at(self, b: int) -> tuple[torch.Tensor, int]:
        """`writable(b)` as (the buffer it lies in: [planes, B, Hkv, T, D], block b's first row there),
        with no view made: the compute arena and b's slot, or the open buffer and 0."""
        home = self.homes[b]
        if home == Tier.COMPUTE and home in self._arena:
            return self._arena[home], self.slots[b] * self.bs
        return self._tail, 0

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
