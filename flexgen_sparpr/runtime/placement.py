"""`--policy auto`: choose the six --percent numbers and the batch split from a Hardware file.

A small cost model of FlexGen's zig-zag schedule (docs/hardware.md gives its assumptions): per
layer, the weights not on the compute tier cross the links once per step (shared by every GPU
batch), the KV cache not on the compute tier is read once per decode step, and the new K/V are
written home; links (host->device, device->host, disk read, disk write) and compute are separate
resources, so with --overlap a layer costs the slowest of them, without it their sum. Compute is
a roofline: max(FLOPs / matmul FLOP/s, bytes read from device memory / memory bandwidth). Every
(weight, cache) percent pair on a grid and every activation tier and batch split is scored at once
(numpy, no LP solver); a plan must fit each tier with a margin. Ties go to the plan keeping more
on the compute tier, less on disk, and fewer GPU batches.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..errors import NoPlacementFits
from ..models.spec import ModelSpec
from .hardware import GiB, Hardware, gathers_ahead

DEVICE_MARGIN = 0.05     # of the compute device's usable memory: allocator slack, fragmentation
HOST_MARGIN = 0.10       # of host memory: the OS, page cache, pinned-allocation rounding
DISK_MARGIN = 0.05
HOST_RESERVE = 1 * GiB   # the Python process, torch and the tokenizer, on the host
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
COMPRESSED_BYTES = 4.5 / 8  # 4-bit codes + a 16-bit scale and min per group of 64
CALLS_PER_LAYER = 6      # q, k, v, out, fc1, fc2: the matmul calls one GPU batch makes per layer


@dataclass(frozen=True)
class Workload:
    """What runs: the model, lengths, the total batch (split into GPU batches) and dtype."""

    spec: ModelSpec
    prompt_len: int
    gen_len: int
    batch_size: int = 4
    dtype: str = "float16"
    overlap: bool = True
    compress_weight: bool = False
    compress_cache: bool = False
    # what the KV policy keeps on the compute device per cached token wherever the cache lives,
    # as a share of the raw K+V (SparPR's key summaries, Quest's key bounds, DKV's exact rows):
    # the KV policy's resident_share (kv/policy.py)
    resident_share: float = 0.0
    # the same in host memory (the KV policy's host_share: SparPR's summaries with --summaries-on cpu)
    host_share: float = 0.0
    # the share of the cache one decode step reads and attends (a sparse KV policy's keep ratio)
    kv_read_share: float = 1.0
    # what each offloaded table keeps on the compute device of what it read, as a share of its
    # raw K+V in the compute dtype (the KV policy's arena_share: engine/recall.py)
    kv_arena_share: float = 0.0
    # tokens per KV block (0: not counted): the cache is allocated in whole blocks, and each
    # (layer, GPU batch) fills its open block on the compute device
    block_size: int = 0
    # times a step streams each offloaded layer's weights: a pipeline stage running its
    # micro-batches one after another loads them once per micro-batch (runtime/stages.py)
    weight_passes: int = 1

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (got {self.dtype})")
        for name in ("resident_share", "host_share"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if not 0 < self.kv_read_share <= 1:
            raise ValueError(f"kv_read_share must be in (0, 1] (got {self.kv_read_share})")
        if not 0 <= self.kv_arena_share <= 1:
            raise ValueError(f"kv_arena_share must be in [0, 1] (got {self.kv_arena_share})")
        if min(self.prompt_len, self.gen_len, self.batch_size) < 1:
            raise ValueError("prompt_len, gen_len and batch_size must be >= 1")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (got {self.block_size})")
        if self.weight_passes < 1:
            raise ValueError(f"weight_passes must be >= 1 (got {self.weight_passes})")

    @property
    def kv_tokens(self) -> int:
        """Cache tokens allocated per sequence: prompt + gen, in whole blocks."""
        n, bs = self.prompt_len + self.gen_len, self.block_size
        return -(-n // bs) * bs if bs else n


@dataclass(frozen=True)
class Plan:
    """A chosen placement and its predicted times (seconds) and memory (bytes per tier)."""

    percent: tuple[int, int, int, int, int, int]
    gpu_batch_size: int
    num_gpu_batches: int
    prefill_s: float
    decode_step_s: float          # one decode step of the whole batch
    total_s: float                # prefill + (gen_len - 1) decode steps
    bottleneck: str               # the slowest resource of a decode layer
    memory: dict[str, float] = field(default_factory=dict)

    def per_token_s(self, gen_len: int) -> float:
        return self.total_s / gen_len

    def describe(self, gen_len: int) -> str:
        pct = " ".join(str(p) for p in self.percent)
        return (f"--percent {pct} --gpu-batch-size {self.gpu_batch_size} --num-gpu-batches "
                f"{self.num_gpu_batches}; predicted {self.per_token_s(gen_len):.4f} s/token "
                f"(prefill {self.prefill_s:.3f} s, decode step {self.decode_step_s:.4f} s, "
                f"bound by {self.bottleneck})")


def _pairs(step: int, with_cpu: bool) -> np.ndarray:
    """(compute %, cpu %) pairs on the grid; disk gets the rest."""
    grid = range(0, 101, step)
    return np.array([(g, c) for g in grid for c in (grid if with_cpu else [0]) if g + c <= 100], dtype=float)


def _splits(batch: int) -> list[tuple[int, int]]:
    return [(batch // n, n) for n in range(1, batch + 1) if batch % n == 0]


def tier_use(wl: Workload, cuda: bool, wg, wc, cg, cc, gbs: int, act_on_cpu: bool) -> dict[str, dict]:
    """Predicted bytes per tier ("compute", "cpu", "disk"), each split into "weights", "kv" and
    "working" (buffers, activations, the KV policy's resident share, the process itself), for
    the weight shares wg, wc and cache shares cg, cc (fractions; disk gets the rest; numpy
    arrays broadcast). On a CPU-only machine the compute tier is host memory: "compute" holds
    everything in host memory and "cpu" is zero. `--policy auto` and the check of an explicit
    --percent (runtime/capacity.py) both use this."""
    s, L = wl.spec, wl.spec.num_layers
    b = DTYPE_BYTES[wl.dtype]
    wb = COMPRESSED_BYTES if wl.compress_weight else b
    cb = COMPRESSED_BYTES if wl.compress_cache else b
    W = s.num_params() * wb                      # all weights, bytes
    Wl = W / L                                   # embeddings and head spread over the layers
    B, p, n_kv = wl.batch_size, wl.prompt_len, wl.kv_tokens
    kv_tok = 2 * s.kv_dim * cb                   # K and V of one token, one layer
    KV = B * n_kv * kv_tok * L                   # the whole cache at its largest
    resident = wl.resident_share * B * n_kv * 2 * s.kv_dim * b * L  # the policy's share on compute
    wd, cd = 1 - wg - wc, 1 - cg - cc
    # working set on the compute device: streamed layers double-buffered, the KV of one
    # (layer, GPU batch) gathered into each buffer of the gather ring, one batch's prefill activations
    # (q, k, v, attention out, MLP hidden) and logits,
    # and every (layer, GPU batch)'s open block (a sparse policy's gather buffer is sized as
    # dense's: the union of a batch's picks can be all); a sparse policy's offloaded tables each
    # keep an arena of what they read (engine/recall.py)
    arena = (1 - cg) * L * B * n_kv * 2 * s.kv_dim * b * wl.kv_arena_share
    work = (arena + 2 * (1 - wg) * Wl + (gathers_ahead(cuda) + 2) * (1 - cg) * gbs * n_kv * kv_tok
            + gbs * p * (5 * s.hidden + s.ffn) * b + gbs * s.vocab * 4
            + L * B * wl.block_size * 2 * s.kv_dim * b)
    act = B * p * s.hidden * b                         # hidden states of every batch
    staging = 2 * wd * Wl + 2 * cd * gbs * n_kv * kv_tok  # disk reads land on the host first
    host_work = HOST_RESERVE + staging + (act if act_on_cpu else 0) + wl.host_share * B * n_kv * 2 * s.kv_dim * b * L
    dev_work = work + resident + (0 if act_on_cpu else act)
    disk = {"weights": wd * W, "kv": cd * KV, "working": 0 * wd}
    if cuda:
        return {"compute": {"weights": wg * W, "kv": cg * KV, "working": dev_work},
                "cpu": {"weights": wc * W, "kv": cc * KV, "working": host_work}, "disk": disk}
    zero = {"weights": 0.0, "kv": 0.0, "working": 0.0}
    return {"compute": {"weights": (wg + wc) * W, "kv": (cg + cc) * KV, "working": host_work + dev_work},
            "cpu": zero, "disk": disk}


def tier_capacity(hw: Hardware) -> dict[str, float]:
    """Bytes a plan may use per tier: each tier's capacity less its margin (cpu-only: one pool,
    "compute")."""
    if hw.is_cuda:
        return {"compute": hw.compute_memory * (1 - DEVICE_MARGIN), "cpu": hw.cpu_memory * (1 - HOST_MARGIN),
                "disk": hw.disk_free * (1 - DISK_MARGIN)}
    return {"compute": min(hw.cpu_memory, hw.compute_memory) * (1 - HOST_MARGIN), "cpu": 0.0,
            "disk": hw.disk_free * (1 - DISK_MARGIN)}


def total_bytes(parts: dict):
    return parts["weights"] + parts["kv"] + parts["working"]


def within(use: dict[str, dict], hw) -> dict:
    """Per tier, whether tier_use's bytes fit hw's usable capacity (tier_capacity; numpy arrays
    broadcast; cpu-only: the "cpu" tier is not a pool of its own). The one test of fitting:
    `--policy auto` keeps only plans it passes, and the check of a placement before a run
    (runtime/capacity.py) refuses what it fails."""
    cap = tier_capacity(hw)
    return {t: (total_bytes(parts) <= cap[t]) if t != "cpu" or hw.is_cuda else True for t, parts in use.items()}


def fits(use: dict[str, dict], hw):
    """All tiers `within` their capacity (a bool, or a bool array for arrays of shares)."""
    ok = within(use, hw)
    return ok["compute"] & ok["cpu"] & ok["disk"]


def candidates(wl: Workload, hw: Hardware, step: int = 5, split: tuple[int, int] | None = None) -> list[dict]:
    """The best feasible grid point per (activation tier, batch split), as dicts (percent,
    split, times, memory); empty when nothing fits. split: only this (gpu batch size, GPU
    batches) instead of every exact split of the batch."""
    s, L = wl.spec, wl.spec.num_layers
    b = DTYPE_BYTES[wl.dtype]
    wb = COMPRESSED_BYTES if wl.compress_weight else b
    cb = COMPRESSED_BYTES if wl.compress_cache else b
    cuda = hw.is_cuda
    W = s.num_params() * wb                      # all weights, bytes
    Wl = W / L                                   # embeddings and head spread over the layers
    Pl = s.num_params() / L
    B, p, g = wl.batch_size, wl.prompt_len, wl.gen_len
    s_mean = p + g / 2
    kv_tok = 2 * s.kv_dim * cb                   # K and V of one token, one layer
    flops_rate = hw.compute_flops(wl.dtype)
    mem_bw = hw.compute_memory_bw

    w = _pairs(step, cuda)[:, None, :]           # [Nw, 1, 2]
    c = _pairs(step, cuda)[None, :, :]           # [1, Nc, 2]
    wg, wc, cg, cc = w[..., 0] / 100, w[..., 1] / 100, c[..., 0] / 100, c[..., 1] / 100
    wd, cd = (100 - w[..., 0] - w[..., 1]) / 100, (100 - c[..., 0] - c[..., 1]) / 100
    call_s = CALLS_PER_LAYER * hw.matmul_latency_s.get(wl.dtype, 0.0)
    off_w, off_c = (wc + wd, cc + cd) if cuda else (0 * wg, 0 * cg)  # shares crossing host->device

    def layer_time(h2d, d2h, dread, dwrite, flops, dev_bytes, ngb):
        # roofline per GPU batch (each one re-reads the layer's weights from device memory),
        # plus the fixed cost of its matmul calls
        comp = flops / flops_rate
        if mem_bw > 0:
            comp = np.maximum(comp, dev_bytes / mem_bw)
        comp = comp + ngb * call_s
        parts = {"compute": comp + 0 * h2d, "disk read": dread / hw.disk_read_bw,
                 "disk write": dwrite / hw.disk_write_bw}
        if cuda:
            parts["host->device"] = h2d / hw.h2d_bw
            parts["device->host"] = d2h / hw.d2h_bw
        stack = np.stack(np.broadcast_arrays(*parts.values()))
        total = stack.max(axis=0) if wl.overlap else stack.sum(axis=0)
        return total, np.array(list(parts))[stack.argmax(axis=0)]

    plans = []
    splits = [split] if split is not None else _splits(B)
    for (gbs, ngb), act_on_cpu in itertools.product(splits, (False, True) if cuda else (False,)):
        act_hop = B * s.hidden * b if act_on_cpu else 0.0  # hidden states in from and out to the host
        # decode layer: weights cross once per step (shared by the GPU batches), the cache is read
        # once, the new token's K/V are written home
        kv_read = B * s_mean * kv_tok * wl.kv_read_share
        Wp = Wl * wl.weight_passes  # streamed weight bytes per layer and step
        dec, bott = layer_time(h2d=off_w * Wp + off_c * kv_read + act_hop,
                               d2h=off_c * B * kv_tok + act_hop,
                               dread=wd * Wp + cd * kv_read, dwrite=cd * B * kv_tok,
                               flops=2 * B * Pl + 4 * B * s_mean * s.hidden * wl.kv_read_share,
                               dev_bytes=ngb * Wl + kv_read, ngb=ngb)
        pre, _ = layer_time(h2d=off_w * Wp + act_hop * p, d2h=off_c * B * p * kv_tok + act_hop * p,
                            dread=wd * Wp, dwrite=cd * B * p * kv_tok,
                            flops=2 * B * p * Pl + 2 * B * p * p * s.hidden,
                            dev_bytes=ngb * Wl + B * p * kv_tok, ngb=ngb)
        total = L * pre + (g - 1) * L * dec
        use = tier_use(wl, cuda, wg, wc, cg, cc, gbs, act_on_cpu)
        used = {tier: total_bytes(parts) for tier, parts in use.items()}
        ok = np.broadcast_to(fits(use, hw), total.shape)
        if not ok.any():
            continue
        gpu_share, cpu_share = np.broadcast_arrays(w[..., 0] + c[..., 0], w[..., 1] + c[..., 1])
        t = np.where(ok, np.round(total, 9), np.inf)
        i, j = np.unravel_index(np.lexsort((-cpu_share.ravel(), -gpu_share.ravel(), t.ravel()))[0], t.shape)
        pw, pc = w[i, 0], c[0, j]
        at = lambda a: float(np.broadcast_to(a, total.shape)[i, j])  # noqa: E731
        plans.append({
            "percent": (int(pw[0]), int(pw[1]), int(pc[0]), int(pc[1]),
                        0 if act_on_cpu else 100, 100 if act_on_cpu else 0),
            "split": (gbs, ngb), "total_s": at(total), "prefill_s": L * at(pre),
            "decode_step_s": L * at(dec), "bottleneck": str(np.broadcast_to(bott, total.shape)[i, j]),
            "memory": {tier: at(u) for tier, u in used.items()}})  # cpu-only: one pool, "compute"
    return plans


def choose(wl: Workload, hw: Hardware, step: int = 5) -> Plan:
    """The fastest feasible plan (ties: more on the compute tier, less on disk, fewer GPU
    batches); NoPlacementFits when nothing fits."""
    if not 1 <= step <= 50 or 100 % step:
        raise ValueError(f"grid step must divide 100 (got {step})")
    plans = candidates(wl, hw, step)
    if not plans:
        raise NoPlacementFits(f"no placement of {wl.spec.name} (batch {wl.batch_size}, {wl.prompt_len}+"
                              f"{wl.gen_len} tokens, {wl.dtype}) fits {hw.name}'s memory and disk")

    def key(pl):
        pct = pl["percent"]
        return (round(pl["total_s"], 9), -(pct[0] + pct[2]), -(pct[1] + pct[3]), pl["split"][1], -pct[4])

    best = min(plans, key=key)
    return Plan(percent=best["percent"], gpu_batch_size=best["split"][0], num_gpu_batches=best["split"][1],
                prefill_s=best["prefill_s"], decode_step_s=best["decode_step_s"], total_s=best["total_s"],
                bottleneck=best["bottleneck"], memory=best["memory"])


# --- memory: does an all-on-device run fit? ---
def device_bytes_needed(spec: ModelSpec, batch: int, context: int, dtype_bytes: int) -> dict[str, int]:
    """Weights + full KV cache + the prefill's largest activations, all on the compute device
    (what a system that holds everything on the device needs; no allocator slack counted)."""
    w = spec.num_params() * dtype_bytes
    kv = 2 * batch * context * spec.num_layers * spec.kv_dim * dtype_bytes
    act = batch * context * (spec.hidden + spec.ffn) * dtype_bytes
    act += batch * spec.num_heads * context * context * dtype_bytes  # eager attention's [B, H, S, S] scores
    return {"weights": w, "kv": kv, "activations": act, "total": w + kv + act}
