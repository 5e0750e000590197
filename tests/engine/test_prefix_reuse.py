"""Prefix reuse (engine/prefix_cache.py, engine/reuse.py, LLM.keep_prefixes): a prompt that starts
as a kept generation did computes only the rest, on whatever tier the kept blocks live, and its
greedy answer equals a full prefill's when the KV is stored exactly (--kv-dtype float32); with the
compact default, the same tokens on these prompts. Kept bytes stay within the bound per tier,
least recently used first out; a policy whose state covers every token (H2O) is prefilled whole."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr import LLM, ConfigError
from flexgen_sparpr.engine.prefix_cache import PrefixCache, block_hashes
from flexgen_sparpr.storage.tiers import Tier

PLACEMENTS = {"resident": (100, 0, 100, 0, 100, 0), "cpu": (100, 0, 0, 100, 100, 0), "disk": (100, 0, 0, 0, 100, 0),
              "half disk": (100, 0, 50, 0, 100, 0)}
N_NEW = 6


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _llm(model_dir, tmp_path, **kw) -> LLM:
    kw = {"block_size": 4, "gpu_batch_size": 1, "kv_dtype": "float32", **kw}
    return LLM(str(model_dir), offload_dir=str(tmp_path / "off"), **kw)


def _gen(llm, prompt, n=N_NEW):
    return llm.generate_ids([prompt], llm.params(n, stop=None))[0]


def _conversation(llm, first, turns, n=N_NEW):
    """Each turn: the whole conversation so far (prompt + answer) plus new tokens."""
    ids, answers = list(first), []
    for extra in turns:
        out = _gen(llm, ids, n)
        answers.append(out)
        ids = ids + out + extra
    answers.append(_gen(llm, ids, n))
    return answers, ids


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("policy", ["dense", "sparpr", "quest", "streaming-llm"])
def test_a_conversation_reusing_its_prefix_answers_as_full_prefills(tiny_model_dir, tmp_path, placement, policy):
    knobs = {} if policy == "dense" else {"kv_policy": policy, "keep_ratio": 1.0}
    first, turns = _ids(13, 1), [_ids(5, 2), _ids(7, 3)]
    with _llm(tiny_model_dir, tmp_path / "a", percent=PLACEMENTS[placement], **knobs) as llm:
        plain, _ = _conversation(llm, first, turns)
    with _llm(tiny_model_dir, tmp_path / "b", percent=PLACEMENTS[placement], prefix_cache_gb=1, **knobs) as llm:
        reused, ids = _conversation(llm, first, turns)
        s = llm.prefix_cache.stats
        assert s.hits == 2 and llm.last_stats.reused_tokens > 0
        # each later turn computed only what followed the last answer's final cached token
        assert s.computed_tokens == len(first) + sum(len(t) + 1 for t in turns)
        assert len(llm.prefix_cache) == 1
    assert reused == plain


def test_the_compact_kv_default_reuses_too_with_the_same_tokens(tiny_llama_dir, tmp_path):
    first, turns = _ids(21, 4), [_ids(6, 5)]
    with _llm(tiny_llama_dir, tmp_path / "a", kv_dtype="auto", percent=PLACEMENTS["disk"]) as llm:
        plain, _ = _conversation(llm, first, turns)
    with _llm(tiny_llama_dir, tmp_path / "b", kv_dtype="auto", percent=PLACEMENTS["disk"], prefix_cache_gb=1) as llm:
        reused, _ = _conversation(llm, first, turns)
        assert llm.prefix_cache.stats.hits == 1 and llm.prefix_cache.stats.reuse_read_bytes > 0
    assert reused == plain


def test_a_shared_start_is_found_by_whole_blocks_then_token_by_token(tiny_llama_dir, tmp_path):
    system = _ids(10, 6)
    with _llm(tiny_llama_dir, tmp_path, prefix_cache_gb=1) as llm:
        _gen(llm, system + _ids(3, 7))
        out = _gen(llm, system + _ids(4, 8))
        assert llm.last_stats.reused_tokens == len(system)  # 2 whole blocks of 4, then 2 tokens more
        assert len(llm.prefix_cache) == 1  # the first was taken, cut back and run on: one kept
    with _llm(tiny_llama_dir, tmp_path / "b") as plain:
        assert out == _gen(plain, system + _ids(4, 8))


@pytest.mark.parametrize("placement", ["disk", "cpu"])
def test_the_same_prompt_again_cuts_inside_an_offloaded_block(tiny_llama_dir, tmp_path, placement):
    prompt = _ids(14, 15)  # 3 whole blocks of 4 and 2 tokens; reused: 13, inside block 3 (sealed, offloaded)
    with _llm(tiny_llama_dir, tmp_path, prefix_cache_gb=1, percent=PLACEMENTS[placement]) as llm:
        first = _gen(llm, prompt)
        again = _gen(llm, prompt)
        assert llm.last_stats.reused_tokens == len(prompt) - 1
        third = _gen(llm, prompt + [3, 4])
        assert llm.last_stats.reused_tokens == len(prompt)
    with _llm(tiny_llama_dir, tmp_path / "b", percent=PLACEMENTS[placement]) as plain:
        assert (first, again, third) == (_gen(plain, prompt), first, _gen(plain, prompt + [3, 4]))


def test_an_unrelated_prompt_or_another_policy_is_prefilled_whole(tiny_llama_dir, tmp_path):
    with _llm(tiny_llama_dir, tmp_path, prefix_cache_gb=1) as llm:
        a = _ids(12, 9)
        _gen(llm, a)
        _gen(llm, _ids(12, 10))
        assert llm.last_stats.reused_tokens == 0 and len(llm.prefix_cache) == 2
        steps = llm.batch_steps([a + [5, 6]], [llm.params(3, stop=None)], kv_policy=llm.kv_policy_for(
            {"kv_policy": "sparpr", "keep_ratio": 0.5, "min_keep_tokens": 0}))
        for _ in steps:
            pass
        assert llm.last_stats.reused_tokens == 0  # kept under dense: another policy's state is not there


def test_h2o_is_prefilled_whole(tiny_llama_dir, tmp_path):
    with _llm(tiny_llama_dir, tmp_path, prefix_cache_gb=1, kv_policy="h2o", keep_ratio=0.5) as llm:
        a = _ids(12, 11)
        out = _gen(llm, a)
        _gen(llm, a + out + [7])
        assert llm.prefix_cache.stats.hits == 0 and llm.last_stats.reused_tokens == 0
        assert len(llm.prefix_cache) == 0  # nothing kept that nothing could reuse


def test_kept_bytes_stay_within_the_bound_least_recently_used_out(tiny_llama_dir, tmp_path):
    with _llm(tiny_llama_dir, tmp_path, prefix_cache_gb=1, percent=PLACEMENTS["half disk"]) as llm:
        a = _ids(12, 12)
        _gen(llm, a)
        one = llm.prefix_cache.held()
        assert one[Tier.DISK] > 0
        llm.keep_prefixes(max(one.values()) * 2.5 / 2 ** 30)  # room for two
        b, c = _ids(12, 13), _ids(12, 14)
        _gen(llm, b)
        _gen(llm, a + [1])  # a used again: b is now the least recently used
        _gen(llm, c)
        assert len(llm.prefix_cache) == 2 and llm.prefix_cache.stats.evictions == 1
        assert all(n <= llm.prefix_cache.limit for n in llm.prefix_cache.held().values())
        _gen(llm, b + [1])
        assert llm.last_stats.reused_tokens == 0  # b was the one let go
        assert list((tmp_path / "off").rglob("kv-*"))  # the kept ones' disk blocks
        llm.keep_prefixes(0)
        assert len(llm.prefix_cache) == 0
        assert not list((tmp_path / "off").rglob("kv-*"))  # closed: their files gone


def test_keep_prefixes_checks_its_value(tiny_llama_dir, tmp_path):
    with _llm(tiny_llama_dir, tmp_path) as llm:
        for bad in (-1, "2", True):
            with pytest.raises(ConfigError, match="prefix_cache_gb"):
                llm.keep_prefixes(bad)


def test_block_hashes_chain_the_prefix():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # block 1 equal, its prefix not
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    cache = PrefixCache(4, 0)
    assert not cache.enabled and cache.lookup([1, 2, 3, 4, 5], object(), 8) is None


def test_drop_on_a_tier_closes_only_what_holds_bytes_there():
    """On CUDA the running batch needs the device: kept generations with compute-tier bytes go."""
    from flexgen_sparpr.engine.prefix_cache import Kept
    cache, pol = PrefixCache(4, None), object()
    on_gpu = Kept(list(range(8)), {}, pol, None, 16, {Tier.COMPUTE: 100, Tier.CPU: 0})
    on_cpu = Kept(list(range(1, 9)), {}, pol, None, 16, {Tier.COMPUTE: 0, Tier.CPU: 100})
    cache.put(on_gpu)
    cache.put(on_cpu)
    cache.drop_on(Tier.COMPUTE)
    assert cache.kept() == [on_cpu] and cache.stats.evictions == 1
    assert cache.lookup(list(range(8)) + [9], pol, 10) is None  # its hashes left the index too
