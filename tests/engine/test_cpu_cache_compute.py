"""FlexGen's --cpu-cache-compute: CPU-homed blocks are attended on the host where they live and
merged by log-sum-exp with the rest; with an encoded CPU tier (--compress-cache) they are
decoded there (they have no raw arena to read)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flexgen_sparpr.engine.attention import split_by_home
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.models.layers import decode_attention
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source


@dataclass
class UnfoldedDevices(Devices):
    """A CPU machine laid out like a CUDA one: the CPU tier keeps its own storage."""

    def effective(self, tier: Tier) -> Tier:
        return tier


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("pads", [None, [0, 3]])
def test_split_by_home_equals_attention_over_the_gathered_cache(compress, pads):
    b, h, hkv, d, bs = 2, 4, 2, 16, 4
    t = BlockTable(name="t", batch=b, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=6 * bs,
                   dtype=torch.float32, homes=[Tier.CPU] * 3 + [Tier.COMPUTE] * 3,
                   devices=UnfoldedDevices(torch.device("cpu")), compress=compress)
    g = torch.Generator().manual_seed(0)
    k_all, v_all = (torch.randn(b, hkv, 4 * bs + 1, d, generator=g) for _ in range(2))  # 4 sealed blocks + 1
    for job in t.append(k_all, v_all):
        job()
    q, k, v = (torch.randn(b, n, 1, d, generator=g) for n in (h, hkv, hkv))
    pads_t = None if pads is None else torch.tensor(pads)
    kv, pos = t.gather()  # kv: [2, B, Hkv, T, D] (CPU rows decoded when encoded)
    valid = None if pads_t is None else torch.cat([pos, torch.tensor([t.length])])[None, :] >= pads_t[:, None]
    ref = decode_attention(q, torch.cat([kv[0], k], 2), torch.cat([kv[1], v], 2), valid)
    got = split_by_home(t, q, k, v, pads_t)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cpu_cache_compute_with_compressed_cache_on_cuda(tiny_model_dir, tmp_path, cuda_device):
    """The same tokens and logits as the gathered path, whose blocks are decoded on the device."""
    src = resolve_source(str(tiny_model_dir), "")
    prompts = [list(range(3, 30)), list(range(40, 52))]
    out = []
    for cpu_compute in (False, True):
        pol = Policy(gpu_batch_size=2, cache_gpu_percent=30, cache_cpu_percent=70, compress_cache=True,
                     cpu_cache_compute=cpu_compute)
        cfg = EngineConfig(device=cuda_device, dtype="float32", block_size=4, offload_dir=str(tmp_path))
        with Engine(src, pol, cfg) as eng:
            out.append(eng.generate(prompts, 6, keep_logits=True))
    assert out[0].tokens == out[1].tokens
    torch.testing.assert_close(torch.stack(out[1].logits), torch.stack(out[0].logits), rtol=0, atol=1e-4)
