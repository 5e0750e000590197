"""SparPR's cost model: what it costs to bring one KV block to the compute device by copying it
from its home tier or by rebuilding it from its hidden-state checkpoint, the keep ratio those
costs map to, span merging, and the dense-fallback test. docs/sparpr.md gives the reasoning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..storage.tiers import Devices, Tier
from ..utils.host import disk_key


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def serial(*bandwidths: float) -> float:
    """Bandwidth of hops taken one after the other (disk -> pinned host -> device)."""
    return 1.0 / sum(1.0 / b for b in bandwidths)


@dataclass
class CostModel:
    """Measured speeds of one machine (runtime/probe.py); with `live`, the link bandwidths are
    refreshed from the engine's own timed transfers (`devices.counters.bandwidth`).

    disk_read_Bps: read bandwidth of the disk tier (bytes/s). h2d_Bps: pinned host -> device
    copies; None when the compute device is the CPU (no link to cross). matmul_flops: dtype name
    -> FLOP/s of a matmul on the compute device. matmul_latency_s: dtype name -> seconds of one
    small matmul call, the fixed cost a rebuild pays per K or V projection.
    """

    disk_read_Bps: float
    h2d_Bps: float | None = None
    matmul_flops: dict[str, float] = field(default_factory=dict)
    matmul_latency_s: dict[str, float] = field(default_factory=dict)
    live: bool = True

    def __post_init__(self):
        speeds = [self.disk_read_Bps, *self.matmul_flops.values()]
        if self.h2d_Bps is not None:
            speeds.append(self.h2d_Bps)
        if not all(s > 0 for s in speeds):
            raise ValueError(f"measured speeds must be > 0 (got {self})")
        if not all(s >= 0 for s in self.matmul_latency_s.values()):
            raise ValueError(f"matmul latencies must be >= 0 (got {self.matmul_latency_s})")

    @classmethod
    def from_probe(cls, probe: dict, disk_dir: str | Path) -> "CostModel":
        disk = probe["disk"][disk_key(disk_dir)]
        return cls(disk_read_Bps=disk["read_Bps"], h2d_Bps=probe.get("h2d_Bps"),
                   matmul_flops=dict(probe["matmul_flops"]), matmul_latency_s=dict(probe["matmul_latency_s"]))

    @classmethod
    def from_hardware(cls, hw, live: bool = True) -> "CostModel":
        """From a hardware file (runtime/hardware.py `Hardware`) instead of the start-up probe."""
        return cls(disk_read_Bps=hw.disk_read_bw, h2d_Bps=hw.h2d_bw if hw.is_cuda else None,
                   matmul_flops=dict(hw.flops), matmul_latency_s=dict(hw.matmul_latency_s), live=live)

    def to_dict(self) -> dict:
        return {"disk_read_Bps": self.disk_read_Bps, "h2d_Bps": self.h2d_Bps,
                "matmul_flops": dict(self.matmul_flops), "matmul_latency_s": dict(self.matmul_latency_s),
                "live": self.live}

    # --- links ---
    def disk_Bps(self, devices: Devices) -> float:
        """The engine's own timed disk reads, once there are any (they see its real block sizes
        and page-cache mode); the probe's number before."""
        seen = devices.counters.bandwidth("disk", "cpu") if self.live else None
        return seen if seen else self.disk_read_Bps

    def bandwidth(self, tier: Tier, devices: Devices, fastest: bool = False) -> float:
        """Bytes/s from a block's home tier to the compute device (inf: no link is crossed); fastest:
        the disk at the faster of the live and the probed bandwidth."""
        if tier == Tier.COMPUTE:
            return math.inf
        h2d = self.h2d_Bps if devices.is_cuda and self.h2d_Bps else None
        if tier == Tier.CPU:  # only reachable on CUDA: on a CPU-only machine 'cpu' is compute
            return h2d or math.inf
        disk = max(self.disk_Bps(devices), self.disk_read_Bps) if fastest else self.disk_Bps(devices)
        return serial(disk, h2d) if h2d else disk

    # --- per block ---
    def copy_s(self, nbytes: int, tier: Tier, devices: Devices) -> float:
        """Seconds to copy nbytes home -> compute (KV blocks: codec.nbytes already counts K and V)."""
        return nbytes / self.bandwidth(tier, devices)

    def least_copy_s(self, nbytes: int, tier: Tier, devices: Devices) -> float:
        """The least copying nbytes home -> compute can cost: copy_s at the faster of the live and
        the probed disk bandwidth (the engine's timed reads include a selection's small scattered
        ones, slower than a whole-cache read's long runs)."""
        return nbytes / self.bandwidth(tier, devices, fastest=True)

    def flop_s(self, flops: float, dtype: torch.dtype) -> float:
        name = dtype_name(dtype)
        if name not in self.matmul_flops:
            raise ValueError(f"no measured matmul throughput for {name} (have {sorted(self.matmul_flops)})")
        return flops / self.matmul_flops[name]

    def recompute_s(self, ckpt_nbytes: int, flops: float, tier: Tier, devices: Devices,
                    dtype: torch.dtype) -> float:
        """Seconds to bring a block's checkpoint home -> compute and run the K/V projections."""
        return self.copy_s(ckpt_nbytes, tier, devices) + self.flop_s(flops, dtype)

    def span_overhead_s(self, dtype: torch.dtype) -> float:
        """Fixed cost of one rebuild call: two small projections (K and V)."""
        return 2 * self.matmul_latency_s.get(dtype_name(dtype), 0.0)


