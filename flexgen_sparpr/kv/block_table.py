"""The block-granular KV cache of one layer for one GPU batch.

Block b holds token positions [b*bs, (b+1)*bs) of every sequence in the batch as one tensor
kv: [2, B, Hkv, bs, D] (K then V). With planes=1 the same table keeps other per-token state
(SparPR's hidden-state checkpoints: [1, B, 1, bs, hidden]). Each block has a home tier fixed at creation; the block
being filled lives on the compute device until it is full ("sealed"), then moves home.
A codec (4-bit groups, or DKV's anchor + low-rank form) may encode the sealed blocks of some
tiers: those are kept as rows of codec.nbytes bytes, the other tiers' blocks raw.

Raw blocks on disk are stored sequence-major ([B, planes, Hkv, bs, D] per slot), so a read that
only some sequences need (a per-sequence selection, `gather(seqs=...)`) moves only their bytes;
raw CPU blocks are sliced in place. Encoded blocks always move whole.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..storage.disk import ALIGN
from ..storage.tiers import Devices, Tier
from ..storage.codec import Int4Codec, RawCodec


class BlockTable:
    def __init__(self, *, name: str, batch: int, num_kv_heads: int, head_dim: int, block_size: int,
                 max_len: int, dtype: torch.dtype, homes: list[Tier], devices: Devices,
                 disk=None, compress: bool = False, planes: int = 2, codec=None,
                 coded_tiers: tuple[Tier, ...] | None = None):
        self.bs, self.devices, self.dtype = block_size, devices, dtype
        self.block_shape = (planes, batch, num_kv_heads, block_size, head_dim)
        self.checkpoints: "BlockTable | None" = None  # hidden-state checkpoints, when kept
        self.capacity = -(-max_len // block_size) * block_size
        self.homes = [devices.effective(t) for t in homes]
        if len(self.homes) * block_size < max_len:
            raise ValueError("fewer block homes than blocks")
        self.raw = RawCodec(self.block_shape, dtype)
        if codec is None:
            codec = Int4Codec(self.block_shape, dtype) if compress else self.raw
        self.codec = codec  # how the coded tiers' blocks are stored (what a copy from them moves)
        # tiers whose sealed blocks are stored encoded (default: every tier, when the codec encodes)
        self.coded = frozenset() if not codec.compressed else frozenset(coded_tiers or tuple(Tier))
        # exact copies of the newest sealed encoded blocks (a lossy codec's recency window), and of
        # the first ones (the attention sinks every query reads), on compute
        self.exact_recent = 0
        self.exact_first = 0
        self._exact: dict[int, torch.Tensor] = {}
        self.slot = [self.homes[:b].count(h) for b, h in enumerate(self.homes)]
        self.length = 0
        self.on_seal: list[Callable[[int, torch.Tensor], None]] = []  # policy hooks: (block, kv)
        # per-token importance [B, bs] of a sealed block, for a codec whose encode takes
        # `importance=` (DKV's query-aware residual pick); set before the block's store job runs
        # (a prefill's on_prefill hooks run before its store jobs are submitted), used once
        self.encode_hints: dict[int, torch.Tensor] = {}
        # also keep a coded block's exact rows (codec.exact_rows: DKV's residual rows) on compute,
        # for a policy that attends them without moving the block (set before blocks are stored)
        self.keep_exact_rows = False
        self._exact_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (idx [B, m], kv)
        n = {t: self.homes.count(t) for t in Tier}
        dev = devices.compute
        b, h, bs, d = batch, num_kv_heads, block_size, head_dim
        self._arena, self._rows, self._disk, self._disk_store = {}, {}, None, disk
        for tier in (Tier.COMPUTE, Tier.CPU):
            if not n[tier]:
                continue
            if tier in self.coded:
                shape = (n[tier], self.codec.nbytes)
                self._rows[tier] = (torch.empty(shape, dtype=torch.uint8, device=dev) if tier == Tier.COMPUTE
                                    else devices.empty_host(shape, torch.uint8))
            else:
                shape = (planes, b, h, n[tier] * bs, d)
                self._arena[tier] = (torch.zeros(shape, dtype=dtype, device=dev) if tier == Tier.COMPUTE
                                     else devices.empty_host(shape, dtype))
        if n[Tier.DISK]:
            if disk is None:
                raise ValueError("KV blocks placed on disk but no --offload-dir store was given")
            self._disk = disk.new_file(f"kv-{name}", n[Tier.DISK], self.codec_of(Tier.DISK).nbytes)
        self._tail = torch.zeros(self.block_shape, dtype=dtype, device=dev)
        self.seq_nbytes = self.raw.nbytes // batch  # one sequence's share of a raw block
        # raw disk blocks can be read a sequence at a time (O_DIRECT: offsets on 4096 bytes)
        self._seq_disk = (self._disk is not None and Tier.DISK not in self.coded and batch > 1 and
                          (self.seq_nbytes % ALIGN == 0 or self._disk.direct_mode != "o_direct"))
        self.resident = Tier.COMPUTE not in self.coded and all(t == Tier.COMPUTE for t in self.homes)

    # --- shape facts ---
    def codec_of(self, tier: Tier):
        """The codec of the blocks homed on a tier."""
        return self.codec if tier in self.coded else self.raw

    def reads_rows(self, b: int) -> bool:
        """Whether a copy of sealed block b can move some of its sequences only."""
        home = self.homes[b]
        return home not in self.coded and (home == Tier.CPU or (home == Tier.DISK and self._seq_disk))

    def read_bytes(self, b: int, nseq: int) -> int:
        """Bytes a copy of sealed block b for nseq of its sequences moves from its home."""
        full = self.codec_of(self.homes[b]).nbytes
        return self.seq_nbytes * nseq if self.reads_rows(b) else full

    @property
    def num_blocks(self) -> int:
        return -(-self.length // self.bs)

    def block_len(self, b: int) -> int:
        return min(self.bs, self.length - b * self.bs)

    def positions(self, blocks: list[int], device: torch.device | None = None) -> torch.Tensor:
        """[T] cache positions of the blocks' tokens, in the order given (gather's order)."""
        dev = self.devices.compute if device is None else device
        if not blocks:
            return torch.empty(0, dtype=torch.long, device=dev)
        ids = torch.tensor(blocks, device=dev)
        pos = (ids[:, None] * self.bs + torch.arange(self.bs, device=dev)).flatten()  # pos: [n * bs]
        return pos[pos < self.length]  # only the open (last) block can be short

    def _in_arena(self, b: int) -> torch.Tensor:
        s = self.slot[b] * self.bs
        return self._arena[self.homes[b]][:, :, :, s:s + self.bs]

    def _writable(self, b: int) -> torch.Tensor:
        """Where block b is filled: its arena slot if it lives raw on compute, else the tail."""
        if self.homes[b] == Tier.COMPUTE and Tier.COMPUTE in self._arena:
            return self._in_arena(b)
        return self._tail

    # --- writing ---
    def append(self, *planes: torch.Tensor) -> list[Callable[[], None]]:
        """k, v (one tensor per plane): [B, Hkv, S, D] on compute. Returns store jobs for blocks
        sealed by this append (run them on the I/O pool; wait for them before the next read)."""
        jobs, s, off = [], planes[0].shape[2], 0
        if self.length + s > self.capacity:
            raise ValueError(f"KV cache full: {self.length}+{s} > {self.capacity} tokens")
        while off < s:
            b, pos = divmod(self.length, self.bs)
            n = min(self.bs - pos, s - off)
            dst = self._writable(b)
            for i, x in enumerate(planes):
                dst[i, :, :, pos:pos + n].copy_(x[:, :, off:off + n])
            self.length += n
            off += n
            if pos + n == self.bs:
                jobs.append(self._seal(b, dst))
        return [j for j in jobs if j is not None]

    def _seal(self, b: int, kv: torch.Tensor):
        for hook in self.on_seal:
            hook(b, kv)
        self._exact_rows.pop(b, None)  # a rewound run's rows for this block are stale; its store refills
        home = self.homes[b]
        if home == Tier.COMPUTE and home not in self.coded:
            return None
        if (self.exact_recent or b < self.exact_first) and home in self.coded:
            self._exact[b] = kv.clone()
            later = sorted(x for x in self._exact if x >= self.exact_first)
            for old in later[:-(self.exact_recent + 1)]:  # one spare survives a rewind
                del self._exact[old]
        blk = kv.clone()  # the tail is reused at once; the store reads a private copy
        return lambda: self._store(b, blk)

    def _store(self, b: int, blk: torch.Tensor) -> None:
        home, slot, dev = self.homes[b], self.slot[b], self.devices
        hint = self.encode_hints.pop(b, None)
        if home not in self.coded:
            data = blk
        else:
            data = self.codec.encode(blk) if hint is None else self.codec.encode(blk, importance=hint)
            if self.keep_exact_rows and hasattr(self.codec, "exact_rows"):
                self._exact_rows[b] = self.codec.exact_rows(data)  # on compute, like the block's summaries
        if home == Tier.DISK:
            host = (data if home in self.coded else data.transpose(0, 1).contiguous()).cpu()  # seq-major
            if dev.is_cuda:
                dev.counters.add("compute", "cpu", host.nbytes)
            self._disk.write(slot, host)
            dev.counters.add("cpu", "disk", host.nbytes)
        elif home in self.coded:
            self._rows[home][slot].copy_(data)
            if home == Tier.CPU:
                dev.counters.add("compute", "cpu", data.nbytes)
        else:
            s = slot * self.bs
            self._arena[home][:, :, :, s:s + self.bs].copy_(data)
            dev.counters.add("compute", "cpu", data.nbytes)

    # --- reading ---
    def _load(self, b: int, out: torch.Tensor, rows: list[tuple[int, int]] | None = None,
              disk_reads: list | None = None) -> None:
        """Copy sealed block b into out: [planes, B, Hkv, bs, D] on compute (any strides). rows:
        runs [r0, r1) of the sequences to read (None: all); only a block that `reads_rows` honours
        them (the other rows of out are left as they were). A disk read is queued on disk_reads
        when given (gather runs them together), else done now."""
        home, slot, dev = self.homes[b], self.slot[b], self.devices
        exact = self._exact.get(b) if b < self.exact_first or b >= self.length // self.bs - self.exact_recent else None
        if rows is None or not self.reads_rows(b):
            rows = [(0, self.block_shape[1])]
        if exact is not None:  # inside the recency window: the exact copy, nothing crosses a link
            out.copy_(exact)
        elif home == Tier.DISK:
            if disk_reads is None:
                self._read_disk([(b, out, rows)])
            else:
                disk_reads.append((b, out, rows))
        elif home in self.coded:
            row = self._rows[home][slot]
            if home == Tier.CPU:
                row = row.to(dev.compute, non_blocking=True)
                dev.counters.add("cpu", "compute", row.nbytes)
            out.copy_(self.codec.decode(row))
        else:
            src = self._in_arena(b)
            for r0, r1 in rows:
                out[:, r0:r1].copy_(src[:, r0:r1], non_blocking=True)
                if home == Tier.CPU:
                    dev.counters.add("cpu", "compute", src[:, r0:r1].nbytes)

    def _read_disk(self, jobs: list) -> None:
        """Disk blocks (b, out, rows), read concurrently (the store's read depth); the link's
        bandwidth is timed over the whole batch, so overlapping reads are not counted twice."""
        mode = torch.is_inference_mode_enabled()  # per thread: the readers take the caller's

        def read(job) -> int:
            with torch.inference_mode(mode):
                return self._read_disk_block(*job)
        t0 = time.perf_counter()
        nbytes = sum(self._disk_store.map(read, jobs))
        self.devices.counters.add("disk", "cpu", nbytes, time.perf_counter() - t0)
        if self.devices.is_cuda:  # counted here, on the calling thread (LinkCounters.tag is per thread)
            self.devices.counters.add("cpu", "compute", nbytes)

    def _read_disk_block(self, b: int, out: torch.Tensor, rows: list[tuple[int, int]], decode: bool = True) -> int:
        """One disk block into out; encoded blocks whole (decoded, or as their encoded row when
        not `decode`), raw ones one read per run of sequences (sequence-major on disk). Returns
        the bytes read."""
        slot, dev, b_all = self.slot[b], self.devices, self.block_shape[1]
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
            data = host.to(dev.compute, non_blocking=True) if dev.is_cuda else host
            if coded:
                out.copy_(self.codec.decode(data) if decode else data, non_blocking=not decode)
            else:
                planes, _, h, bs, d = self.block_shape
                out[:, r0:r1].copy_(data.view(self.dtype).view(r1 - r0, planes, h, bs, d).transpose(0, 1))
        return nbytes

    def gather(self, blocks: list[int] | None = None, out: torch.Tensor | None = None,
               seqs: torch.Tensor | None = None, zero_unread: bool = True):
        """KV of the given blocks (ascending; default all) on compute.

        Returns kv: [planes, B, Hkv, T, D] and pos: [T] (absolute token positions). A fully resident
        cache read in full with no `out` buffer is returned as a view, with no copy. seqs: [B, n]
        bool, the sequences that need each block (None: all); rows of a sealed offloaded block no
        sequence needs are not read, where the block's home allows it (`reads_rows`), and are set
        to zeros unless zero_unread is False (an `out` known to hold finite values: masked-out
        rows need only be finite, so attention gives them exactly zero weight).
        """
        nb = self.num_blocks
        blocks = list(range(nb)) if blocks is None else blocks
        dev = self.devices.compute
        if out is None and self.resident and blocks == list(range(nb)):
            return (self._arena[Tier.COMPUTE][:, :, :, :self.length],
                    torch.arange(self.length, device=dev))
        lens = [self.block_len(b) for b in blocks]
        total = sum(lens)
        if out is None or out.shape[3] < total:
            out = torch.empty((*self.block_shape[:3], total, self.block_shape[4]), dtype=self.dtype, device=dev)
        need = seqs.T.tolist() if seqs is not None else None  # need: [n][B]
        disk_reads: list = []
        t = 0
        for i, (b, n) in enumerate(zip(blocks, lens)):
            dst = out[:, :, :, t:t + n]
            if n < self.bs:  # the partial tail block is still on compute
                dst.copy_(self._writable(b)[:, :, :, :n])
            elif self.homes[b] == Tier.COMPUTE and Tier.COMPUTE not in self.coded:
                dst.copy_(self._in_arena(b))
            elif need is not None and not any(need[i]) and b in self._exact_rows:
                self._fill_exact_rows(b, dst, zero_unread)  # no sequence reads it whole: nothing moves
            elif need is None or all(need[i]) or not self.reads_rows(b):
                self._load(b, dst, disk_reads=disk_reads)
            else:
                for r0, r1 in _runs([not x for x in need[i]]) if zero_unread else ():
                    dst[:, r0:r1].zero_()  # rows no sequence reads: zeros (masked out), never garbage
                self._load(b, dst, _runs(need[i]), disk_reads=disk_reads)
            t += n
        if disk_reads:
            self._read_disk(disk_reads)
        return out[:, :, :, :total], self.positions(blocks, dev)

    def exact_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sealed coded block b's exact rows held on compute (`keep_exact_rows`): (idx: [B, m] token
        index within the block, kv: [2, B, Hkv, m, D]), or None."""
        return self._exact_rows.get(b) if b < self.length // self.bs else None

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
            home, slot = self.homes[b], self.slot[b]
            if home not in self.coded or self.block_len(b) < self.bs:
                raise ValueError(f"block {b} is not a sealed encoded block")
            if home == Tier.DISK:
                disk_reads.append((b, out[i], None, False))  # read together, not decoded
            else:
                out[i].copy_(self._rows[home][slot], non_blocking=True)
                if home == Tier.CPU:
                    dev.counters.add("cpu", "compute", nb)
        if disk_reads:
            self._read_disk(disk_reads)
        return out

    # --- rewinding (one prefill, several decodes) ---
    def mark(self):
        """Remember the current length; the partial block's tail is copied since later
        appends reuse the tail buffer."""
        ck = self.checkpoints.mark() if self.checkpoints is not None else None
        return self.length, self._tail.clone(), ck

    def rewind(self, mark) -> None:
        """Go back to a mark. Blocks sealed after it are overwritten when refilled."""
        self.length, tail, ck = mark
        self._tail.copy_(tail)
        if ck is not None:
            self.checkpoints.rewind(ck)

    def nbytes_on(self, tier: Tier) -> int:
        """Bytes of the sealed blocks homed on a tier (for reports)."""
        sealed = self.length // self.bs
        return self.codec_of(tier).nbytes * sum(1 for b in range(sealed) if self.homes[b] == tier)

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()
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
