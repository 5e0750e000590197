"""DKV's exact routed blocks (--dkv-exact-routed): the routed blocks of most attention mass read
from raw copies on a slower tier and attended exactly; the rest as before."""
from __future__ import annotations

import os

import pytest
import torch

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.dkv.exact_routed import exact_blocks, split_route
from flexgen_sparpr.kv.knobs import KnobError
from flexgen_sparpr.kv.policies.dkv import DKV
from flexgen_sparpr.models.layers import attention_with_lse
from flexgen_sparpr.storage.disk_store import DiskStore
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [list(range(3, 59)), list(range(70, 115))]  # 56 and 45 tokens: 8-token blocks, several cold


def _run(model_dir, tmp_path, device="cpu", **knobs):
    """A prefill, then two decodes from its snapshot: (first, second, the DKV policy, link bytes)."""
    args = {"rank": 2, "residuals": 1, "topk": 2, **knobs}
    cfg = EngineConfig(device=device, block_size=8, offload_dir=str(tmp_path), kv_policy="dkv", policy_args=args)
    with Engine(resolve_source(str(model_dir), ""), Policy(gpu_batch_size=2), cfg) as eng:
        snap = eng.snapshot(eng.prefill(PROMPTS, 12, keep_logits=True))
        first = eng.decode(eng.restore(snap))
        second = eng.decode(eng.restore(snap))
        files = sorted(f for _, _, names in os.walk(tmp_path) for f in names)
        return first, second, eng.kv_policy, files, eng.devices.counters.snapshot()


def test_every_block_exact_is_dense_attention(tiny_llama_dir, tmp_path, device):
    """Every cold block routed and read raw: the decode attends every token exactly, so its
    logits are dense attention's (the lossy rank-2 form alone is not). On CUDA the raw copies
    live in pinned host memory and cross the link."""
    cfg = EngineConfig(device=device, block_size=8)
    with Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=2), cfg) as eng:
        dense = eng.generate(PROMPTS, 12, keep_logits=True)
    exact, again, pol, _, moved = _run(tiny_llama_dir, tmp_path / "a", device, topk=0, exact_routed=100)
    lossy, _, _, _, _ = _run(tiny_llama_dir, tmp_path / "b", device, topk=0)
    assert pol.counts["exact_routed_blocks"] > 0
    assert exact.tokens == dense.tokens == again.tokens  # the snapshot rewinds the raw copies too
    exact, dense, lossy = (torch.stack(r.logits).float() for r in (exact, dense, lossy))  # [steps, B, V]
    assert exact.shape[0] == 12
    tol = 1e-4 if device == "cpu" else 3e-2  # float16 on CUDA: the partial attentions merge in another order
    torch.testing.assert_close(exact, dense, rtol=tol, atol=tol)
    assert (lossy - dense).abs().max() > 10 * tol
    if device != "cpu":
        assert moved.get("cpu->compute", 0) > 0  # the raw blocks came over the link


@pytest.mark.parametrize("home", ["cpu", "disk"])
def test_raw_copies_live_on_their_home_and_are_gone_after_close(tiny_llama_dir, tmp_path, home, device):
    """On disk the raw copies are files of their own in --offload-dir, removed when the engine
    closes; the decode is the same wherever they live."""
    got, _, pol, files, _ = _run(tiny_llama_dir, tmp_path / home, device, exact_routed=1, exact_home=home)
    assert pol.counts["exact_routed_blocks"] > 0
    assert any("-raw" in f for f in files) == (home == "disk")
    assert not (tmp_path / home).exists() or not any(os.scandir(tmp_path / home))
    ref, _, _, _, _ = _run(tiny_llama_dir, tmp_path / "ref", device, exact_routed=1)
    assert got.tokens == ref.tokens


def _table(devices, disk, batch=3, blocks=6, bs=4, hkv=2, d=8):
    t = BlockTable(name="raw", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=blocks * bs,
                   dtype=torch.float32, homes=[Tier.DISK] * blocks, devices=devices, disk=disk)
    torch.manual_seed(1)
    kv = torch.randn(2, batch, hkv, blocks * bs, d)  # kv: [2, B, Hkv, T, D]
    for job in t.append(kv[0], kv[1]):
        job()
    return t, kv


def test_exact_blocks_attend_each_sequences_own_picks_and_read_only_their_rows(tmp_path):
    """Each sequence attends exactly the raw rows of the blocks it picked (its usable tokens);
    from a sequence-major disk file only the picked (block, sequence) shares are read."""
    devices = Devices(torch.device("cpu"))
    with DiskStore(tmp_path) as disk:
        t, kv = _table(devices, disk)
        first, bs = 1, t.bs
        top = torch.tensor([[0, 3], [2, 0], [4, 1]])  # top: [B, E] cold-block indices
        usable = torch.rand(5, 3, bs) > 0.3  # usable: [n, B, bs]
        q = torch.randn(3, 4, 1, 8)
        n0 = devices.counters.snapshot().get("disk->cpu", 0)
        out, lse = exact_blocks(q, t, top, first, usable)
        for s in range(3):
            tok = torch.cat([torch.arange((first + i) * bs, (first + i + 1) * bs) for i in top[s].tolist()])
            ok = torch.cat([usable[i, s] for i in top[s].tolist()])[None]
            ref, ref_lse = attention_with_lse(q[s:s + 1], kv[0, s:s + 1, :, tok], kv[1, s:s + 1, :, tok], ok)
            torch.testing.assert_close(out[s:s + 1], ref)
            torch.testing.assert_close(lse[s:s + 1], ref_lse)
        moved = devices.counters.snapshot()["disk->cpu"] - n0
        assert moved == 6 * t.store.seq_nbytes  # 3 sequences x 2 blocks, never a whole block
        t.close()


def test_split_route_takes_the_largest_mass_first():
    lse = torch.log(torch.tensor([[[1.0], [5.0], [3.0], [0.5]]]))  # lse: [B=1, n=4, H=1]
    top, rest = split_route(lse, None, 2)
    assert top.tolist() == [[1, 2]] and rest.tolist() == [[0, 3]]
    top, rest = split_route(lse, torch.tensor([[2, 0]]), 5)  # more asked than routed: all of them
    assert top.tolist() == [[2, 0]] and rest.shape == (1, 0)


def test_knobs_are_checked():
    with pytest.raises(KnobError):
        DKV(exact_routed=-1)
    with pytest.raises(KnobError):
        DKV(exact_home="gpu")
    assert DKV(exact_routed=2).raw_copies(0) == Tier.CPU
    assert DKV(exact_routed=2, exact_home="disk", dense_layers=1).raw_copies(0) is None
    assert DKV().raw_copies(3) is None
