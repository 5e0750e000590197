"""Every registered KV policy through the real engine (a new policy is tested once registered),
then each policy's own invariant against a brute-force recomputation."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.sampling import Sampler
from flexgen_sparpr.kv.block_table import BlockTable
from flexgen_sparpr.kv.policies import POLICIES
from flexgen_sparpr.kv.policies.base import BudgetPolicy, gathered_positions, token_budget
from flexgen_sparpr.kv.policies.flexgen_topk import FlexGenTopK
from flexgen_sparpr.kv.policies.h2o import H2O, prefill_column_sums
from flexgen_sparpr.kv.policies.quest import Quest, block_upper_bound
from flexgen_sparpr.kv.policies.sparpr import SparPR
from flexgen_sparpr.kv.policies.streaming_llm import StreamingLLM
from flexgen_sparpr.kv.policy import KVPolicy
from flexgen_sparpr.storage.tiers import Devices, Tier
from flexgen_sparpr.weights.resolve import resolve_source

NAMES = sorted(POLICIES)
# policies that hand the engine a Selection (the rest, e.g. DKV, compute attention themselves and
# have their own read and byte checks in their test files)
SELECTING = [n for n in NAMES if not POLICIES[n].attends]
PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # 40 and 29 tokens: the second is left-padded
GEN = 10
CPU = Devices(torch.device("cpu"))


def policy_args(name: str, keep: float) -> dict:
    """The knobs each policy declares for the matrix at this keep ratio (KVPolicy.matrix_knobs)."""
    return POLICIES[name].matrix_knobs(keep)


def table(batch=1, hkv=2, d=4, bs=4, max_len=64) -> BlockTable:
    return BlockTable(name="t", batch=batch, num_kv_heads=hkv, head_dim=d, block_size=bs, max_len=max_len,
                      dtype=torch.float32, homes=[Tier.COMPUTE] * -(-max_len // bs), devices=CPU)


@dataclass
class Step:
    """One decode attention call of one layer, seen before its new token is appended."""
    step: int
    layer: int
    reads: list[list[int]]  # [B][Hkv] cached tokens attended
    budget: list[int]  # [B]
    missing: list[list[set[int]]]  # [B][Hkv] mandatory positions not attended
    chosen: list[list[set[int]]]  # [B][Hkv] positions attended
    disk_bytes: int  # bytes of the selected sealed blocks homed on disk (+ a key scan's)
    fallback: bool  # a dense fallback (SparPR): reads everything, past the budget by design
    idle_blocks: list[int]  # blocks moved although no sequence or head attends a token of them


class Recorder:
    """Wraps the engine's decode reads (KVReader.read: what a cell attends, before its new
    token is appended) and records what each cell reads."""

    def __init__(self, eng: Engine, keep: float):
        self.eng, self.keep, self.steps, self.step = eng, keep, [], 0
        self.real = eng.reader.read

    def __call__(self, t, layer_idx, q, fetched, w, pads):
        fetched = self.real(t, layer_idx, q, fetched, w, pads)
        pol: KVPolicy = self.eng.kv_policy
        layer = next(i for (i, _), tt in self.eng.tables.items() if tt is t)
        b, hkv = t.block_shape[1:3]
        # recorded on the CPU whatever the engine's device (its tensors may be on CUDA)
        if fetched is None:
            blocks, pos, mask = list(range(t.num_blocks)), torch.arange(t.length), None
        else:  # pos: [T+1], or [B, T+1] when each sequence reads its own row (Selection.rows)
            blocks, pos = fetched.sel.blocks, fetched.pos[..., :-1].cpu()
            mask = None if fetched.sel.mask is None else fetched.sel.mask.cpu()
        pos = pos.expand(b, -1)  # pos: [B, T]
        pad = torch.zeros(b, dtype=torch.long) if pads is None else pads.cpu()  # None: no left padding
        see = (pos[:, None, :] >= pad[:, None, None]).expand(b, hkv, -1)  # see: [B, Hkv, T]
        see = see & mask if mask is not None else see
        chosen = [[set(pos[i][see[i, h]].tolist()) for h in range(hkv)] for i in range(b)]
        sparse = hasattr(pol, "keep_ratio") and not pol.is_dense_layer(layer)
        budget, missing = [], []
        for i, p in enumerate(pad.tolist()):
            n = t.length - p
            budget.append(min(n, max(math.ceil(self.keep * n - 1e-9), pol.budget_floor(t))) if sparse else n)
            first, last = pol.mandatory(t, budget[-1]) if sparse else (0, 0)
            need = set(range(p, p + first)) | set(range(t.length - last, t.length))
            missing.append([need - c for c in chosen[i]])
        sealed = t.length // t.bs
        disk = [i for i in blocks if i < sealed and t.homes[i] == Tier.DISK]
        used = {p // t.bs for row in chosen for c in row for p in c}
        # a raw disk block moves only the sequences that attend a token of it (a fallback: all)
        whole = fetched is None or fetched.sel.seqs is None
        readers = {i: b if whole else sum(any(p // t.bs == i for c in chosen[s] for p in c) for s in range(b))
                   for i in disk}
        # blocks rebuilt from checkpoints move their checkpoint, not their KV
        rebuilt = set(fetched.sel.recompute) if fetched is not None and t.checkpoints is not None else set()
        nbytes = sum(t.checkpoints.store.codec_of(Tier.DISK).nbytes if i in rebuilt else t.store.read_bytes(i, readers[i]) for i in disk)
        if getattr(pol, "scans_keys", False):  # reads every block once more, whole, to rank keys
            nbytes += sum(t.store.codec_of(Tier.DISK).nbytes for i in range(sealed) if t.homes[i] == Tier.DISK)
        fallback = fetched is not None and (fetched.sel.dense or  # a step given to dense (SparPR's step fallback)
                                            fetched.sel.mask is None and blocks == list(range(t.num_blocks)))
        self.steps.append(Step(self.step, layer, see.sum(-1).tolist(), budget, missing, chosen,
                               nbytes, sorted(set(blocks) - used), fallback and sparse))
        return fetched


def run(model_dir, name, keep, monkeypatch=None, disk=None, sampler=None, device="cpu", kv_dtype="auto",
        recall=True, knobs=None):
    """Generate GEN tokens for PROMPTS; returns (tokens, logits, recorder, disk->cpu bytes per step).
    recall=False: every selected block is read afresh (no arena: engine/recall.py)."""
    policy = Policy(gpu_batch_size=len(PROMPTS), cache_gpu_percent=0 if disk else 100)
    cfg = EngineConfig(device=device, dtype="float32", block_size=8, kv_policy=name, kv_dtype=kv_dtype,
                       policy_args=policy_args(name, keep) | (knobs or {}), offload_dir=str(disk or "unused"))
    eng = Engine(resolve_source(str(model_dir), ""), policy, cfg)
    rec = Recorder(eng, keep)
    if not recall:
        eng.reader.recall = None
    if monkeypatch is not None:
        monkeypatch.setattr(eng.reader, "read", rec)
    per_step = []
    try:
        st = eng.prefill(PROMPTS, GEN, sampler, keep_logits=True)
        while len(st.tokens) < GEN:  # one decode call per step, to read the counters per step
            before = eng.devices.counters.snapshot().get("disk->cpu", 0)
            rec.step += 1
            st.max_new = len(st.tokens) + 1
            eng.decode(st)
            per_step.append(eng.devices.counters.snapshot().get("disk->cpu", 0) - before)
        return torch.stack(st.tokens, 1).tolist(), st.logits, rec, per_step
    finally:
        eng.close()


@pytest.fixture(params=["opt", "llama"])
def model_dir(request, tiny_opt_dir, tiny_llama_dir):
    return tiny_opt_dir if request.param == "opt" else tiny_llama_dir


# --- the matrix: every registered policy ---
@pytest.mark.parametrize("cache", ["resident", "disk"])
@pytest.mark.parametrize("name", NAMES)
def test_keep_one_equals_dense(name, cache, model_dir, tmp_path, device):
    disk = tmp_path if cache == "disk" else None
    # stored exact: keep 1 equals dense to 1e-5 (a float16 block and one rebuilt from a float16
    # checkpoint, or DKV's raw copy, differ by rounding)
    ref_tokens, ref_logits, *_ = run(model_dir, "dense", 1.0, disk=disk, device=device, kv_dtype="float32")
    tokens, logits, *_ = run(model_dir, name, 1.0, disk=disk, device=device, kv_dtype="float32")
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("keep", [0.5, 0.2])
@pytest.mark.parametrize("name", SELECTING)
def test_reads_within_budget_and_keep_mandatory(name, keep, model_dir, tmp_path, monkeypatch, device):
    *_, rec, _ = run(model_dir, name, keep, monkeypatch, disk=tmp_path, device=device)
    assert rec.steps
    for s in rec.steps:
        if s.fallback:
            continue
        for b, budget in enumerate(s.budget):
            assert max(s.reads[b]) <= budget, (s.layer, s.step, b, s.reads[b], budget)
            assert not any(s.missing[b]), (s.layer, s.step, b, s.missing[b])
        assert not s.idle_blocks, (s.layer, s.step, s.idle_blocks)


@pytest.mark.parametrize("name", [n for n in SELECTING if issubclass(POLICIES[n], BudgetPolicy)])
def test_the_token_floor_raises_a_short_contexts_budget_alike_for_every_policy(name, model_dir, tmp_path,
                                                                                monkeypatch):
    """keep 0.1 of these 29-50 token contexts is 3-5 tokens; min_keep_tokens 24 makes every
    budget at least 24 (the Recorder's budget counts it): each step reads within it, and more
    than the ratio alone lets it."""
    *_, floored, _ = run(model_dir, name, 0.1, monkeypatch, disk=tmp_path / "a", knobs={"min_keep_tokens": 24})
    *_, ratio, _ = run(model_dir, name, 0.1, monkeypatch, disk=tmp_path / "b")
    assert all(b >= 24 for s in floored.steps for b in s.budget)
    assert any(b < 24 for s in ratio.steps for b in s.budget)  # the ratio alone: a few tokens
    for s in floored.steps:
        if not s.fallback:
            assert all(max(reads) <= budget for reads, budget in zip(s.reads, s.budget)), (s.layer, s.step)
    assert sum(map(sum, (r for s in floored.steps for r in s.reads))) > \
        sum(map(sum, (r for s in ratio.steps for r in s.reads)))


def test_the_default_token_floor_reads_768_tokens_until_a_tenth_is_more():
    """The defaults: a 0.1 keep of 2048 tokens reads 768 (the floor), of 8000 tokens 800 (the ratio)."""
    for cls in (SparPR, Quest, H2O, StreamingLLM, FlexGenTopK):
        assert cls().min_keep_tokens == 768
    for n, want in ((2048, 768), (8000, 800), (600, 600)):
        t = BlockTable(name="f", batch=1, num_kv_heads=1, head_dim=4, block_size=16, max_len=8192,
                       dtype=torch.float32, homes=[Tier.COMPUTE] * 512, devices=CPU)
        for job in t.append(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4)):
            job()
        assert SparPR(keep_ratio=0.1).budgets(t) == [want]
        assert H2O(keep_ratio=0.1, min_keep_tokens=0).budgets(t) == [min(n, -(-n // 10))]
    with pytest.raises(ValueError, match="min_keep_tokens"):
        SparPR(min_keep_tokens=-1)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_tokens(name, tiny_llama_dir, tmp_path):
    runs = [run(tiny_llama_dir, name, 0.5, disk=tmp_path / str(i), sampler=Sampler(True, 1.0, 0.9, seed=7))[0]
            for i in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", SELECTING)
def test_disk_bytes_are_the_selected_blocks(name, model_dir, tmp_path, monkeypatch, device):
    """Read afresh, a step moves exactly its selected disk blocks (for their readers); through the
    arena, at most that, and after the first step less."""
    *_, rec, per_step = run(model_dir, name, 0.3, monkeypatch, disk=tmp_path / "a", device=device, recall=False)
    expect = [sum(s.disk_bytes for s in rec.steps if s.step == i + 1) for i in range(len(per_step))]
    assert per_step == expect
    assert sum(per_step) > 0
    *_, per_step = run(model_dir, name, 0.3, disk=tmp_path / "b", device=device)
    assert all(a <= b for a, b in zip(per_step, expect)) and per_step[0] == expect[0]


@pytest.mark.parametrize("name", [n for n in NAMES if "keep_ratio" in policy_args(n, 0.5)])
@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_bad_keep_ratio_is_refused(name, bad):
    with pytest.raises(ValueError):
        POLICIES[name](keep_ratio=bad)


def test_snapshot_replays_every_policy(tiny_llama_dir, tmp_path):
    """One prefill, two decodes per policy from its snapshot: same tokens (H2O restarts)."""
    eng = Engine(resolve_source(str(tiny_llama_dir), ""), Policy(gpu_batch_size=2, cache_gpu_percent=0),
                 EngineConfig(device="cpu", block_size=8, offload_dir=str(tmp_path)))
    pols = [POLICIES[n](**policy_args(n, 0.4)) for n in SELECTING if n != "dense"]
    try:
        snap = eng.snapshot(eng.prefill(PROMPTS, GEN, observers=tuple(pols)))
        for pol in pols:
            eng.set_kv_policy(pol, attach=False)
            first, again = (eng.decode(eng.restore(snap)).tokens for _ in range(2))
            assert first == again, pol.name
    finally:
        eng.close()


# --- per policy ---
def test_streaming_keeps_exactly_sinks_and_window(tiny_llama_dir, tmp_path, monkeypatch):
    *_, rec, _ = run(tiny_llama_dir, "streaming-llm", 0.4, monkeypatch, disk=tmp_path)
    for s in rec.steps:
        for b, budget in enumerate(s.budget):
            length = 40 + s.step - 1  # the longest prompt plus the tokens appended so far
            lo = length - (len(PROMPTS[b]) + s.step - 1)  # first valid position
            sinks = min(4, budget)
            want = set(range(lo, lo + sinks)) | set(range(length - (budget - sinks), length))
            assert all(c == want for c in s.chosen[b]), (s.layer, s.step, b)


def _naive_colsums(q, k, valid):
    b, h, s, d = q.shape
    out = torch.zeros(b, k.shape[1], s)
    for i in range(b):
        for hh in range(h):
            for qi in range(s):
                if not valid[i, qi]:
                    continue
                keys = [j for j in range(qi + 1) if valid[i, j]]
                p = torch.softmax(torch.stack([q[i, hh, qi] @ k[i, hh // (h // k.shape[1]), j] for j in keys])
                                  / math.sqrt(d), 0)
                for j, pj in zip(keys, p):
                    out[i, hh // (h // k.shape[1]), j] += pj
    return out


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_h2o_prefill_sums_chunked_equal_naive(chunk):
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 11, 4), torch.randn(2, 2, 11, 4)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, :3] = False
    torch.testing.assert_close(prefill_column_sums(q, k, valid, chunk), _naive_colsums(q, k, valid))


def test_h2o_keeps_top_accumulated_scores():
    """Brute force: recent window + top heavy scores among never-evicted older tokens, with the
    scores re-accumulated from plain softmaxes of every prefill and decode query."""
    torch.manual_seed(2)
    b, h, hkv, d, s = 2, 4, 2, 4, 14
    t, pol = table(batch=b, hkv=hkv, d=d), H2O(keep_ratio=0.5, min_keep_tokens=0)
    assert pol.split(10) == (5, 5) and pol.split(7) == (3, 4)  # 50/50, the odd token to recent
    pol.attach(t, 0)
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False
    t.append(k, v)
    pol.on_prefill(t, 0, q, k, valid)
    score = _naive_colsums(q, k, valid)  # score: [B, Hkv, S] grows by a column per step
    evicted = [[set() for _ in range(hkv)] for _ in range(b)]
    pads = [0, 4]
    for _ in range(8):
        sel = pol.plan(t, 0)
        pos = gathered_positions(t, sel.blocks)
        length = t.length
        for i in range(b):
            n = length - pads[i]
            heavy, recent = pol.split(token_budget(0.5, n))
            for hh in range(hkv):
                window = set(range(length - recent, length))
                pool = [j for j in range(pads[i], length - recent) if j not in evicted[i][hh]]
                top = set(sorted(pool, key=lambda j: -float(score[i, hh, j]))[:heavy])
                kept = set(pos[sel.mask[i, hh]].tolist())
                assert kept == window | top, (i, hh, length)
                evicted[i][hh] |= set(range(pads[i], length)) - kept
        qn, kn, vn = torch.randn(b, h, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
        kv, gpos = t.gather(sel.blocks)
        t.append(kn, vn)
        kv, gpos = torch.cat([kv, torch.stack([kn, vn])], dim=3), torch.cat([gpos, gpos.new_tensor([length])])
        pol.observe(t, 0, qn, kv, gpos, sel)
        k, score = torch.cat([k, kn], dim=2), torch.cat([score, torch.zeros(b, hkv, 1)], dim=2)
        for i, hh in ((i, hh) for i in range(b) for hh in range(h)):
            g = hh // (h // hkv)
            att = sorted(set(pos[sel.mask[i, g]].tolist())) + [length]
            p = torch.softmax(torch.stack([qn[i, hh, 0] @ k[i, g, j] for j in att]) / math.sqrt(d), 0)
            for j, pj in zip(att, p):
                score[i, g, j] += pj


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bs=st.integers(1, 6), nblocks=st.integers(1, 5), d=st.integers(1, 8))
def test_quest_bound_is_at_least_every_blocks_true_max(seed, bs, nblocks, d):
    gen = torch.Generator().manual_seed(seed)
    t, pol = table(batch=2, hkv=2, d=d, bs=bs, max_len=bs * nblocks), Quest(keep_ratio=0.5, min_keep_tokens=0)
    pol.attach(t, 0)
    keys = torch.randn(2, 2, bs * nblocks, d, generator=gen) * 3
    t.append(keys, torch.zeros_like(keys))
    q = torch.randn(2, 2, d, generator=gen) * 3
    kmin, kmax = pol.summaries(t, 0)  # [nb, B, Hkv, D]
    for blk in range(nblocks):
        true = (keys[:, :, blk * bs:(blk + 1) * bs] @ q[..., None])[..., 0].amax(-1)  # true: [B, Hkv]
        bound = block_upper_bound(q, kmin[blk], kmax[blk])
        assert bool((bound >= true - 1e-4).all())


def test_quest_picks_blocks_by_bound_and_keeps_first_layers_dense():
    torch.manual_seed(3)
    t, pol = table(batch=1, hkv=1, d=4, bs=4), Quest(keep_ratio=0.5, min_keep_tokens=0)
    pol.attach(t, 0)
    keys = torch.randn(1, 1, 18, 4)
    t.append(keys, keys)
    q = torch.randn(1, 1, 1, 4)
    assert pol.select(t, 1, q).mask is None and pol.plan(t, 1) is not None  # dense layer
    sel = pol.select(t, 2, q)
    kmin, kmax = pol.summaries(t, 0)  # [nb, B, Hkv, D]
    bounds = [float(block_upper_bound(q[0, 0, 0], kmin[i, 0, 0], kmax[i, 0, 0])) for i in range(4)]
    best = sorted(range(4), key=lambda i: -bounds[i])[:(9 - 2) // 4]  # budget 9, open block 2
    assert sel.blocks == sorted(best + [4])
    assert int(sel.mask.sum()) == 4 * len(best) + 2


def test_flexgen_topk_keeps_top_scores_per_head():
    torch.manual_seed(4)
    t, pol = table(batch=1, hkv=2, d=4, bs=4), FlexGenTopK(keep_ratio=0.3, min_keep_tokens=0)
    keys = torch.randn(1, 2, 13, 4)
    t.append(keys, keys)
    q = torch.randn(1, 2, 1, 4)  # one query head per KV head (MHA)
    sel = pol.select(t, 0, q)
    assert sel.blocks == sorted({p // 4 for p in sel.mask.nonzero()[:, 2].tolist()})
    for h in range(2):
        top = (keys[0, h] @ q[0, h, 0]).topk(token_budget(0.3, 13)).indices
        assert set(sel.mask[0, h].nonzero().flatten().tolist()) == set(top.tolist())


def test_streaming_needs_no_query():
    t = table(batch=1, hkv=1)
    t.append(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
    sel = StreamingLLM(keep_ratio=0.5, min_keep_tokens=0, num_sinks=2).plan(t, 0)
    assert sel.blocks == [0, 3, 4]  # sinks in block 0; the window 12..19 in blocks 3, 4
    assert int(sel.mask.sum()) == 10
