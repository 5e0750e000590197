"""What one decode (layer, GPU batch) cell's attention reads from its block table, and which
attention it runs: the policy's own (`attends`, DKV), CPU blocks attended where they live
(--cpu-cache-compute), or the attention step (attention.py) over what was read.

The KV policy plans the cell's blocks before the query exists, or selects them from the cell's
early query (prefetch.py) or its real one; the chosen blocks are gathered to the compute device
(on the I/O pool, one cell ahead, when the choice is known early), a speculative gather is topped
up with what the guess missed, and blocks to rebuild go through the K/V projections
(recovery.py). Then the step's new token joins both the table and what attention reads. A cache
read whole and resident (or attended by the policy itself) is read in place, with no gather; one
read whole and partly resident has only its offloaded blocks gathered, its resident ones attended
in place, the two merged by log-sum-exp (`resident_split`).
"""
from __future__ import annotations

from concurrent.futures import Future
import torch

from ..kv.block_table import BlockTable
from ..kv.policy import KVPolicy, Selection
from ..models import cpu_kernel
from ..runtime.hardware import gathers_ahead
from ..storage.tiers import Devices, Tier
from .attention import decode_attention_step, gathered_rest, open_block_part, split_by_home, with_resident_blocks
from .io import Done, IOPool
from .prefetch import Ahead, Landing, early_selection
from .recall import Recall
from .recovery import Fetched, GatherRing, gather_selection, rebuild_kv, top_up
from .split_plan import SplitPlans
from .step_clock import StepClock


