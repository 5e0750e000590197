"""The disk read cap that gives this machine another machine's FLOP-per-byte balance.

A decode step computes F FLOPs and moves its KV cache's bytes over the link between the cache's
home and the compute device. Its I/O-to-compute time ratio is (bytes / link B/s) / (F / FLOP/s).
Two machines have the same ratio for the same model and step when

    link_here = flops_here x (bytes_here / bytes_there) x link_there / flops_there

where bytes_here / bytes_there is the KV dtype's size here over there (`kv_bytes_ratio`: this
engine stores the offloaded KV in its default --kv-dtype, float16 on a CPU as on the laptop: 1). The laptop's link is the one its cache crosses:
with the cache split over its homes (the policy file's percent), one byte costs
sum(share_home / bw_home) seconds, so its effective bandwidth is the inverse (the compute
device's own share crosses no link and is left out). FLOP/s is each machine's compute device's
in the dtype its compute runs in, from the hardware files (profiled here, spec sheets there).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime.hardware import Hardware


@dataclass(frozen=True)
class Balance:
    read_Bps: float           # the cap for this machine's disk reads, bytes/s
    there_link_Bps: float     # the other machine's effective KV link
    there_flops: float
    here_flops: float
    dtype_bytes_ratio: float  # KV bytes here / there for the same tokens
    flop_per_byte: float      # the other machine's FLOP/s per byte/s of its KV link

    @property
    def read_mbps(self) -> float:
        return self.read_Bps / 1e6

    def to_dict(self) -> dict:
        return {"read_mbps": self.read_mbps, "there_link_GBps": self.there_link_Bps / 1e9,
                "there_TFLOPS": self.there_flops / 1e12, "here_TFLOPS": self.here_flops / 1e12,
                "kv_dtype_bytes_here_over_there": self.dtype_bytes_ratio, "there_flop_per_byte": self.flop_per_byte}


def kv_link_Bps(hw: Hardware, cache_percent: tuple[float, float, float]) -> float:
    """Effective bytes/s of the link a cache split (compute %, CPU %, disk %) crosses on hw: the
    CPU share over host->device (none when compute is the CPU), the disk share over the disk
    read and then host->device."""
    _, cpu, disk = (float(p) / 100 for p in cache_percent)
    h2d = hw.h2d_bw if hw.compute == "cuda" else 0.0
    per_byte = (cpu / h2d if h2d else 0.0) + disk * (1 / hw.disk_read_bw + (1 / h2d if h2d else 0.0))
    moved = cpu + disk
    if moved <= 0 or per_byte <= 0:
        raise ValueError("the cache split moves nothing across a link (all on the compute device)")
    return moved / per_byte  # bytes/s over the moved share


def kv_bytes_ratio(there_dtype: str = "float16") -> float:
    """Bytes of an offloaded KV value in this engine's default storage on the CPU (--kv-dtype auto,
    computing in float32) over `there_dtype`'s."""
    import torch

    from ..config.options import resolve
    here = resolve({"device": "cpu", "dtype": "float32"})[2].torch_kv_dtype(torch.float32)
    return here.itemsize / getattr(torch, there_dtype).itemsize


def balanced_read(here: Hardware, there: Hardware, there_cache_percent: tuple[float, float, float],
                  here_dtype: str = "float32", there_dtype: str = "float16",
                  dtype_bytes_ratio: float | None = None) -> Balance:
    """The disk read cap for `here` at `there`'s FLOP-per-byte balance (see the module docstring);
    dtype_bytes_ratio None: this engine's default KV storage over there_dtype (kv_bytes_ratio)."""
    if dtype_bytes_ratio is None:
        dtype_bytes_ratio = kv_bytes_ratio(there_dtype)
    link = kv_link_Bps(there, there_cache_percent)
    f_there, f_here = there.compute_flops(there_dtype), here.compute_flops(here_dtype)
    ratio = f_there / link
    return Balance(read_Bps=f_here * dtype_bytes_ratio / ratio, there_link_Bps=link, there_flops=f_there,
                   here_flops=f_here, dtype_bytes_ratio=dtype_bytes_ratio, flop_per_byte=ratio)
