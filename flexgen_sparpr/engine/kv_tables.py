"""Making the KV block tables of one generation: one per (layer, GPU batch), with the codec the
KV policy or the cold codec asks for, hidden-state checkpoint tables when a policy needs them,
and raw copies of every block when it reads blocks both encoded and exact (DKV's exact routed)."""
from __future__ import annotations

import torch

from ..kv.block_table import BlockTable
from ..kv.policy import KVPolicy
from ..models import cpu_kernel
from ..models.spec import ModelSpec
from ..storage.codec import kv_group_codec
from ..storage.tiers import Devices, Tier, block_homes
from .config import Policy


def build_tables(spec: ModelSpec, placement: Policy, *, block_size: int, dtype: torch.dtype, devices: Devices,
                 disk, store_dtype: torch.dtype | None = None, kv_bits: int | None = None, kv_policy: KVPolicy,
                 cold_codec: KVPolicy | None, max_len: int, name: str,
                 observers: tuple[KVPolicy, ...] = (), layers: range | None = None) -> dict:
    """{(layer, batch): BlockTable} for `max_len` tokens homed by the placement's cache percents,
    attached to kv_policy; `cold_codec`'s codec stores the CPU and disk blocks of the layers
    kv_policy leaves raw; checkpoint tables where kv_policy or an observer wants them. `name`
    prefixes the tables' disk files. store_dtype: how raw CPU and disk blocks are stored (--kv-dtype);
    kv_bits: --kv-dtype q8 / q4, the group codec that stores them instead. layers: the decoder layers to make tables for (a pipeline
    stage's; default all)."""
    homes = block_homes(-(-max_len // block_size), placement.cache_percents)
    keepers = [p for p in (kv_policy, *observers) if p.needs_checkpoints]
    gbs = placement.gpu_batch_size
    kv_shape = (2, gbs, spec.num_kv_heads, block_size, spec.head_dim)
    common = dict(batch=gbs, block_size=block_size, max_len=max_len, dtype=dtype, homes=homes, devices=devices,
                  disk=disk, store_dtype=store_dtype)
    # a CPU computing in float32 keeps its resident raw blocks in store_dtype too, where its decode-attention
    # kernel reads them (widened as they are read): a decode step reads half the bytes
    resident = store_dtype if (store_dtype is not None and store_dtype != dtype and kv_bits is None and
                               devices.compute.type == "cpu" and cpu_kernel.kernel() is not None) else None
    tables = {}
    for i in (range(spec.num_layers) if layers is None else layers):
        codec, coded = kv_policy.codec(kv_shape, dtype, i), None
        if codec is None and cold_codec is not None:  # cold blocks only: compute-tier ones stay raw
            codec, coded = cold_codec.codec(kv_shape, dtype, i), (Tier.CPU, Tier.DISK)
        elif codec is None and kv_bits is not None:  # --kv-dtype q8 / q4: the offloaded blocks quantized
            codec, coded = kv_group_codec(kv_shape, dtype, kv_bits), (Tier.CPU, Tier.DISK)
        for k in range(placement.num_gpu_batches):
            t = BlockTable(name=f"{name}-l{i}-b{k}", num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                           compress=placement.compress_cache, codec=codec, coded_tiers=coded, resident_dtype=resident,
                           **common)
            kv_policy.attach(t, i)
            if any(p.wants_checkpoints(t, spec.hidden) for p in keepers):
                # on the same tiers as the blocks they rebuild (before any block is appended)
                t.checkpoints = BlockTable(name=f"{name}-l{i}-b{k}-ckpt", num_kv_heads=1, head_dim=spec.hidden,
                                           planes=1, **common)
            raw_home = kv_policy.raw_copies(i)
            if raw_home is not None:  # every block also raw, homed on the tier the policy names
                t.raw_copies = BlockTable(name=f"{name}-l{i}-b{k}-raw", num_kv_heads=spec.num_kv_heads,
                                          head_dim=spec.head_dim, **{**common, "homes": [raw_home] * len(homes)})
            tables[(i, k)] = t
    return tables
