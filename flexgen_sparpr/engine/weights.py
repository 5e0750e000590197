"""Every layer's weights on their home tiers, and loading one layer's weights to compute."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import ConfigError
from ..models.layers import Transposed
from ..models.packed import Packed, unpack_like
from ..storage.codec import GroupCodec
from ..storage.compress import CompressionConfig
from ..storage.tiers import Devices, Tier, split_by_percent
from .table_rows import TableRows
from .weight_format import WeightFormat

WEIGHT_COMPRESSION = CompressionConfig(num_bits=4, group_size=64, group_dim=0)


@dataclass
class StoredWeight:
    home: Tier
    shape: tuple[int, ...]
    data: object  # a tensor (raw or packed row) on compute/CPU, or a disk slot index
    nbytes: int
    codec: GroupCodec | None = None
    file: object = None


class PackedBytes(NamedTuple):
    """A packed weight off the compute tier: one byte buffer (None: on disk), where each of its
    tensors lies in it, and the weight it was made from (its kind and shape)."""

    buf: torch.Tensor | None  # [nbytes] uint8 in host memory
    layout: list
    like: Packed


class WeightStore:
    """layers: per executor layer, {short key: checkpoint name}. percents = (compute, cpu, disk).

    Tensors shared by two layers (tied embeddings) are stored once, where the first layer puts them;
    the LM head's copy of a tied embedding is stored apart when its format packs it (the embedding
    lookup reads raw rows). fmt (engine/weight_format.py): the format each matmul weight is stored in.
    """

    def __init__(self, source, layers: list[dict[str, str]], percents, devices: Devices,
                 dtype: torch.dtype, disk=None, compress: bool = False, pin: bool = True,
                 progress=None, transpose: bool = False, fmt=None, head: int | None = None,
                 embed: int | None = None):
        self.devices, self.dtype = devices, dtype
        self.embed = embed  # the embedding layer: its tables on disk are looked up where they lie (table_rows.py)
        # projections (not embedding tables) of compute-resident layers, stored [in, out]
        self.transpose = transpose
        self.fmt = fmt
        self.stored: dict[str, StoredWeight] = {}
        self.layers = [dict(names) for names in layers]
        self._files = []
        self._resident: dict[int, bool] = {}
        self._loaded: dict[int, dict] = {}
        for j, names in enumerate(self.layers):
            matmul = {n for short, n in names.items() if _is_projection(n) or j == head and short == "tok"}
            fresh = [n for n in dict.fromkeys(names.values()) if n not in self.stored or j == head and n in matmul]
            # a packed format is chosen and packed from the checkpoint's own values (a Q4_1 grid survives
            # no rounding to the compute dtype first); the rest is stored in the compute dtype
            got = {n: source.get(n) for n in fresh}
            chosen = {} if fmt is None or compress else {n: fmt.choose(got[n].float(), head=j == head)
                                                         for n in matmul & set(got)}
            fused = _fuse(names, got, chosen)
            fresh = [n for n in fresh if n in got] + list(fused)
            tensors = [got[n] if chosen.get(n, "raw") != "raw" else got[n].to(dtype) for n in fresh]
            homes = split_by_percent([t.numel() for t in tensors], percents)
            for n, t, home in zip(fresh, tensors, homes):
                w = t
                if n in chosen:  # packed from float32 values; raw: t itself, in the compute dtype
                    w = fmt.store(t.float() if chosen[n] != "raw" else t, j == head, chosen[n], fused.get(n, 1))
                if j == head and n in self.stored:  # the tied embedding: raw already stored
                    if w is t:
                        continue
                    names["tok"] = n = n + "@head"
                self.stored[n] = self._put(n, w, devices.effective(home), disk, compress, pin)
            if progress:
                progress.update(1)

    @classmethod
    def for_schedule(cls, source, layers, policy, weight_format: str, devices: Devices, dtype: torch.dtype,
                     disk=None, progress=None) -> "WeightStore":
        """The weights of the schedule's layers (engine/compute.py Layer) under FlexGen's policy, in
        --weight-format `weight_format` (the LM head: the last layer, when the schedule has it)."""
        compress = policy.compress_weight
        if compress and weight_format not in ("auto", "int4"):
            raise ConfigError(f"--compress-weight chooses the weights' format: not with --weight-format {weight_format}")
        if compress and not devices.is_cuda:
            # FlexGen's 4-bit weights, as the packed int4 kernel multiplies them (no per-step decode);
            # what it cannot hold (embedding tables, odd shapes) stays in the compute dtype
            weight_format, compress = "int4", False
        fmt = WeightFormat(weight_format, devices.compute, dtype, policy.gpu_batch_size)
        head = len(layers) - 1 if layers and layers[-1].kind == "head" else None
        embed = 0 if layers and layers[0].kind == "embed" else None
        return cls(source, [l.names for l in layers], policy.weight_percents, devices, dtype, disk,
                   compress, policy.pin_weight, progress,
                   transpose=transposed_weights(devices, policy, dtype), fmt=fmt, head=head, embed=embed)

    def _put(self, name: str, t, home: Tier, disk, compress: bool, pin: bool) -> StoredWeight:
        dev = self.devices
        if isinstance(t, Packed):
            return self._put_packed(name, t, home, disk, pin)
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

    def _put_packed(self, name: str, p: Packed, home: Tier, disk, pin: bool) -> StoredWeight:
        """A packed weight: on the compute device as it is; on the CPU or disk tier as one byte
        buffer (one read, one copy), viewed back into its tensors when fetched."""
        dev = self.devices
        if home == Tier.COMPUTE:
            return StoredWeight(home, p.shape, unpack_like(p, {k: t.to(dev.compute) for k, t in p.tensors().items()}),
                                p.nbytes)
        buf, layout = _flatten(p)
        if home == Tier.CPU:
            return StoredWeight(home, p.shape, PackedBytes(dev.host.pin(buf) if pin else buf, layout, p), buf.numel())
        if disk is None:
            raise ValueError("weights placed on disk but no --offload-dir store was given")
        f = disk.new_file(f"w-{name}", 1, buf.numel())
        f.write(0, buf)
        self._files.append(f)
        return StoredWeight(home, p.shape, PackedBytes(None, layout, p), buf.numel(), None, f)

    def is_resident(self, j: int) -> bool:
        """Layer j's weights already sit on the compute device as they are multiplied (loading is free)."""
        if j not in self._resident:  # where a weight lives is fixed at load
            self._resident[j] = all(self.stored[n].home == Tier.COMPUTE and self.stored[n].codec is None
                                    for n in self.layers[j].values())
        return self._resident[j]

    def load(self, j: int) -> dict[str, torch.Tensor]:
        """Layer j's weights on the compute device: {short key: tensor} (a resident layer's: one dict
        made once, read-only to its users)."""
        if self.is_resident(j):
            if j not in self._loaded:
                self._loaded[j] = {short: self.fetch(full) for short, full in self.layers[j].items()}
            return self._loaded[j]
        return {short: self._table_rows(full) if j == self.embed and short in LOOKUP_TABLES else self.fetch(full)
                for short, full in self.layers[j].items()}

    def _table_rows(self, name: str):
        """An embedding table: raw on the disk tier, as TableRows (read by row); else fetched."""
        w = self.stored[name]
        if w.home == Tier.DISK and w.codec is None and not isinstance(w.data, PackedBytes) and len(w.shape) == 2:
            return TableRows(w, self.dtype, self.devices)
        return self.fetch(name)

    def fetch(self, name: str) -> torch.Tensor:
        w, dev = self.stored[name], self.devices
        if isinstance(w.data, PackedBytes):  # packed, on the CPU or disk tier
            return self._fetch_packed(w)
        if w.home == Tier.DISK:
            host = dev.empty_host(w.shape, torch.uint8 if w.codec else self.dtype)
            w.file.read(0, host)
            dev.counters.add("disk", "cpu", host.nbytes)
            t = host
        else:
            t = w.data
        if isinstance(t, (Transposed, Packed)):
            return t
        if t.device != dev.compute:
            t = dev.host.to_compute_new(t)
            dev.counters.add("cpu", "compute", t.nbytes)
        return w.codec.decode(t) if w.codec else t

    def _fetch_packed(self, w: StoredWeight):
        dev = self.devices
        buf, layout, like = w.data
        if w.home == Tier.DISK:
            buf = dev.empty_host((w.nbytes,), torch.uint8)
            w.file.read(0, buf)
            dev.counters.add("disk", "cpu", buf.nbytes)
        if buf.device != dev.compute:
            buf = dev.host.to_compute_new(buf)
            dev.counters.add("cpu", "compute", buf.nbytes)
        return unpack_like(like, _unflatten(buf, layout))

    def nbytes_on(self, tier: Tier) -> int:
        return sum(w.nbytes for w in self.stored.values() if w.home == tier)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()


