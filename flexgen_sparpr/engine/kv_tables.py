"""Making the KV block tables of one generation: one per (layer, GPU batch), with the codec the
KV policy or the cold codec asks for, and hidden-state checkpoint tables when a policy needs them."""
from __future__ import annotations

from ..kv.block_table import BlockTable
from ..kv.policy import KVPolicy
from ..storage.tiers import Tier, block_homes


def build_tables(eng, max_len: int, generation: int, observers: tuple[KVPolicy, ...]) -> dict:
    """{(layer, batch): BlockTable} for `max_len` tokens, attached to the engine's KV policy."""
    spec, pol, cfg, kvp, cold = eng.spec, eng.policy, eng.cfg, eng.kv_policy, eng.cold_codec
    homes = block_homes(-(-max_len // cfg.block_size), pol.cache_percents)
    keepers = [p for p in (kvp, *observers) if p.needs_checkpoints]
    kv_shape = (2, pol.gpu_batch_size, spec.num_kv_heads, cfg.block_size, spec.head_dim)
    common = dict(batch=pol.gpu_batch_size, block_size=cfg.block_size, max_len=max_len, dtype=eng.dtype,
                  homes=homes, devices=eng.devices, disk=eng.disk)
    tables = {}
    for i in range(spec.num_layers):
        codec, coded = kvp.codec(kv_shape, eng.dtype, i), None
        if codec is None and cold is not None:  # cold blocks only: compute-tier ones stay raw
            codec, coded = cold.codec(kv_shape, eng.dtype, i), (Tier.CPU, Tier.DISK)
        for k in range(pol.num_gpu_batches):
            t = BlockTable(name=f"g{generation}-l{i}-b{k}", num_kv_heads=spec.num_kv_heads,
                           head_dim=spec.head_dim, compress=pol.compress_cache, codec=codec,
                           coded_tiers=coded, **common)
            kvp.attach(t, i)
            if any(p.wants_checkpoints(t, spec.hidden) for p in keepers):
                # on the same tiers as the blocks they rebuild (before any block is appended)
                t.checkpoints = BlockTable(name=f"g{generation}-l{i}-b{k}-ckpt", num_kv_heads=1,
                                           head_dim=spec.hidden, planes=1, **common)
            tables[(i, k)] = t
    return tables
