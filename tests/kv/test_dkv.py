"""DKV: the block codec, block-sparse prefill, the policy in the engine, DKV as SparPR's cold-block
codec and the query-aware residual pick (the low-rank attention: test_dkv_attention.py). (The policy matrix in
test_policies.py runs DKV at full rank with every row exact against dense.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexgen_sparpr.engine.config import ConfigError, EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.dkv.codec import DKVCodec
from flexgen_sparpr.kv.dkv.prefill import block_sparse_prefill
from flexgen_sparpr.kv.policies.dkv import DKV
from flexgen_sparpr.models.layers import causal_attention
from flexgen_sparpr.storage.tiers import Tier
from flexgen_sparpr.weights.resolve import resolve_source
from tests.kv.dkv_blocks import SHAPE, lowrank_kv


# --- codec ---
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank,res", [(4, 3), (32, 16), (1, 0), (100, 100)])
def test_bytes_match_the_formula(dtype, rank, res):
    c = DKVCodec(SHAPE, dtype, rank, res)
    row = c.encode(torch.randn(SHAPE).to(dtype))
    assert row.dtype == torch.uint8 and row.numel() == c.nbytes
    assert c.nbytes == DKVCodec.formula(2, 3, 16, 8, rank, res, torch.empty((), dtype=dtype).element_size())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_is_one_sub_row_per_sequence(dtype):
    """Each sequence's fields lie in its own sub-row, so over n rows a part's (block, sequence)
    axes are one axis (a view: what the low-rank attention's batched matmuls read in place), and
    each sequence decodes from its sub-row alone."""
    c = DKVCodec(SHAPE, dtype, 4, 3)
    kvs = [torch.randn(SHAPE).to(dtype) for _ in range(3)]
    rows = torch.stack([c.encode(kv) for kv in kvs])  # rows: [n, nbytes]
    p, b = c.parts(rows), SHAPE[1]
    for name in ("anchor", "basis", "coeffs", "res_rows", "res_idx"):
        x = getattr(p, name)  # [n, B, ...]
        flat = x.view(x.shape[0] * b, *x.shape[2:])  # [n*B, ...] item j*B + i: block j, sequence i
        assert flat.data_ptr() == x.data_ptr() and torch.equal(flat[2 * b + 1], x[2, 1])
    want = c.decode(rows[1])  # [2, B, Hkv, bs, D]
    for i in range(b):  # another row's bytes in every other sequence's sub-row: sequence i unchanged
        mixed = rows[0].clone().view(b, c.seq_nbytes)
        mixed[i] = rows[1].view(b, c.seq_nbytes)[i]
        torch.testing.assert_close(c.decode(mixed.view(-1))[:, i], want[:, i], rtol=0, atol=0)


def test_full_rank_is_lossless():
    """Up to float32 rounding: the basis comes from the block's Gram matrix, whose forming squares
    the condition number, so the weakest direction carries ~1e-5 error (an SVD's was ~1e-6;
    both far below the float16 the KV is kept in on a GPU)."""
    kv = torch.randn(SHAPE)
    c = DKVCodec(SHAPE, torch.float32, rank=10 ** 6, residuals=0)
    torch.testing.assert_close(c.decode(c.encode(kv)), kv, atol=5e-5, rtol=0)


def test_residuals_are_the_worst_reconstructed_rows_and_exact():
    torch.manual_seed(1)
    kv = torch.randn(SHAPE)
    c = DKVCodec(SHAPE, torch.float32, rank=3, residuals=4, refit=False)  # the picker's own basis
    row, approx = lowrank_kv(c, kv)
    p = c.parts(row)
    x = c.to_rows(kv)
    delta = (x - p.anchor[:, None]).view(*x.shape[:2], 2, -1)  # the K and V halves of X - anchor
    scale = delta.square().mean(dim=(1, 3), keepdim=True).sqrt()  # each half weighs the same
    err = ((c.to_rows(approx) - x).view_as(delta) / scale).square().sum((-1, -2))  # err: [B, bs]
    for b in range(SHAPE[1]):
        assert set(p.res_idx[b].tolist()) == set(err[b].topk(4).indices.tolist())
    dec = c.to_rows(c.decode(row))
    for b in range(SHAPE[1]):
        idx = p.res_idx[b].long()
        assert torch.equal(dec[b, idx], c.to_rows(kv)[b, idx])
        torch.testing.assert_close(dec[b, p.anchor_idx[b].long()], c.to_rows(kv)[b, p.anchor_idx[b].long()],
                                   atol=1e-5, rtol=0)


def test_refit_basis_fits_the_other_rows_better():
    torch.manual_seed(6)
    kv = torch.randn(SHAPE)
    kv[:, :, :, 3] *= 20  # one outlier token per block: the first fit spends its rank on it
    errs = []
    for refit in (False, True):
        c = DKVCodec(SHAPE, torch.float32, rank=3, residuals=2, refit=refit)
        row = c.encode(kv)
        keep = torch.ones(SHAPE[1], SHAPE[3], dtype=torch.bool)
        keep.scatter_(1, c.parts(row).res_idx.long(), False)  # the rows not kept exact
        errs.append((c.to_rows(c.decode(row)) - c.to_rows(kv))[keep].square().sum())
    assert errs[1] < errs[0]


def test_compression_ratio_at_defaults_for_smollm2_and_opt_shapes():
    """The seed's block (256 tokens, rank 32) with 16 residual rows: >= 3x smaller than dense."""
    for hkv, d in ((3, 64), (32, 128), (12, 64)):  # SmolLM2-135M, OPT-6.7B, OPT-125m
        c = DKVCodec((2, 1, hkv, 256, d), torch.float16, 32, 16)
        assert c.dense_nbytes() / c.nbytes >= 3.0


# --- block-sparse prefill ---
def test_block_sparse_prefill_with_room_for_all_is_causal():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 4, 45, 8), torch.randn(2, 2, 45, 8), torch.randn(2, 2, 45, 8)
    valid = torch.ones(2, 45, dtype=torch.bool)
    valid[1, :5] = False
    ref = causal_attention(q, k, v, valid)
    torch.testing.assert_close(block_sparse_prefill(q, k, v, valid, bs=8, topk=8), ref, atol=1e-5, rtol=0)


