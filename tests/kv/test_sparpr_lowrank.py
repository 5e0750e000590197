"""SparPR's low-rank 4-bit key summaries (kv/policies/sparpr_lowrank.py): their bytes on the
compute device against the K+V they summarise, the codes, and the scores they give."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.kv.policies.sparpr_lowrank import (decode, encode, encode_into, fit_basis, lowrank_block_scores,
                                                       rank_for)
from flexgen_sparpr.models import cpu_kernel
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.storage.tiers import Devices, Tier

CPU = Devices(torch.device("cpu"))
BUILT = cpu_kernel.has_simd() and shutil.which("g++") is not None and shutil.which("ninja") is not None
BOUND = 1 / 32  # issue 17: summaries <= 1/32 of the K+V bytes they summarise, on the compute device


def costs() -> CostModel:
    return CostModel(disk_read_Bps=1e9, matmul_flops={"float16": 1e9, "float32": 1e9},
                     matmul_latency_s={"float16": 0.0, "float32": 0.0}, live=False)


def table(dtype=torch.float16, batch=2, hkv=3, d=64, bs=16, tokens=2048) -> BlockTable:
    blocks = tokens // bs
    return BlockTable(name="lr", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=tokens,
                      dtype=dtype, homes=[Tier.COMPUTE] * blocks, devices=CPU)


def prefill(pol: SparPR, t: BlockTable, n: int, seed: int = 0) -> torch.Tensor:
    """Append n tokens of keys with a few strong directions (as a model's are) and show the
    policy the prefill. Returns the keys [B, Hkv, n, D] float32."""
    gen = torch.Generator().manual_seed(seed)
    _, b, hkv, _, d = t.block_shape
    k = torch.randn(b, hkv, n, d, generator=gen) * torch.linspace(3, 0.1, d)  # energy in the first dims
    for job in t.append(k.to(t.dtype), torch.randn(b, hkv, n, d, generator=gen).to(t.dtype)):
        job()
    q = torch.randn(b, 3 * hkv, n, d, generator=gen)
    pol.on_prefill(t, 0, q, k.to(t.dtype), torch.ones(b, n, dtype=torch.bool))
    return k


def kv_bytes(t: BlockTable) -> int:
    """The raw K+V of every block the table can hold, in its dtype."""
    planes, b, hkv, bs, d = t.block_shape
    return planes * b * hkv * t.capacity * d * t.dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_summaries_take_at_most_a_32nd_of_the_kv_bytes(dtype):
    """Everything the low-rank summaries hold on the compute device (the codes of every block
    the table can hold, and the fitted basis and steps) against the raw K+V they summarise;
    resident_share (what --policy auto counts) is not below what is really held, basis aside."""
    t = table(dtype)
    pol = SparPR(keep_ratio=0.1, min_keep_tokens=0, costs=costs(), summary="lowrank", summary_rank=0.1875)  # issue 17's 1/32 setting
    prefill(pol, t, 2048)
    held, kv = pol.summary_bytes(t), kv_bytes(t)
    assert 0 < held <= BOUND * kv
    share, basis = pol.resident_share(t.bs, t.dtype.itemsize), pol._basis[t].nbytes
    assert (held - basis) / kv == share  # the codes: 12 of 64 directions in 4 bits, 3/128 of fp16 K+V
    assert basis == 3 * 12 * (64 * 2 + 4)  # a fixed float16 basis and float32 step per KV head


def test_the_bound_fails_for_summaries_that_do_not_fit():
    """The same measure catches summaries over the bound: 4-token mean keys in the cache's
    dtype (1/8), and a low-rank rank of D / 4 (1/32 of codes plus the basis)."""
    for pol in (SparPR(keep_ratio=0.1, min_keep_tokens=0, costs=costs(), summary="mean"),
                SparPR(keep_ratio=0.1, min_keep_tokens=0, costs=costs(), summary="lowrank", summary_rank=0.25)):
        t = table()
        prefill(pol, t, 2048)
        assert pol.summary_bytes(t) > BOUND * kv_bytes(t)


def test_codes_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 256, 64, generator=gen) * 4 * 0.8 ** torch.arange(64)  # most energy in few dims
    basis = fit_basis(keys, torch.ones(2, 256, dtype=torch.bool), rank_for(64, 0.1875))
    assert basis.u.shape == (3, 64, 12)
    codes = encode(keys, basis)  # codes: [B, Hkv, T, r / 2]
    assert codes.dtype == torch.uint8 and codes.shape == (2, 3, 256, 6)
    exact = torch.einsum("bktd,kdr->bktr", keys, basis.u.float())
    inside = exact.abs() <= 7 * basis.step[None, :, None]  # not saturated
    err = (decode(codes, basis) - exact).abs()
    assert bool((err <= basis.step[None, :, None] / 2 + 1e-5)[inside].all()) and inside.float().mean() > 0.99
    # the basis is the keys' strongest directions: most of their energy is kept
    assert float(exact.square().sum() / keys.square().sum()) > 0.8


@pytest.mark.parametrize("head_score", ["softmax", "sum"])
def test_block_scores_are_attention_on_the_decoded_keys(head_score):
    """Per query head, q . k~ / sqrt(D) over its KV head's decoded keys; softmax: a block's
    share of each head's attention, summed over heads; sum: its best token's logits summed."""
    gen = torch.Generator().manual_seed(2)
    b, hkv, g, d, bs, nb = 2, 2, 2, 16, 4, 6
    keys = torch.randn(b, hkv, nb * bs, d, generator=gen)
    basis = fit_basis(keys, torch.ones(b, nb * bs, dtype=torch.bool), 8)
    codes = encode(keys, basis)
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    valid = torch.ones(b, nb * bs, dtype=torch.bool)
    valid[1, :5] = False  # sequence 1's left padding: its block 0 holds none (never scores), block 1 three
    pad_bias = torch.zeros(b, nb * bs).masked_fill(~valid, -math.inf)  # pad_bias: [B, T]
    live = valid.view(b, nb, bs).any(dim=-1)  # live: [B, nb]
    got = lowrank_block_scores(q, codes.mT, basis, bs, head_score, pad_bias, live)  # stored tokens innermost
    approx = torch.einsum("bktr,kdr->bktd", decode(codes, basis), basis.u.float())  # keys as the codes say
    want = torch.empty(b, nb)
    for s in range(b):
        per_head = []
        for h in range(hkv * g):
            logit = torch.tensor([float(q[s, h, 0] @ approx[s, h // g, i]) / math.sqrt(d) if valid[s, i] else -math.inf
                                  for i in range(nb * bs)])
            per_head.append(logit.softmax(0) if head_score == "softmax" else logit)
        tot = torch.stack(per_head).sum(0).view(nb, bs)
        want[s] = tot.sum(-1) if head_score == "softmax" else tot.amax(-1)
    want[1, 0] = -math.inf
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_two_token_needle_the_block_mean_dilutes_is_found():
    """Per-token summaries keep a short needle visible: the block mean ranks its block below
    the filler, the low-rank codes rank it first and the step reads it."""
    t = BlockTable(name="n", batch=1, num_kv_heads=1, head_dim=4, block_size=8, max_len=80, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 10, devices=CPU)
    k = torch.zeros(1, 1, 64, 4)
    k[..., 0], k[..., 1] = 0.3, 1.0  # every filler key: a little along the query, more across it
    k[0, 0, 42:44] = torch.tensor([4.0, 0, 0, 0])  # the needle: 2 tokens along the query
    k[0, 0, 44:48] = torch.tensor([-2.0, 1.0, 0, 0])  # the rest of block 5 points away
    for job in t.append(k, torch.randn(1, 1, 64, 4)):
        job()
    q = torch.tensor([1.0, 0, 0, 0]).view(1, 1, 1, 4)
    budget = dict(keep_ratio=0.375, min_keep_tokens=0, costs=costs(), fallback=False, summary_rank=0.5)  # sink, window, one block
    assert 5 not in SparPR(**budget, summary="mean", summary_tokens=0).select(t, 0, q).blocks
    assert 5 in SparPR(**budget, summary="lowrank").select(t, 0, q).blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_sealed_at_decode_use_the_prefills_basis(dtype):
    t = table(dtype, tokens=256)
    pol = SparPR(keep_ratio=0.5, min_keep_tokens=0, costs=costs(), summary="lowrank")
    prefill(pol, t, 128)
    basis = pol._basis[t]
    gen = torch.Generator().manual_seed(3)
    for _ in range(16):  # one more block, a token at a time, as decode writes it
        for job in t.append(torch.randn(2, 3, 1, 64, generator=gen), torch.randn(2, 3, 1, 64, generator=gen)):
            job()
    assert pol._basis[t] is basis
    codes = pol.summaries(t, 0)[0]  # codes: [B, Hkv, r / 2, 9, bs]
    keys = t.gather([8])[0][0].float()  # keys: [B, Hkv, bs, D]
    assert torch.equal(codes[:, :, :, 8].mT, encode(keys, basis))


@pytest.mark.skipif(not BUILT, reason="no AVX-512 or AVX2 CPU, g++ or ninja: the compiled kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_encode_writes_what_encode_gives(dtype):
    """encode_into (one compiled call a sealed block, what decode runs) against the torch encode: every
    block of a strided cache, written at its place in the table's codes and nowhere else."""
    assert cpu_kernel.kernel() is not None, cpu_kernel.why_not()
    gen = torch.Generator().manual_seed(5)
    b, hkv, nb, bs, d = 2, 3, 5, 16, 64
    keys = torch.randn(b, hkv, nb * bs, d, generator=gen) * torch.linspace(3, 0.1, d)  # keys: [B, Hkv, T, D]
    basis = fit_basis(keys, torch.ones(b, nb * bs, dtype=torch.bool), 32)
    arena = torch.zeros(2, b, hkv, nb * bs + 7, d, dtype=dtype)  # arena: [2, B, Hkv, cap, D], keys strided in it
    arena[0, :, :, :nb * bs] = keys.to(dtype)
    want = encode(arena[0, :, :, :nb * bs].float(), basis).unflatten(2, (nb, bs)).permute(0, 1, 4, 2, 3)  # [B, Hkv, r / 2, nb, bs]
    codes = torch.zeros(b, hkv, 16, nb + 1, bs, dtype=torch.uint8)
    for blk in range(nb):
        assert encode_into(codes, blk, arena[0, :, :, blk * bs:(blk + 1) * bs], basis)
    assert torch.equal(codes[:, :, :, :nb], want)
    assert not codes[:, :, :, nb].any()  # the block not sealed is untouched
    assert not encode_into(codes, 0, arena[0, :, :, :bs].to(torch.int32), basis)  # not float: torch encodes
