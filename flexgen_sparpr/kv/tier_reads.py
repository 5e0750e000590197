"""Reading a TierStore's blocks to the compute device (a mixin of TierStore, kv/tier_store.py,
whose attributes it reads): a resident cache as a view, offloaded blocks as spans of adjacent
blocks (one request a span, or a run of the rows a sequence needs), encoded blocks decoded or as
rows, a lossy codec's exact copies and held exact rows in place of a read. Disk requests go
through kv/disk_reads.py."""
from __future__ import annotations

import itertools

import torch

from ..storage.tiers import Tier
from .disk_reads import LandingReads, landed_later, read_disk, read_landed, read_raw_disk

BIG_RUN = 8  # blocks: a disk run this long is copied out by its reader; shorter ones together, by index


class TierReads:
    # --- reading ---
    def resident_arena(self) -> torch.Tensor:
        """A wholly resident cache's arena, every slot: [planes, B, Hkv, capacity, D], contiguous, in
        resident_dtype (here and in resident_view only: every other read gives the compute dtype)."""
        return self._arena[Tier.COMPUTE]

    def resident_view(self, length: int) -> torch.Tensor:
        """A wholly resident cache's first `length` tokens, as a view: [planes, B, Hkv, length, D]."""
        return self._arena[Tier.COMPUTE][:, :, :, :length]

    def gather(self, blocks: list[int], lens: list[int], sealed: int, out: torch.Tensor | None,
               need: list[list[bool]] | None, zero_unread: bool, starts: list[int] | None = None) -> torch.Tensor:
        """Blocks (of lens tokens each; the first `sealed` blocks are sealed) into out (made when
        None or short): [planes, B, Hkv, T, D] on compute, one after the other, or each at its own
        token offset `starts` into a given out. need: [n][B], the sequences that need each block
        (None: all); see BlockTable.gather. Blocks adjacent both here and in out go as spans."""
        if starts is None:
            starts = list(itertools.accumulate(lens, initial=0))
        starts = [*starts[:len(blocks)], max((a + n for a, n in zip(starts, lens)), default=0)]
        total = starts[-1]
        if out is None or out.shape[3] < total:
            out = torch.empty((*self.block_shape[:3], total, self.block_shape[4]), dtype=self.dtype,
                              device=self.devices.compute)
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
            elif self.is_raw_on_compute(b):  # a run of them in adjacent slots: one copy
                j = self._compute_run_end(blocks, lens, starts, i)
                s = self.slots[b] * self.bs
                out[:, :, :, t:t + (j - i) * self.bs].copy_(self._arena[Tier.COMPUTE][:, :, :, s:s + (j - i) * self.bs])
                i = j
                continue
            elif need is not None and not any(need[i]) and b in self._exact_rows:
                self._fill_exact_rows(b, dst, zero_unread)  # no sequence reads it whole: nothing moves
            elif exact is not None:  # a first or recent block kept exact: the copy, nothing crosses a link
                dst.copy_(exact)
            elif self.homes[b] == Tier.DISK or self.homes[b] not in self.coded:  # disk, or raw CPU
                j = self._span_end(blocks, i, sealed, need, starts)
                self._read_span(blocks[i:j], out[:, :, :, t:t + self.bs * (j - i)], None if need is None else need[i:j],
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

    def lands_disk(self) -> bool:
        """Whether raw disk blocks can be read as they are stored and attended where they land
        (`land`): raw (not encoded) blocks in a packed disk file."""
        return self._disk is not None and Tier.DISK not in self.coded and self._disk.is_packed

    def landing_bytes(self, n: int) -> int:
        """The bytes `land` reads n blocks into."""
        return n * self.stored_raw.nbytes

    def land(self, blocks: list[int], out: torch.Tensor) -> torch.Tensor:
        """Sealed raw disk blocks (`lands_disk`; ascending) read as they are stored into out, a
        page-aligned uint8 CPU tensor of `landing_bytes(len(blocks))`: no copy out, no conversion,
        one request per run of adjacent slots (per sequence when the file is sequence-major).
        Returns the blocks as a view of out, [B, n, planes, Hkv, bs, D] in store_dtype (strided:
        block-major in a whole-block file, sequence-major in a sequence-major one)."""
        read_landed(self, self._landing_ranges(blocks), out)
        return self._landed_view(len(blocks), out)

    def land_later(self, blocks: list[int], out: torch.Tensor) -> tuple[torch.Tensor, LandingReads] | None:
        """`land` with its reads left in flight (disk_reads.py `landed_later`): (the view, valid once
        the returned reads' wait() is back, the reads), or None where they cannot be in flight."""
        reads = landed_later(self, self._landing_ranges(blocks), out)
        return None if reads is None else (self._landed_view(len(blocks), out), reads)

    def _landing_ranges(self, blocks: list[int]) -> list:
        """land's requests: ((first slot, slots), byte offset in out) per run of adjacent slots; the
        last blocks' kept (a layer lands the same disk blocks step after step, until one seals)."""
        key = tuple(blocks)
        if self._ranges_memo is not None and self._ranges_memo[0] == key:
            return self._ranges_memo[1]
        n, piece = len(blocks), self._disk.slot_bytes
        groups = self.block_shape[1] if self._seq_disk else 1  # the file's units: a sequence's share of a block, or a block
        runs, i = [], 0  # (first slot, slots, first block)
        while i < n:
            j = i + 1
            while j < n and self.slots[blocks[j]] == self.slots[blocks[j - 1]] + 1:
                j += 1
            runs.append((self.slots[blocks[i]], j - i, i))
            i = j
        ranges = [((r * self._n_disk + s, c), (r * n + i) * piece) for r in range(groups) for s, c, i in runs]
        self._ranges_memo = (key, ranges)
        return ranges

    def _landed_view(self, n: int, out: torch.Tensor) -> torch.Tensor:
        planes, b_all, h, bs, d = self.block_shape
        data = out.view(self.store_dtype)
        if self._seq_disk:  # data: [B, n, planes, Hkv, bs, D]
            return data.view(b_all, n, planes, h, bs, d)
        return data.view(n, b_all, planes, h, bs, d).transpose(0, 1)  # [n, B, ...] read as [B, n, ...]

    def view(self, b: int, n: int, sealed: int) -> torch.Tensor | None:
        """Block b's first n tokens on compute with no copy, [planes, B, Hkv, n, D]: the open block's
        buffer, a raw block in the compute arena, or the exact copy kept of an encoded block; else
        None (it must be gathered)."""
        if n < self.bs:
            return self.writable(b)[:, :, :, :n]
        if self.is_raw_on_compute(b):
            return self.in_place(b).to(self.dtype)  # a copy only where resident_dtype differs
        return self._exact_copy(b, sealed)

    def _exact_copy(self, b: int, sealed: int) -> torch.Tensor | None:
        """The exact copy kept of encoded block b (the codec's first and recent blocks), or None."""
        if b < self.codec.exact_first or b >= sealed - self.codec.exact_recent:
            return self._exact.get(b)
        return None

    def _compute_run_end(self, blocks: list[int], lens: list[int], starts: list[int], i: int) -> int:
        """End (exclusive) of the run of gather entries from i that are whole raw blocks on compute in
        adjacent slots, placed one after the other in out (one copy; half the KV resident otherwise
        cost a copy call per block, a millisecond a layer at 2k tokens)."""
        j = i + 1
        if not self.span_reads:
            return j
        while (j < len(blocks) and blocks[j] == blocks[j - 1] + 1 and lens[j] == self.bs and
               starts[j] == starts[j - 1] + self.bs and self.is_raw_on_compute(blocks[j]) and
               self.slots[blocks[j]] == self.slots[blocks[j - 1]] + 1):
            j += 1
        return j

    def _span_end(self, blocks: list[int], i: int, sealed: int, need: list[list[bool]] | None,
                  starts: list[int]) -> int:
        """End (exclusive) of the span of gather entries from i: adjacent sealed blocks of one home,
        stored one after the other (a CPU arena always; a disk file when packed) and placed one
        after the other in out, none of them read from an exact copy instead."""
        home, j = self.homes[blocks[i]], i + 1
        if not self.span_reads or (home == Tier.DISK and not self._disk.is_packed and home not in self.coded):
            return j  # (encoded blocks: a span reads their page padding too, one request: disk.read_slots)
        while (j < len(blocks) and blocks[j] == blocks[j - 1] + 1 and blocks[j] < sealed and
               starts[j] == starts[j - 1] + self.bs and
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
        if home in self.coded:  # encoded disk blocks: one request, the span decoded at once
            def place(data):
                dec = self.codec.decode_many(data.view(k, self.codec.nbytes))  # dec: [k, planes, B, Hkv, bs, D]
                out[:, :, :, :k * bs].unflatten(3, (k, bs)).copy_(dec.permute(1, 2, 3, 0, 4, 5))
            disk_reads.append((self.slots[span[0]], k, place))
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
