"""--kv-dtype: raw KV blocks on the CPU and disk tiers stored compactly (float16 by default),
computed in the compute dtype. The tolerance is stated here: teacher-forced logits against HF
(float32 everywhere) within 2e-3 of the logit scale on tiny random models, greedy tokens equal to
the exact run on the real model, and exactly half the offloaded bytes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexgen_sparpr.config.prompts import load_tokenizer, text_ids
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.storage.codec import RawCodec, kv_group_codec
from flexgen_sparpr.storage.tiers import Devices
from flexgen_sparpr.weights.resolve import resolve_source
from tests.engine.test_vs_hf import C_DISK, C_SPLIT, LONG, MIXED, forced_logits, hf_greedy, run_engine

PLACEMENTS = {"cache-30-30-40": C_SPLIT, "cache-all-disk": C_DISK,
              "cache-all-cpu": dict(cache_gpu_percent=0, cache_cpu_percent=100)}


@pytest.fixture
def tiers(request, monkeypatch):
    """The placement's policy kwargs; the CPU tier kept apart from compute (as on a CUDA machine:
    on a CPU-only one it is the compute memory, where KV stays in the compute dtype)."""
    monkeypatch.setattr(Devices, "effective", lambda self, tier: tier)
    return PLACEMENTS[request.param]


def test_auto_stores_offloaded_kv_in_half_precision():
    cfg = EngineConfig()
    assert cfg.torch_kv_dtype(torch.float32) == torch.float16
    assert cfg.torch_kv_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_dtype="float32").torch_kv_dtype(torch.float32) == torch.float32
    with pytest.raises(ConfigError, match="--kv-dtype"):
        EngineConfig(kv_dtype="int8")


@pytest.mark.parametrize("tiers", list(PLACEMENTS), indirect=True)
def test_float16_kv_logits_within_tolerance_of_hf(tiny_model_dir, tmp_path, tiers):
    src = resolve_source(str(tiny_model_dir), "")
    ref_tokens, ref_logits = hf_greedy(tiny_model_dir, LONG)
    err = {}
    for kvd in ("float32", "float16"):
        eng = Engine(src, Policy(gpu_batch_size=2, **tiers),
                     EngineConfig(block_size=4, dtype="float32", kv_dtype=kvd, offload_dir=str(tmp_path / kvd)))
        try:
            got = forced_logits(eng, LONG, ref_tokens)  # fed HF's tokens: comparable step by step
        finally:
            eng.close()
        err[kvd] = float((got - ref_logits).abs().max() / ref_logits.abs().max())
    assert err["float32"] < 1e-5, err  # exact storage: HF's float32 numbers
    assert err["float32"] < err["float16"] < 2e-3, err  # the blocks really went through float16


@pytest.mark.parametrize("tiers", ["cache-all-disk", "cache-all-cpu"], indirect=True)
def test_float16_kv_moves_half_the_bytes(tiny_opt_dir, tmp_path, tiers):
    src = resolve_source(str(tiny_opt_dir), "")
    links = {}
    for kvd in ("float32", "float16"):
        *_, links[kvd] = run_engine(src, Policy(gpu_batch_size=2, **tiers), tmp_path / kvd, MIXED,
                                    block_size=4, dtype="float32", kv_dtype=kvd)
    moved = [k for k, v in links["float32"].items() if v and k != "disk->compute"]
    assert moved
    for link in moved:
        assert links["float16"][link] * 2 == links["float32"][link], (link, links)


@pytest.mark.slow
def test_real_model_greedy_tokens_equal_with_float16_kv(smollm2_dir, tmp_path):
    """SmolLM2, KV on disk, a ~1.5k-token passage with a passkey: the default float16 storage, and
    q8, pick the same greedy tokens as float32, with float32 weights (the KV's storage alone differs).
    With the int4 default, whose 8-bit activation codes round a last-bit change upstream into a few
    hundredths of a logit, float16's tokens part from float32's only at a near tie of the float32 run
    (measured: step 9 on an AMD EPYC's AVX2 build, 17.654 against 17.647)."""
    src = resolve_source(str(smollm2_dir), "")
    text = (Path(__file__).parents[1] / "data" / "plrabn12.txt").read_text()[20000:26000]
    cut = len(text) // 2
    text = text[:cut] + " The passkey is 58213. Remember it. " + text[cut:] + "\nWhat is the passkey? The passkey is"
    ids = [text_ids(load_tokenizer(src.tokenizer_dir), text, chat=False, vocab=src.spec.vocab)]
    toks = {}
    for kvd in ("float32", "float16", "q8"):
        toks[kvd], *_ = run_engine(src, Policy(gpu_batch_size=1, **C_DISK), tmp_path / kvd, ids, n=16,
                                   block_size=16, dtype="float32", kv_dtype=kvd, weight_format="raw")
    assert toks["float16"] == toks["float32"]
    assert toks["q8"] == toks["float32"]
    runs = {kvd: run_engine(src, Policy(gpu_batch_size=1, **C_DISK), tmp_path / f"auto-{kvd}", ids, n=16,
                            block_size=16, dtype="float32", kv_dtype=kvd, weight_format="auto")
            for kvd in ("float32", "float16")}
    (want, logits, _), (got, _, _) = runs["float32"], runs["float16"]
    same = next((i for i, (a, b) in enumerate(zip(want[0], got[0])) if a != b), len(want[0]))
    if same < len(want[0]):
        top2 = logits[same, 0].float().topk(2).values
        assert top2[0] - top2[1] < 0.005 * top2[0].abs(), (same, top2.tolist())


# --- q8 / q4: the offloaded blocks group-quantized (64 values a group, min and scale each) -------
def test_quantized_kv_dtypes_and_their_one_codec_rule(tiny_opt_dir, tmp_path):
    assert (EngineConfig(kv_dtype="q8").kv_bits, EngineConfig(kv_dtype="q4").kv_bits) == (8, 4)
    assert EngineConfig(kv_dtype="q8").torch_kv_dtype(torch.float32) == torch.float32  # decoded to compute
    src = resolve_source(str(tiny_opt_dir), "")
    with pytest.raises(ConfigError, match="one KV codec"):
        Engine(src, Policy(gpu_batch_size=1, compress_cache=True, **C_DISK),
               EngineConfig(kv_dtype="q8", offload_dir=str(tmp_path)))


@pytest.mark.parametrize("tiers", ["cache-30-30-40", "cache-all-disk"], indirect=True)
def test_quantized_kv_logits_within_their_stated_tolerance(tiny_model_dir, tmp_path, tiers):
    """q8 within 2e-2 of the logit scale of HF, q4 within 1e-1, each further than the one above
    it (the blocks really went through the codes)."""
    src = resolve_source(str(tiny_model_dir), "")
    ref_tokens, ref_logits = hf_greedy(tiny_model_dir, LONG)
    err = {}
    for kvd in ("float16", "q8", "q4"):
        eng = Engine(src, Policy(gpu_batch_size=2, **tiers),
                     EngineConfig(block_size=4, dtype="float32", kv_dtype=kvd, offload_dir=str(tmp_path / kvd)))
        try:
            got = forced_logits(eng, LONG, ref_tokens)
        finally:
            eng.close()
        err[kvd] = float((got - ref_logits).abs().max() / ref_logits.abs().max())
    assert err["float16"] < err["q8"] < 2e-2 and err["q8"] < err["q4"] < 1e-1, err


@pytest.mark.parametrize("tiers", ["cache-all-disk", "cache-all-cpu"], indirect=True)
def test_quantized_kv_moves_fewer_bytes(tiny_opt_dir, tmp_path, tiers):
    """Exactly the codec's bytes per block: per group of a head's values (up to 64), 8- or 4-bit codes
    and a float32 min and scale (tiny OPT's 16-value heads: q8 24 bytes, q4 16, float16 32)."""
    shape = (2, 2, 4, 4, 16)  # [planes, B, Hkv, bs, D] of tiny OPT at block 4
    size = {kvd: kv_group_codec(shape, torch.float32, bits).nbytes for kvd, bits in (("q8", 8), ("q4", 4))}
    size["float16"] = RawCodec(shape, torch.float16).nbytes
    assert size["q4"] < size["q8"] < size["float16"]
    src = resolve_source(str(tiny_opt_dir), "")
    links = {}
    for kvd in ("float16", "q8", "q4"):
        *_, links[kvd] = run_engine(src, Policy(gpu_batch_size=2, **tiers), tmp_path / kvd, MIXED,
                                    block_size=4, dtype="float32", kv_dtype=kvd)
    moved = [k for k, v in links["float16"].items() if v and k != "disk->compute"]
    assert moved
    for link in moved:
        for q in ("q8", "q4"):
            assert links[q][link] * size["float16"] == links["float16"][link] * size[q], (link, links)


@pytest.mark.parametrize("tiers", ["cache-all-disk"], indirect=True)
def test_sparpr_selects_over_quantized_blocks(tiny_llama_dir, tmp_path, tiers):
    """Under SparPR the q8 blocks are selected, read and decoded like raw ones: reading every block
    (keep 1) gives dense's tokens over the same q8 cache; at keep 0.25 it reads fewer bytes."""
    src = resolve_source(str(tiny_llama_dir), "")
    out = {}
    for name, knobs in (("dense", {}), ("sparpr@1", {"keep_ratio": 1.0}), ("sparpr@0.25", {"keep_ratio": 0.25, "min_keep_tokens": 0})):
        kw = dict(kv_policy="sparpr", policy_args=knobs) if knobs else {}
        out[name] = run_engine(src, Policy(gpu_batch_size=2, **tiers), tmp_path / name, MIXED, block_size=4,
                               dtype="float32", kv_dtype="q8", **kw)
    assert out["sparpr@1"][0] == out["dense"][0]
    assert out["sparpr@0.25"][-1]["disk->cpu"] < out["dense"][-1]["disk->cpu"]