def test_block_sparse_prefill_reads_sink_local_and_topk_blocks():
    """Brute force: the same attention with an explicit mask of the blocks each query block reads."""
    torch.manual_seed(5)
    b, h, s, d, bs, topk = 1, 2, 64, 8, 8, 2
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    out = block_sparse_prefill(q, k, v, None, bs, topk)
    nb = s // bs
    qm, km = q.view(b, h, nb, bs, d).mean(3), k.view(b, h, nb, bs, d).mean(3)  # [b, h, nb, d]
    mask = torch.zeros(s, s, dtype=torch.bool)
    for i in range(nb):
        score = torch.einsum("hd,hjd->j", qm[0, :, i], km[0])  # each head meets its own keys
        keep = {0, *range(max(1, i - 1), i + 1)}
        cands = list(range(1, max(1, i - 1)))
        if len(cands) > topk:
            keep |= {cands[j] for j in score[cands].topk(topk).indices.tolist()}
        else:
            keep |= set(cands)
        assert len(keep) <= topk + 3
        for j in keep:
            mask[i * bs:(i + 1) * bs, j * bs:(j + 1) * bs] = True
    mask &= torch.ones(s, s, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


# --- in the engine ---
PROMPTS = [list(range(3, 43)), list(range(50, 79))]


def engine(model_dir, tmp_path, **kw):
    policy = Policy(gpu_batch_size=2, cache_gpu_percent=kw.pop("gpu", 100))
    cfg = EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path), **kw)
    return Engine(resolve_source(str(model_dir), ""), policy, cfg)


def test_state_is_compressed_and_bounded(tiny_llama_dir, tmp_path):
    with engine(tiny_llama_dir, tmp_path, kv_policy="dkv",
                policy_args={"rank": 2, "residuals": 1, "recent_blocks": 1, "topk": 1}) as eng:
        st = eng.prefill(PROMPTS, 12)
        eng.decode(st)
        pol: DKV = eng.kv_policy
        for t in eng.tables.values():
            sealed = t.length // t.bs
            assert t.nbytes_on(Tier.COMPUTE) == sealed * t.store.codec.nbytes < sealed * t.store.raw.nbytes
            c = t.store.codec
            assert len(t.store._exact) <= 3 and c.exact_recent == 1 and c.exact_first == 1  # sink, recent, a spare
        c = pol.counts
        assert c["steps"] and c["routed_blocks"] == c["steps"] * 1  # topk 1: one routed block a step