def kv_rebuild_flops(batch: int, block_len: int, hidden: int, kv_dim: int) -> int:
    """K and V projections of one block: [B*len, hidden] @ [hidden, kv_dim] twice, 2 FLOP a MAC."""
    return batch * block_len * hidden * 2 * kv_dim * 2


def cost_ratio(copy_s: float, recompute_s: float) -> float:
    """rho = copy cost / recompute cost of a block (0 when nothing costs anything)."""
    if copy_s <= 0:
        return 0.0
    return copy_s / recompute_s if recompute_s > 0 else math.inf


def keep_target(ratio: float, ceiling: float, floor: float) -> float:
    """The dynamic budget's keep ratio: ceiling ** max(1, ratio), never below min(floor, ceiling).

    ratio <= 1 (copying is no dearer than rebuilding): the user's ceiling. Above 1, each unit of
    the ratio applies the ceiling once more, so the target falls geometrically as moving a block
    gets dearer relative to the compute that could replace it; a ceiling of 1 stays 1 (the
    project's contract: keep_ratio 1 reads what dense attention reads)."""
    if not 0 < ceiling <= 1 or not 0 < floor <= 1:
        raise ValueError(f"ceiling and floor must be in (0, 1] (got {ceiling}, {floor})")
    exponent = 1.0 if math.isnan(ratio) else max(1.0, ratio)
    return max(min(floor, ceiling), ceiling ** exponent)


def merge_spans(blocks: Sequence[int], homes: Sequence[Tier]) -> list[list[int]]:
    """Maximal runs of consecutive block ids with one home tier (one transfer each): blocks must
    be ascending and distinct."""
    spans: list[list[int]] = []
    for b in blocks:
        if spans and b == spans[-1][-1] + 1 and homes[b] == homes[spans[-1][-1]]:
            spans[-1].append(b)
        else:
            spans.append([b])
    return spans


def plan_recovery(spans: list[list[int]], copy_s: Sequence[float], recompute_s: Sequence[float],
                  span_overhead_s: float = 0.0) -> tuple[list[int], float]:
    """Per span, copy or rebuild (whichever is cheaper; a tie copies). copy_s / recompute_s are
    per block id (math.inf: cannot be rebuilt). Returns (blocks to rebuild, estimated seconds)."""
    rebuild, total = [], 0.0
    for span in spans:
        c = sum(copy_s[b] for b in span)
        r = sum(recompute_s[b] for b in span) + span_overhead_s
        if r < c:
            rebuild += span
        total += min(c, r)
    return rebuild, total


def should_fall_back(sparse_s: float, dense_s: float, gamma: float) -> bool:
    """Dense fallback: the sparse path is no longer clearly cheaper (sparse > gamma * dense)."""
    return sparse_s > gamma * dense_s