class KVReader:
    """The cells' KV reads for one engine. Inputs: the KV policy (swappable between runs), the
    model's maths (`arch`: query and K/V projections), the I/O pool, the devices and dtype, and
    FlexGen's --cpu-cache-compute and --attn-sparsity, and speculative prefetch."""

    def __init__(self, policy: KVPolicy, arch, io: IOPool, devices: Devices, dtype: torch.dtype, *,
                 cpu_cache_compute: bool = False, speculate: bool = False, sparsity: float = 1.0,
                 clock: StepClock | None = None):
        self.policy, self.arch, self.io, self.devices, self.dtype = policy, arch, io, devices, dtype
        self.cpu_cache_compute, self.speculate = cpu_cache_compute, speculate
        self.sparsity = sparsity  # FlexGen's --attn-sparsity: the top share of scores attention keeps
        self.clock = clock or StepClock()  # the engine's: select / read / rebuild seconds of its steps
        # gathers in flight beyond the computing cell's (engine/prefetch.py CacheReads): deeper on the
        # CPU, whose gather buffers are host memory, than on a GPU's scarce memory
        self.read_ahead = gathers_ahead(devices.is_cuda)
        self.ring = GatherRing(self.read_ahead + 2)  # the decode cells' gather buffers, reused
        self.landing = GatherRing(self.read_ahead + 2, aligned=True)  # where dense's disk blocks land
        self.splits = SplitPlans()  # each offloaded table's resident / landing / rest blocks
        self._kernel_takes: dict[tuple, bool] = {}  # (store dtype, arena layout) -> the kernel reads them
        self.recall: Recall | None = Recall()  # each offloaded table's last selective gather (None: off)
        self.blocks_read = [0, 0]  # over the decode cells so far: blocks attention read, blocks cached

    def in_place(self, t: BlockTable) -> bool:
        """Caches attended without a gather: resident and read whole (always, or this step:
        `KVPolicy.reads_step_whole`), attended by the policy, or split by home (--cpu-cache-compute
        on CUDA)."""
        return (t.store.resident and (self.policy.reads_all or self.policy.reads_step_whole(t))) or self.policy.attends or \
            (self.cpu_cache_compute and self.devices.is_cuda)

    def resident_split(self, t: BlockTable, sel: Selection | None) -> tuple[Selection | None, list[int]]:
        """A policy that reads the whole cache of an offloaded table, on the compiled CPU kernel,
        reads its sealed raw blocks where they are rather than copy them into one gather buffer:
        resident ones (homed on compute) in the compute arena, disk ones where they land, read as
        they are stored (`TierReads.land`: no copy out, no conversion). Returns (the selection left
        to gather: the open block and the other homes' blocks, the disk blocks to land); `attend`
        reads the parts in one kernel call (engine/attention.py `with_resident_blocks`). Copying had
        cost more than the reads: the resident half, 369 MB of copies a step at 8000 tokens, batch 4;
        the disk blocks, a permuting copy of every byte read, on the two cores the matmuls use. Else
        (sel, [])."""
        if sel is None or not self.reads_whole(sel) or self.policy.observes or self.sparsity < 1 or \
                self.devices.is_cuda or t.store.resident or len(sel.blocks) != t.num_blocks:
            return sel, []
        plan = self.splits.of(t)
        if not plan.resident and not plan.land:
            return sel, []
        arena = t.store.resident_arena() if plan.resident else None  # arena: [2, B, Hkv, cap, D]
        if not self._kernel_takes_blocks(t.store.store_dtype, arena):
            return sel, []
        return Selection(plan.rest, dense=sel.dense), plan.land

    def reads_whole(self, sel: Selection) -> bool:
        """Whether this selection reads every block as a dense step does: the policy always does, or
        this step was given to dense (SparPR's measured step fallback, `Selection.dense`)."""
        return self.policy.reads_all or sel.dense

    def _kernel_takes_blocks(self, store_dtype: torch.dtype | None, arena: torch.Tensor | None) -> bool:
        """Whether the compiled kernel reads this model's queries over blocks stored so (None: not
        asked) and the arena (None: none); once per store dtype and arena layout, not per layer and step."""
        key = (store_dtype, None if arena is None else (arena.dtype, arena.stride()))
        ok = self._kernel_takes.get(key)
        if ok is None:
            spec = self.arch.spec
            q = torch.empty(1, spec.num_heads, 1, spec.head_dim)  # the shape of a query, for the kernel's check
            k = None if store_dtype is None else torch.empty(1, spec.num_kv_heads, 1, spec.head_dim, dtype=store_dtype)
            ok = self._kernel_takes[key] = (k is None or cpu_kernel.usable(q, k, k)) and \
                (arena is None or cpu_kernel.usable(q, arena[0], arena[1]))
        return ok

    def splits_by_home(self, t: BlockTable) -> bool:
        """FlexGen's --cpu-cache-compute applies: CPU blocks are attended where they live."""
        return self.cpu_cache_compute and self.devices.is_cuda and Tier.CPU in t.homes[:t.num_blocks]

    # --- one cell ahead ---
    def prefetch(self, t: BlockTable, layer: int, kind: str, ahead: Ahead | None, landing_only: bool = False) -> Future:
        """Gather the blocks cell (layer, t) will read, on the I/O pool: planned, or selected from
        the cell's early (or guessed) query; a done future of None when nothing can start yet.
        landing_only: only a planned read whose disk blocks land in flight from this thread, counted
        when waited for (`Landing`): one a step starts for the next (engine/prefetch.py Carry)."""
        if self.in_place(t):
            return Done(None)
        sel, land = self.resident_split(t, self.policy.plan(t, layer))
        if landing_only and not (sel is not None and land and self.lands_later(t)):
            return Done(None)
        if sel is not None and self.reads_rows(t, sel):  # a planned read of a resident cache: in place
            return Done(self._in_place(t, sel))
        if sel is None:
            with self.clock.timed("select"):  # the early query's projection counts here too
                sel = early_selection(self.policy, self.arch, t, layer, kind, ahead, self.io, self.devices,
                                      speculate=self.speculate)
        if sel is None:
            return Done(None)
        if sel.guess:
            return self.io.submit(self._gather_guess, t, sel)
        if land and self.lands_later(t):
            return self._land_later(t, sel, land)
        return self.io.submit(self._gather, t, sel, False, land)

    def lands_later(self, t: BlockTable) -> bool:
        """Whether t's disk blocks are read in flight from this thread (native AIO), counted when
        waited for: then a read started in one step may serve the next (engine/prefetch.py Carry)."""
        return self.io.overlap and not self.devices.streams.active and t.store.disk_file is not None and \
            t.store.disk_file.reads_in_flight()

    def _land_later(self, t: BlockTable, sel: Selection, land: list[int]) -> "Landing | Future":
        """resident_split's gather with its disk blocks' reads put in flight from this thread (native
        AIO on an O_DIRECT file), the rest (the open block) gathered now: the disk reads while the
        cells before compute, with no reader thread to take the GIL or a core from them (one had
        cost a dense step with half its KV on disk 40 % more compute). Where no AIO context can be
        had, the I/O pool's `_gather` reads them into the same landing buffer."""
        buf = self._landing_buffer(t, land)
        later = t.store.land_later(land, buf)
        if later is None:
            return self.io.submit(self._gather, t, sel, False, land, buf)
        return Landing(self._rest(t, sel), list(land), *later)

    def _gather(self, t: BlockTable, sel, on_compute: bool = True, land: list[int] = (),
                buf: torch.Tensor | None = None) -> Fetched:
        """A copy of part of an offloaded cache by a policy that keeps arenas (`arena_share`: a
        selective one that does not observe attention's reads in gather order) goes through the
        recall (only what the table's arena lacks is read; engine/recall.py); the rest, through
        the ring. On CUDA only on the compute stream (on_compute): an arena outlives the step, and
        an I/O-stream write to a slot last read by the compute stream would need an event."""
        if self.recall is not None and self.policy.arena_share() > 0 and not sel.dense and \
                (on_compute or not self.devices.streams.active) and \
                Recall.applies(t, sel) and len(sel.blocks) < t.num_blocks:
            return self.recall.gather(t, sel, self.dtype, self.devices.compute)
        fetched = self._rest(t, sel)
        if land:  # the disk blocks read into the landing ring's next buffer, attended there
            buf = self._landing_buffer(t, land) if buf is None else buf  # unless the caller took it
            fetched.landed = (list(land), t.store.land(land, buf))
        return fetched

    def _rest(self, t: BlockTable, sel: Selection) -> Fetched:
        """sel gathered; or, where it is what resident_split leaves of a whole read and holds no
        sealed block (the open block at most), nothing: attention reads the open block where it is
        filled (attention.py `open_block_part`), as copying it had cost 80 us a layer."""
        if self.reads_whole(sel) and all(b >= t.sealed for b in sel.blocks) and sel.mask is None and \
                sel.rows is None and not sel.recompute and len(sel.blocks) < t.num_blocks:
            return Fetched(None, None, sel, open_in_place=True)
        return gather_selection(t, sel, self.gather_dtype(t), self.devices.compute, self.ring)

    def _landing_buffer(self, t: BlockTable, land: list[int]) -> torch.Tensor:
        """The landing ring's next buffer, sized for t's disk blocks `land`."""
        return self.landing.take((t.store.landing_bytes(len(land)),), torch.uint8, self.devices.compute)

    def gather_dtype(self, t: BlockTable) -> torch.dtype:
        """The dtype a gather from table t lands in: for a policy that reads every block (dense), the
        cache's own 16-bit storage dtype where the compiled CPU kernel attends it as it is (it widens
        as it reads: half the bytes copied, then read, and the copy a plain one); else the compute
        dtype (a selective policy's gathers are small, and its rebuilds, guesses and top-ups compute
        in it), and under --attn-sparsity or with coded blocks."""
        s = t.store
        if (self.devices.is_cuda or not self.policy.reads_all or self.policy.observes or self.sparsity < 1
                or s.coded or s.store_dtype not in (torch.float16, torch.bfloat16) or s.resident_dtype != s.store_dtype
                or cpu_kernel.kernel() is None):
            return self.dtype
        return s.store_dtype

    def _gather_guess(self, t: BlockTable, sel) -> Fetched:
        with self.devices.counters.tag("speculative"):  # what a speculative prefetch moved
            # room for any top-up: the blocks it misses are distinct, so at most the cache's length
            return gather_selection(t, sel, self.gather_dtype(t), self.devices.compute, self.ring, room=t.length)

    # --- at compute time ---
    def attend(self, t: BlockTable, layer: int, q, k, v, fetched: Fetched | None, w, pads):
        """Cell (layer, t)'s decode attention for query q: [B, H, 1, D] and the step's new k, v:
        [B, Hkv, 1, D]: the policy's own when it attends (DKV: it appends too), CPU blocks attended
        where they live (--cpu-cache-compute), else what `read` reads, with the new token. Returns
        (o: [B, H, 1, D], store jobs)."""
        if self.policy.attends:
            return self.policy.attend(t, layer, q, k, v, pads)
        if self.splits_by_home(t):
            return split_by_home(t, q, k, v, pads), t.append(k, v)
        fetched = self.read(t, layer, q, fetched, w, pads)
        landed = fetched.landed if fetched is not None else None
        split = fetched is not None and fetched.rows is None and self.reads_whole(fetched.sel) and \
            len(fetched.sel.blocks) < t.num_blocks  # resident_split's: the rest attended where it is
        resident = self.splits.of(t).resident if split else []  # the rest is fetched.sel, the disk blocks landed
        if fetched is not None and fetched.open_in_place:  # the new token appended to the open block, read there
            b, n = t.sealed, t.length - t.sealed * t.bs
            jobs = t.append(k, v)
            return with_resident_blocks(t, resident, q, open_block_part(t, b, n + 1, pads), pads, landed), jobs
        kv, pos, mask, jobs = self.add_token(t, fetched, k, v)
        rows = fetched.rows if fetched is not None else None  # read in place: the rows attended
        if resident or landed:
            return with_resident_blocks(t, resident, q, gathered_rest(kv, pos, mask, pads), pads, landed), jobs
        o = decode_attention_step(q, kv, pos, mask, pads, sparsity=self.sparsity, rows=rows)
        if self.policy.observes:
            self.policy.observe(t, layer, q, kv.to(q.dtype), pos, fetched.sel if fetched else Selection.all(t))
        return o, jobs

    def read(self, t: BlockTable, layer: int, q: torch.Tensor, fetched: Fetched | None, w,
             pads: torch.Tensor | None) -> Fetched | None:
        """What cell (layer, t) attends for query q: [B, H, 1, D]: what was prefetched, else read
        now; a guess topped up to the exact selection; rebuilt blocks filled in (w: the layer's
        weights). None: the cache is read in place."""
        clock = self.clock
        if fetched is None and not self.in_place(t):
            sel, land = self.resident_split(t, self.policy.plan(t, layer))
            if sel is None:
                with clock.timed("select"):
                    sel = self.policy.select(t, layer, q)
            if self.reads_rows(t, sel, q):
                fetched = self._in_place(t, sel)
            else:
                with self.devices.counters.tag("serial"), clock.timed("read"):  # inside the cell: nothing hides it
                    fetched = self._gather(t, sel, land=land)
        elif fetched is not None and fetched.sel.guess:  # speculative prefetch: keep what the guess read
            with clock.timed("select"):
                sel = self.policy.select(t, layer, q)
            with self.devices.counters.tag("serial"), clock.timed("read"):
                fetched = top_up(t, fetched, sel, self.gather_dtype(t), self.devices.compute)
        if fetched is not None and fetched.hidden is not None:
            with clock.timed("rebuild"):
                rebuild_kv(fetched, self.arch, w, pads)
        whole = fetched is None or self.reads_whole(fetched.sel)
        self.blocks_read[0] += t.num_blocks if whole else len(fetched.sel.blocks)
        self.blocks_read[1] += t.num_blocks
        return fetched

    def reads_rows(self, t: BlockTable, sel: Selection, q: torch.Tensor | None = None) -> bool:
        """A selection from a resident cache is attended where it lies, by its rows (no gather): on
        the compiled CPU kernel, with nothing to rebuild, no policy looking at what was read, and no
        --attn-sparsity. q: the cell's query (None: one of the compute dtype, for a planned read)."""
        if not t.store.resident or sel.recompute or sel.guess or self.policy.observes or self.sparsity < 1:
            return False
        arena = t.store.resident_arena()  # arena: [2, B, Hkv, cap, D]
        return self._kernel_takes_blocks(None, arena) if q is None else cpu_kernel.usable(q, arena[0], arena[1])

    @staticmethod
    def _in_place(t: BlockTable, sel: Selection) -> Fetched:
        """sel read where it lies in a resident cache: its rows [1|B, T], nothing copied."""
        return Fetched(None, None, sel, rows=sel.rows if sel.rows is not None else t.positions(sel.blocks)[None])

    def add_token(self, t: BlockTable, fetched: Fetched | None, k: torch.Tensor, v: torch.Tensor):
        """The step's new token k, v: [B, Hkv, 1, D] joins the table and what attention reads:
        fetched's spare last slot (fetched was gathered before this token), or, read in place, the
        whole cache after the append. Returns (kv: [2, B, Hkv, T+1, D], pos: [T+1] or [B, T+1], mask: [B, Hkv, T]
        or None, store jobs)."""
        if fetched is None:
            jobs = t.append(k, v)
            if t.store.resident:  # in place, in the arena's own dtype (resident_dtype: the kernel widens it)
                return t.store.resident_view(t.length), t.token_positions(), None, jobs
            kv, pos = t.gather()
            return kv, pos, None, jobs
        if fetched.rows is not None:  # read in place: the arena after the append, the new token's row added
            jobs = t.append(k, v)
            if fetched.rows is fetched.sel.rows and fetched.sel.next_rows is not None:
                fetched.rows = fetched.sel.next_rows  # the pick left the new token's row after them
            else:
                new = fetched.rows.new_full((fetched.rows.shape[0], 1), t.length - 1)
                fetched.rows = torch.cat([fetched.rows, new], dim=1)  # rows: [1|B, T+1]
            pos = fetched.rows[0] if fetched.rows.shape[0] == 1 else fetched.rows
            return t.store.resident_view(t.length), pos, fetched.sel.mask, jobs
        kv, pos = fetched.kv, fetched.pos
        kv[0, :, :, -1:].copy_(k)
        kv[1, :, :, -1:].copy_(v)
        pos[..., -1] = t.length
        return kv, pos, fetched.sel.mask, t.append(k, v)