LOOKUP_TABLES = ("tok", "pos")  # an embedding layer's tables, indexed by token or position (models/*.py embed)

# projections that one packed product serves, when both are in the same packed format and have no
# bias: one kernel call and one activation cast instead of two (the engine reads the fused key)
FUSED = (("k.w", "v.w", "kv.w"), ("q.w", "kv.w", "qkv.w"), ("gate.w", "up.w", "gate_up.w"))  # in this order


def _fuse(names: dict[str, str], got: dict[str, torch.Tensor], chosen: dict[str, str]) -> dict[str, int]:
    """Fuse FUSED pairs of a layer in place: their tensors in `got` (and formats in `chosen`) become
    one [out_a + out_b, in] tensor under a new name, which `names` maps the fused key to (a pair
    may fuse a fused one: q with k|v). Returns {fused name: the checkpoint weights it holds}."""
    out = {}
    for prefix in ("", "a.", "m."):
        for a, b, key in FUSED:
            na, nb = names.get(prefix + a), names.get(prefix + b)
            if na is None or nb is None or prefix + a[:-1] + "b" in names or prefix + b[:-1] + "b" in names:
                continue
            if na not in chosen or nb not in chosen or chosen[na] != chosen[nb] or chosen[na] == "raw":
                continue
            name = f"{na}+{b[:-2]}"
            got[name] = torch.cat([got.pop(na), got.pop(nb)])  # [out_a + out_b, in]
            chosen[name] = chosen.pop(na)
            chosen.pop(nb)
            del names[prefix + a], names[prefix + b]
            names[prefix + key] = name
            out[name] = out.pop(na, 1) + out.pop(nb, 1)
    return out