def test_decode_reads_the_encoded_rows_from_disk(tiny_opt_dir, tmp_path):
    with engine(tiny_opt_dir, tmp_path, kv_policy="dkv", gpu=0,
                policy_args={"rank": 2, "residuals": 1, "recent_blocks": 1}) as eng:
        st = eng.prefill(PROMPTS, 2)
        t = eng.tables[(0, 0)]
        before = eng.devices.counters.snapshot().get("disk->cpu", 0)
        st.max_new = len(st.tokens) + 1
        eng.decode(st)
        moved = eng.devices.counters.snapshot().get("disk->cpu", 0) - before
        cold = t.length // t.bs - 2  # the sealed blocks besides the exact recent and sink blocks
        assert moved == len(eng.tables) * cold * t.store.codec.nbytes


def test_sink_block_is_attended_exactly(tiny_llama_dir, tmp_path):
    """The first block is stored encoded like any other, and attended from the exact copy the
    table keeps at seal time (exact_first): sink_blocks=1 and 0 differ; both store the same bytes."""
    args = {"rank": 1, "residuals": 0, "recent_blocks": 1}
    out = {}
    for sink in (0, 1):
        with engine(tiny_llama_dir, tmp_path, kv_policy="dkv", policy_args=args | {"sink_blocks": sink}) as eng:
            out[sink] = eng.generate(PROMPTS, 4, keep_logits=True)
            t = eng.tables[(0, 0)]
            assert t.nbytes_on(Tier.COMPUTE) == (t.length // t.bs) * t.store.codec.nbytes
            assert t.store.codec.exact_first == sink and (0 in t.store._exact) == bool(sink)  # one raw block, on compute
    assert not torch.allclose(out[0].logits[-1], out[1].logits[-1])


def test_snapshot_replay(tiny_llama_dir, tmp_path):
    with engine(tiny_llama_dir, tmp_path, kv_policy="dkv", policy_args={"rank": 2, "residuals": 1}) as eng:
        snap = eng.snapshot(eng.prefill(PROMPTS, 10))
        first, again = (eng.decode(eng.restore(snap)).tokens for _ in range(2))
        assert first == again


def test_sparse_prefill_changes_prefill_only_when_long(tiny_llama_dir, tmp_path):
    args = {"rank": 10 ** 6, "residuals": 10 ** 6, "topk": 0, "sparse_prefill": True, "prefill_topk": 1}
    with engine(tiny_llama_dir, tmp_path, kv_policy="dkv", policy_args=args) as eng:
        sparse = eng.generate(PROMPTS, 4, keep_logits=True)
    with engine(tiny_llama_dir, tmp_path, kv_policy="dense") as eng:
        dense = eng.generate(PROMPTS, 4, keep_logits=True)
    assert not torch.allclose(sparse.logits[0], dense.logits[0], atol=1e-4)  # 40 tokens > 3 blocks of 8


@pytest.mark.parametrize("kw", [{"kv_policy": "dkv", "cold_codec": "dkv"}, {"kv_policy": "dkv", "compress": True},
                                {"kv_policy": "sparpr", "cold_codec": "dkv", "compress": True}])
def test_one_codec_at_a_time(tiny_opt_dir, tmp_path, kw):
    kw = dict(kw)
    compress = kw.pop("compress", False)
    with pytest.raises(ConfigError, match="one KV codec"):
        Engine(resolve_source(str(tiny_opt_dir), ""), Policy(gpu_batch_size=2, compress_cache=compress),
               EngineConfig(device="cpu", block_size=8, **kw))


def test_sparpr_with_dkv_cold_codec(tiny_llama_dir, tmp_path):
    """Cold blocks stored in DKV form: lossless at full rank (same tokens as dense), and the bytes
    read from disk per block are the codec's, not the raw block's."""
    sp = {"keep_ratio": 1.0, "quest_only": True}
    with engine(tiny_llama_dir, tmp_path, kv_policy="dense", gpu=0) as eng:
        ref = eng.generate(PROMPTS, 6).tokens
    with engine(tiny_llama_dir, tmp_path, kv_policy="sparpr", gpu=0, policy_args=sp, cold_codec="dkv",
                codec_args={"rank": 10 ** 6, "residuals": 0}) as eng:
        assert eng.generate(PROMPTS, 6).tokens == ref
    with engine(tiny_llama_dir, tmp_path, kv_policy="sparpr", gpu=0, policy_args=sp, cold_codec="dkv",
                codec_args={"rank": 2, "residuals": 1}) as eng:
        st = eng.prefill(PROMPTS, 2)
        t = eng.tables[(0, 0)]
        assert t.store.codec.nbytes < t.store.raw.nbytes and t.store.codec_of(Tier.DISK) is t.store.codec
        before = eng.devices.counters.snapshot().get("disk->cpu", 0)
        st.max_new = len(st.tokens) + 1
        eng.decode(st)
        moved = eng.devices.counters.snapshot().get("disk->cpu", 0) - before
        # the newest sealed block and the sink block are read from their exact copies on compute
        assert t.store.codec.exact_recent == 1 and t.store.codec.exact_first == 1
        assert moved == len(eng.tables) * (t.length // t.bs - 2) * t.store.codec.nbytes


def test_table_keeps_the_newest_encoded_blocks_exact():
    from flexgen_sparpr.kv.block_table import BlockTable
    from flexgen_sparpr.storage.tiers import Devices
    shape = (2, 1, 2, 8, 4)
    t = BlockTable(name="t", batch=1, num_kv_heads=2, head_dim=4, block_size=8, max_len=32, dtype=torch.float32,
                   homes=[Tier.COMPUTE] * 4, devices=Devices(torch.device("cpu")),
                   codec=DKVCodec(shape, torch.float32, rank=1, residuals=0, exact_recent=1, exact_first=1))
    k, v = torch.randn(1, 2, 32, 4), torch.randn(1, 2, 32, 4)
    for job in t.append(k, v):
        job()
    kv, _ = t.gather([0, 1, 2, 3])
    assert torch.equal(kv[0, :, :, 24:], k[:, :, 24:32])  # block 3, the newest: exact
    assert torch.equal(kv[0, :, :, :8], k[:, :, :8])  # block 0, the sink: exact, and never let go
    assert not torch.allclose(kv[0, :, :, 8:16], k[:, :, 8:16], atol=1e-3)  # blocks 1, 2: rank 1
    assert sorted(t.store._exact) == [0, 2, 3]  # the sink, the newest and one spare for a rewind


# --- query-aware residual rows ---
def test_observation_importance_equals_brute_force_softmax():
    from flexgen_sparpr.kv.dkv.importance import observation_importance
    torch.manual_seed(8)
    b, h, hkv, s, d, w = 2, 6, 3, 20, 8, 5
    q, k = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False  # left padding
    got = observation_importance(q, k, valid, window=w)
    ref = torch.zeros(b, s)
    for i in range(b):
        for head in range(h):
            g = head // (h // hkv)  # GQA: the KV head this query head reads
            for t in range(s - w, s):
                keys = [j for j in range(t + 1) if valid[i, j]]
                logits = torch.stack([q[i, head, t] @ k[i, g, j] for j in keys]) / d ** 0.5
                ref[i, keys] += torch.softmax(logits, dim=0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(got[1, :4] == 0)
    torch.testing.assert_close(got.sum(1), torch.full((b,), float(h * w)))  # each head and query: mass 1


@pytest.mark.parametrize("follow", [0, 1, 5])
def test_follow_spread_gives_a_token_the_largest_score_of_those_before_it(follow):
    from flexgen_sparpr.kv.dkv.importance import follow_spread
    torch.manual_seed(10)
    imp = torch.rand(2, 30)
    ref = torch.stack([torch.stack([imp[i, t] + imp[i, max(0, t - follow):t + 1].max() for t in range(30)])
                       for i in range(2)])
    torch.testing.assert_close(follow_spread(imp, follow), ref)


@pytest.mark.parametrize("pick", ["attention", "mixed"])
def test_query_aware_pick_keeps_the_important_rows_exact(pick):
    torch.manual_seed(9)
    kv, imp = torch.randn(SHAPE), torch.rand(SHAPE[1], SHAPE[3])  # imp: [B, bs]
    c = DKVCodec(SHAPE, torch.float32, rank=3, residuals=5, refit=False, residual_pick=pick)
    row = c.encode(kv, importance=imp)
    p, x = c.parts(row), c.to_rows(kv)
    n_imp = 5 if pick == "attention" else 3
    ref = DKVCodec(SHAPE, torch.float32, rank=3, residuals=5, refit=False)  # the error pick's first fit
    _, approx = lowrank_kv(ref, kv)
    delta = (x - ref.parts(ref.encode(kv)).anchor[:, None]).view(*x.shape[:2], 2, -1)
    err = ((c.to_rows(approx) - x).view_as(delta) / delta.square().mean(dim=(1, 3), keepdim=True).sqrt()
           ).square().sum((-1, -2))  # err: [B, bs]
    for b in range(SHAPE[1]):
        top = set(imp[b].topk(n_imp).indices.tolist())
        rest = err[b].clone()
        rest[list(top)] = float("-inf")
        want = top | set(rest.topk(5 - n_imp).indices.tolist())
        assert set(p.res_idx[b].tolist()) == want
        assert torch.equal(c.to_rows(c.decode(row))[b, p.res_idx[b].long()], x[b, p.res_idx[b].long()])
    # without an importance the pick falls back to the error pick
    assert torch.equal(c.parts(c.encode(kv)).res_idx, ref.parts(ref.encode(kv)).res_idx)


def test_bad_residual_pick_is_refused():
    with pytest.raises(ValueError, match="residual_pick"):
        DKVCodec(SHAPE, torch.float32, residual_pick="worst")
    with pytest.raises(ValueError, match="residual_pick"):
        DKV(residual_pick="worst")


def test_prefill_hints_reach_the_codec_through_the_block_table(tiny_llama_dir, tmp_path, monkeypatch):
    """Every block sealed by the prefill is encoded with its importance (the observation window's
    attention mass) and keeps its top-m rows by it exact; blocks sealed during decode are encoded
    without one (the error pick)."""
    calls = []
    encode = DKVCodec.encode

    def spy(self, kv, importance=None):
        row = encode(self, kv, importance=importance)
        calls.append((importance, self.parts(row).res_idx.long()))
        return row
    monkeypatch.setattr(DKVCodec, "encode", spy)
    with engine(tiny_llama_dir, tmp_path, kv_policy="dkv",
                policy_args={"rank": 2, "residuals": 2, "residual_pick": "attention"}) as eng:
        st = eng.prefill(PROMPTS, 12)
        n_prefill = sum(t.length // t.bs for t in eng.tables.values())
        assert len(calls) == n_prefill and all(t.length // t.bs for t in eng.tables.values())
        assert all(not t.store.hints for t in eng.tables.values())  # each hint used once
        eng.decode(st)
        assert len(calls) > n_prefill and all(imp is None for imp, _ in calls[n_prefill:])
    for imp, res_idx in calls[:n_prefill]:
        assert imp is not None and imp.shape == (2, 8) and torch.all(imp >= 0)  # imp: [B, bs]
        assert torch.equal(res_idx, imp.topk(2, dim=1).indices.sort(dim=1).values)


def test_full_rank_all_residuals_attention_pick_equals_dense(tiny_llama_dir, tmp_path):
    args = {"rank": 10 ** 6, "residuals": 10 ** 6, "topk": 0, "residual_pick": "attention", "pick_window": 4}
    with engine(tiny_llama_dir, tmp_path, kv_policy="dkv", policy_args=args) as eng:
        got = eng.generate(PROMPTS, 6, keep_logits=True)
    with engine(tiny_llama_dir, tmp_path, kv_policy="dense") as eng:
        ref = eng.generate(PROMPTS, 6, keep_logits=True)
    assert got.tokens == ref.tokens
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_decode_attention_runs_on_decode_threads_and_equals_torchs_setting(tiny_llama_dir, tmp_path, monkeypatch):
    """decode_threads 1 (the default): DKV's decode attention runs on one intra-op thread on the CPU
    and gives the same tokens and logits as torch's own setting (decode_threads 0)."""
    import flexgen_sparpr.kv.policies.dkv as dkv_mod
    seen, scores = [], dkv_mod.lowrank_blocks

    def spy(*a):
        seen.append(torch.get_num_threads())
        return scores(*a)
    monkeypatch.setattr(dkv_mod, "lowrank_blocks", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = {}
        for n in (1, 0):
            seen.clear()
            args = {"rank": 2, "residuals": 1, "topk": 1, "decode_threads": n}
            with engine(tiny_llama_dir, tmp_path, kv_policy="dkv", policy_args=args) as eng:
                out[n] = eng.generate(PROMPTS, 6, keep_logits=True)
            assert seen and set(seen) == {1 if n else 2}
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert out[1].tokens == out[0].tokens
    torch.testing.assert_close(out[1].logits, out[0].logits, rtol=1e-5, atol=1e-5)
