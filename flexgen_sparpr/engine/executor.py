"""FlexGen's overlapped schedule over (token i, layer j, GPU batch k), in one generation loop.

While layer j computes batch k, the I/O pool loads layer j+1's weights and batch k+1's KV
blocks, and stores the blocks batch k-1 sealed; `overlap=False` runs the same tasks inline.
A step walks its schedule's cells (engine/schedule.py: what each does, as plain numbers) and
the step's run does it (engine/step_run.py: the tensors). What a decode cell's attention reads,
and which attention it runs, is the KVReader's (engine/cell.py). A pipeline stage runs the same
loop over its slice of layers, micro-batch after micro-batch, with a StageLink at the slice's
ends (engine/pipeline.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..kv.block_table import BlockTable
from ..kv.policy import KVPolicy
from ..models import build_arch
from ..storage.device_memory import cap_device
from ..storage.disk_store import DiskStore
from ..storage.tiers import Devices, Tier
from .compute import schedule_layers
from .prefill import prefill
from .cell import KVReader
from .config import EngineConfig, Policy, check_engine
from .io import IOPool
from .kv_tables import build_tables
from .pipeline import StageLink
from .prefetch import Carry
from .sampling import Sampler
from .schedule import StepSchedule, step_schedule
from .state import GenerationResult, GenState, Snapshot
from .step_clock import StepClock
from .step_run import StepRun
from .weights import WeightStore


class Engine:
    """micro_batches: the step's GPU batches run as this many groups one after another, each in
    FlexGen's order (1: FlexGen's schedule). link: this rank's stage of a pipeline (its layers and
    its neighbours); None runs every layer. stream_api: a stand-in for CUDA's streams on a CPU engine
    (tests/stream_double.py)."""

    def __init__(self, source, policy: Policy, cfg: EngineConfig, progress: bool = False,
                 micro_batches: int = 1, link: StageLink | None = None, stream_api=None):
        self.spec, self.policy, self.cfg = source.spec, policy, cfg
        self.run_policy = policy  # the current generation's: a batch of fewer prompts is a smaller batch
        self.link, self.micro_batches = link, micro_batches
        self.arch = build_arch(self.spec)
        self.devices = Devices(cfg.torch_device(), pin_memory=policy.pin_weight, stream_api=stream_api)
        self.gpu_limit = cap_device(self.devices, cfg.gpu_mem)
        self.dtype = cfg.torch_dtype(self.devices.compute)
        self.kv_policy: KVPolicy = cfg.make_kv_policy()
        self.cold_codec: KVPolicy | None = cfg.make_cold_codec()  # its codec stores the CPU / disk blocks
        check_engine(policy, self.spec, link, micro_batches, self.kv_policy, self.cold_codec, self.devices.is_cuda,
                     cfg.kv_bits)
        self.layers = schedule_layers(self.arch, self.spec, policy.sep_layer, link.stage if link else None)
        needs_disk = policy.w_disk_percent > 0 or policy.cache_disk_percent > 0 or \
            any(self.kv_policy.raw_copies(i) == Tier.DISK for i in range(self.spec.num_layers))  # DKV's raw copies
        self.disk = DiskStore(Path(cfg.offload_dir).expanduser(), direct=cfg.direct_io) if needs_disk else None
        self.io = IOPool(self.devices, cfg.io_threads, policy.overlap)
        self.act_home = self.devices.effective(Tier.COMPUTE if policy.act_gpu_percent == 100 else Tier.CPU)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(self.layers), desc="load weights", leave=False)
        try:
            self.weights = WeightStore.for_schedule(source, self.layers, policy, cfg.weight_format, self.devices,
                                                    self.dtype, self.disk, bar)
            self.weight_format = self.weights.fmt
        except BaseException:
            self.close()
            raise
        finally:
            if bar:
                bar.close()
        self.tables: dict[tuple[int, int], BlockTable] = {}
        self._carry: Carry | None = None  # reads a decode step started for the next (engine/prefetch.py)
        self._observers: tuple[KVPolicy, ...] = ()
        self.clock = StepClock()  # where each step's time goes (select, read, rebuild, io_wait, compute)
        self.reader = KVReader(self.kv_policy, self.arch, self.io, self.devices, self.dtype,
                               cpu_cache_compute=policy.cpu_cache_compute, speculate=cfg.speculative_prefetch,
                               sparsity=policy.attn_sparsity, clock=self.clock)
        self._generation = 0
        self.on_step: list = []  # callbacks (prefill: bool, state) after each step, e.g. traces

    @property
    def can_shrink(self) -> bool:
        """Whether a generation may run fewer prompts than the policy's batch as a smaller batch
        (one GPU batch, no pipeline stages: their batch shapes are fixed); else short batches are
        filled up by the caller."""
        return self.policy.num_gpu_batches == 1 and self.link is None

    def free_tables(self) -> None:
        """Close the last generation's block tables now (their memory and offload files), rather
        than at the next prefill."""
        for t in self.tables.values():
            t.close()
        self.tables.clear()

    def _new_tables(self, max_len: int) -> None:
        self.free_tables()
        self._generation += 1  # disk file names stay unique across generations
        self.tables.update(build_tables(
            self.spec, self.run_policy, block_size=self.cfg.block_size, dtype=self.dtype, devices=self.devices,
            disk=self.disk, store_dtype=self.cfg.torch_kv_dtype(self.dtype), kv_bits=self.cfg.kv_bits,
            kv_policy=self.kv_policy,
            cold_codec=self.cold_codec, max_len=max_len,
            name=f"g{self._generation}", observers=self._observers,
            layers=self.link.stage.layers if self.link else None))

    # --- the generation loop ---
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler | None = None,
                 stop: int | None = None, progress: bool = False, keep_logits: bool = False,
                 pad_to: int = 0) -> GenerationResult:
        """Prefill the prompts (left-padded to one length, at least pad_to), then decode up to
        max_new_tokens."""
        state = self.prefill(prompts, max_new_tokens, sampler, keep_logits=keep_logits, pad_to=pad_to,
                             progress=progress)
        return self.decode(state, stop=stop, progress=progress)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler | None = None,
                keep_logits: bool = False, observers: tuple[KVPolicy, ...] = (), pad_to: int = 0,
                progress: bool = False, capacity: int = 0) -> "GenState":
        """Step 0: build the block tables and run the prompt. `observers` are further KV policies
        that see the prefill too (attach + on_prefill), so one prefill can serve several;
        `progress`: a bar over the layers (a long prompt's prefill takes a while); capacity: tokens
        the tables hold at least (room for a kept cache's later turns; engine/reuse.py)."""
        return prefill(self, prompts, max_new_tokens, sampler, keep_logits, observers, pad_to, progress, capacity)

    @torch.inference_mode()
    def decode(self, st: "GenState", stop: int | None = None, progress: bool = False) -> GenerationResult:
        """Decode from a prefilled state until max_new tokens (or every sequence hit `stop`)."""
        for _ in self.decode_steps(st, stop, progress):
            pass
        return st.result()

    @torch.inference_mode()
    def decode_steps(self, st: "GenState", stop: int | None = None, progress: bool = False):
        """The decode loop, one step at a time: yields each step's new tokens [B] as soon as they
        are sampled (streaming); decode() drains it. Closing it early leaves `st` where it stopped."""
        if stop is not None:  # the prefill's token may already be the stop token
            st.done |= st.tokens[0] == stop
        steps = range(len(st.tokens), st.max_new)
        if progress:
            from tqdm import tqdm
            steps = tqdm(steps, desc="decode", unit="tok", leave=False)
        try:
            for _ in steps:
                if stop is not None and bool(st.done.all()):
                    break
                yield self.step(st, stop)
        finally:
            self.drop_carried()
            if progress:
                steps.close()

    @torch.inference_mode()
    def step(self, st: "GenState", stop: int | None = None) -> torch.Tensor:
        """One decode step of a prefilled state: its input st.tokens[-1] joins the cache, and the
        token sampled after it is appended to st.tokens and returned [B]."""
        i = len(st.tokens)
        if i >= st.max_new:
            raise ConfigError(f"the cache holds {st.plen + st.max_new - 1} tokens: it is full")
        length = st.plen + i - 1  # tokens cached before this step's input
        self._advance(st, st.tokens[-1][:, None], (length - st.pads)[:, None], prefill=False, stop=stop,
                      more=i + 1 < st.max_new)
        self.kv_policy.after_step(length, st.step_times[-1])  # SparPR times its sparse and dense steps
        return st.tokens[-1]

    def _advance(self, st: "GenState", ids, pos, prefill: bool, stop: int | None, bar=None, more: bool = False) -> None:
        t0 = time.perf_counter()
        gbs, ngb = self.run_policy.gpu_batch_size, self.run_policy.num_gpu_batches
        # a batch without left padding needs no attention mask (lets SDPA take its fast path)
        pads = [st.pads[k * gbs:(k + 1) * gbs] for k in range(ngb)]
        pads = [p if bool(p.any()) else None for p in pads]
        logits = self._step(ids, pos, pads, prefill, bar, more)  # None on a pipeline stage without the head
        if st.keep_logits and logits is not None:
            st.logits.append(logits.cpu())
        nxt = st.sampler(logits) if logits is not None else None  # nxt: [B]
        if self.link is not None:  # sampled once, on the last stage; every rank goes on with its ids
            nxt = self.link.share_tokens(nxt, len(st.done), st.done.device)
        if stop is not None:
            nxt = torch.where(st.done, torch.full_like(nxt, stop), nxt)
            st.done |= nxt == stop
        st.tokens.append(nxt)
        if self.devices.is_cuda:
            torch.cuda.synchronize(self.devices.compute)
        st.step_times.append(time.perf_counter() - t0)
        st.step_parts.append(self.clock.close(st.step_times[-1]))
        for hook in self.on_step:
            hook(prefill, st)

    def set_kv_policy(self, policy: KVPolicy, attach: bool = True) -> None:
        """Swap the KV policy between runs (attach=False for one that observed the prefill)."""
        self.drop_carried()
        self.kv_policy = self.reader.policy = policy
        if attach:
            for (i, _), t in self.tables.items():
                policy.attach(t, i)

    def snapshot(self, st: "GenState") -> "Snapshot":
        """Remember a state (e.g. right after prefill) so several decodes can start from it."""
        return Snapshot.take(st, self.tables)

    def restore(self, snap: "Snapshot") -> "GenState":
        self.drop_carried()
        return snap.restore(self.tables)

    def _step(self, ids, pos, pads, prefill: bool, bar=None, more: bool = False) -> torch.Tensor | None:
        """One token step (or the prefill) through this engine's layers and every batch; returns
        logits [B, V] (None on a pipeline stage without the head). `bar` (a progress bar) advances once
        per layer; `more`: a decode step follows (this one may start its reads). The schedule says
        what happens at each cell; the run does it."""
        plan = self._schedule()
        carry, self._carry = self._carry, None  # the reads the step before started for this one
        carried = None if carry is None else carry.drop() if prefill else carry.take(plan, self.kv_policy, self.tables)
        run = StepRun(self, ids, pos, pads, prefill, plan, carried, carry=more)
        for cell in plan.cells:
            if cell.is_first:
                run.take_weights(cell)
            if cell.receive is not None:
                run.receive(cell)
            if not prefill:
                run.prefetch(cell)
            run.compute(cell)
            if cell.is_last:
                run.finish_layer()
                if bar is not None:
                    bar.update()
            if cell.send is not None:
                run.send(cell)
        logits = run.end()
        pending, tables = run.carried()
        if pending:
            self._carry = Carry(pending, plan, self.kv_policy, tables)
        return logits

    def drop_carried(self) -> None:
        """Let the reads a step started for the next one go (the generation ended or changed)."""
        carry, self._carry = self._carry, None
        if carry is not None:
            carry.drop()

    def _schedule(self) -> StepSchedule:
        """The current generation's step schedule (cached: the same for every step of a shape)."""
        link = self.link
        return step_schedule(tuple(layer.reads_cache for layer in self.layers), self.run_policy.num_gpu_batches,
                             self.micro_batches, receives=link is not None and not link.stage.is_first,
                             sends=link is not None and not link.stage.is_last)

    def close(self) -> None:
        if getattr(self, "_carry", None) is not None:
            self.drop_carried()
        for t in getattr(self, "tables", {}).values():
            t.close()
        if getattr(self, "weights", None):
            self.weights.close()
        if getattr(self, "io", None):
            self.io.close()
        self.devices.host.close()
        if self.disk is not None:
            self.disk.close()
            self.disk = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

