"""Every layer's weights on their home tiers, and loading one layer's weights to compute."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import Transposed
from ..storage.codec import GroupCodec
from ..storage.compress import CompressionConfig
from ..storage.tiers import Devices, Tier, split_by_percent

WEIGHT_COMPRESSION = CompressionConfig(num_bits=4, group_size=64, group_dim=0)


@dataclass
class StoredWeight:
    home: Tier
    shape: tuple[int, ...]
    data: object  # a tensor (raw or packed row) on compute/CPU, or a disk slot index
    nbytes: int
    codec: GroupCodec | None = None
    file: object = None


class WeightStore:
    """layers: per executor layer, {short key: checkpoint name}. percents = (compute, cpu, disk).

    Tensors shared by two layers (tied embeddings) are stored once, where the first layer puts them.
    """

    def __init__(self, source, layers: list[dict[str, str]], percents, devices: Devices,
                 dtype: torch.dtype, disk=None, compress: bool = False, pin: bool = True,
                 progress=None, transpose: bool = False):
        self.layers, self.devices, self.dtype = layers, devices, dtype
        # projections (not embedding tables) of compute-resident layers, stored [in, out]
        self.transpose = transpose
        self.stored: dict[str, StoredWeight] = {}
        self._files = []
        for names in layers:
            fresh = [n for n in dict.fromkeys(names.values()) if n not in self.stored]
            tensors = [source.get(n) for n in fresh]
            homes = split_by_percent([t.numel() for t in tensors], percents)
            for n, t, home in zip(fresh, tensors, homes):
                self.stored[n] = self._put(n, t.to(dtype), devices.effective(home), disk, compress, pin)
            if progress:
                progress.update(1)

    def _put(self, name: str, t: torch.Tensor, home: Tier, disk, compress: bool, pin: bool) -> StoredWeight:
        dev = self.devices
        codec = GroupCodec(tuple(t.shape), self.dtype, WEIGHT_COMPRESSION) if compress and t.dim() >= 2 else None
        if codec:
            t = codec.encode(t.to(dev.compute) if home == Tier.COMPUTE else t)
        nbytes = t.numel() * t.element_size()
        if home == Tier.COMPUTE:
            if self.transpose and codec is None and _is_projection(name):
                return StoredWeight(home, tuple(t.shape), Transposed(t.T.contiguous().to(dev.compute)), nbytes)
            return StoredWeight(home, tuple(t.shape), t.to(dev.compute), nbytes, codec)
        if home == Tier.CPU:
            host = dev.host.pin(t) if pin else t.contiguous()  # page-locked once, at its exact size
            return StoredWeight(home, tuple(t.shape), host, nbytes, codec)
        if disk is None:
            raise ValueError("weights placed on disk but no --offload-dir store was given")
        f = disk.new_file(f"w-{name}", 1, nbytes)
        f.write(0, t.contiguous())
        self._files.append(f)
        return StoredWeight(home, tuple(t.shape), 0, nbytes, codec, f)

    def is_resident(self, j: int) -> bool:
        """Layer j's weights already sit raw on the compute device (loading is free)."""
        return all(self.stored[n].home == Tier.COMPUTE and self.stored[n].codec is None
                   for n in self.layers[j].values())

    def load(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's weights on the compute device: {short key: tensor}."""
        return {short: self.fetch(full) for short, full in self.layers[j].items()}

    def fetch(self, name: str) -> torch.Tensor:
        w, dev = self.stored[name], self.devices
        if w.home == Tier.DISK:
            host = dev.empty_host(w.shape, torch.uint8 if w.codec else self.dtype)
            w.file.read(0, host)
            dev.counters.add("disk", "cpu", host.nbytes)
            t = host
        else:
            t = w.data
        if isinstance(t, Transposed):
            return t
        if t.device != dev.compute:
            t = dev.host.to_compute_new(t)
            dev.counters.add("cpu", "compute", t.nbytes)
        return w.codec.decode(t) if w.codec else t

    def nbytes_on(self, tier: Tier) -> int:
        return sum(w.nbytes for w in self.stored.values() if w.home == tier)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()


def _is_projection(name: str) -> bool:
    """A linear layer's weight (not an embedding or position table, not a norm)."""
    return name.endswith("proj.weight") or name.endswith(("fc1.weight", "fc2.weight"))


def sub_weights(w: dict, prefix: str) -> dict:
    """The weights of one half of a fused layer ("a." attention, "m." MLP), prefix dropped."""
    return {key[len(prefix):]: t for key, t in w.items() if key.startswith(prefix)}


def transposed_weights(devices, policy) -> bool:
    """One sequence per batch on CPU: every decode product is a single row, which CPU BLAS runs
    fastest against [in, out] weights (measured 1.6x); other shapes keep [out, in]."""
    return not devices.is_cuda and policy.gpu_batch_size == 1