def _flatten(p: Packed):
    """A packed weight's tensors as one byte buffer [nbytes] uint8, and where each lies in it."""
    parts = {k: t.contiguous() for k, t in p.tensors().items()}
    layout, offset = [], 0
    for k, t in parts.items():
        layout.append((k, t.dtype, tuple(t.shape), offset, t.numel() * t.element_size()))
        offset += -(-layout[-1][-1] // 8) * 8  # each part 8-byte aligned, so its dtype view is valid
    buf = torch.empty(offset, dtype=torch.uint8)
    for (k, _, _, off, n), t in zip(layout, parts.values()):
        buf[off:off + n] = t.view(-1).view(torch.uint8)
    return buf, layout


def _unflatten(buf: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    return {k: buf[off:off + n].view(dtype).view(shape) for k, dtype, shape, off, n in layout}


def _is_projection(name: str) -> bool:
    """A linear layer's weight (not an embedding or position table, not a norm)."""
    return name.endswith("proj.weight") or name.endswith(("fc1.weight", "fc2.weight"))


def sub_weights(w: dict, prefix: str) -> dict:
    """The weights of one half of a fused layer ("a." attention, "m." MLP), prefix dropped."""
    return {key[len(prefix):]: t for key, t in w.items() if key.startswith(prefix)}


def transposed_weights(devices, policy, dtype: torch.dtype) -> bool:
    """One sequence per batch on CPU: every decode product is a single row, which CPU BLAS runs
    fastest against [in, out] weights (measured 1.6x); other shapes keep [out, in]. bfloat16
    weights keep [out, in] for the compiled product that reads them (models/layers.linear)."""
    return not devices.is_cuda and policy.gpu_batch_size == 1 and dtype != torch.bfloat16

