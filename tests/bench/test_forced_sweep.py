"""Teacher forcing through the engine's own loop (bench/forced.py) and the shared-prefill sweep
(bench/sweep.py), on a tiny Llama made here: the forced NLLs are the model's, every policy
decodes from one prefill, and keep 1 reads what dense reads."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.bench.forced import ForcedTokens
from flexgen_sparpr.bench.sweep import Config, PolicySweep, configs
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.weights.resolve import resolve_source

torch.manual_seed(0)
TEXT = torch.randint(4, 300, (2, 80)).tolist()  # two sequences of 80 ids
P = 64
F = ":min_keep_tokens=0"  # a policy knob: no token floor (these contexts are tens of tokens)


def test_forced_tokens_then_greedy():
    s = ForcedTokens([[3, 4], [5, 6]])
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0
    assert s(logits).tolist() == [3, 5] and s(logits).tolist() == [4, 6]
    assert s(logits).tolist() == [7, 7]  # forced run out: greedy
    expect = -torch.log_softmax(logits.double(), -1)[0, 3]
    assert s.nll.shape == (2, 2) and s.nll[0, 0] == pytest.approx(float(expect))
    assert not s.top1.any()
    with pytest.raises(ValueError):
        ForcedTokens([1, 2, 3])


def test_teacher_forced_decode_scores_what_a_full_forward_scores(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    ids = torch.tensor(TEXT)
    with torch.no_grad():
        ref = -torch.log_softmax(hf(ids).logits.double(), -1)  # ref: [2, 80, V]
    want = ref[:, P:-1].gather(2, ids[:, P + 1:, None])[..., 0]  # tokens P+1.. scored from decode steps
    src = resolve_source(str(tiny_llama_dir), "")
    with Engine(src, Policy(gpu_batch_size=2), EngineConfig(block_size=8)) as eng:
        st = eng.prefill([t[:P] for t in TEXT], 80 - P, ForcedTokens([t[P:] for t in TEXT]))
        st.sampler = ForcedTokens([t[P + 1:] for t in TEXT])
        res = eng.decode(st)
    assert [r[:80 - P] for r in res.tokens] == [t[P:] for t in TEXT]  # it fed the text, not its guesses
    assert torch.allclose(st.sampler.nll, want, atol=1e-4)


def test_sweep_decodes_every_config_from_one_prefill(tiny_llama_dir):
    src = resolve_source(str(tiny_llama_dir), "")
    # the test's 56-token prompts are under the default 768-token floor: the ratio alone (F)
    cfgs = configs([f"sparpr{F}", f"h2o{F}", f"quest{F}", "dkv", f"sparpr{F}+dkv"], [1.0, 0.25])
    seen = {}

    def done(cfg, res, sampler, secs):
        seen[cfg] = sampler.nll.clone()
    sweep = PolicySweep(src, block_size=8, dkv_block=16, dkv_args={"rank": 4, "residuals": 2})
    try:
        times = sweep.run([t[:P] for t in TEXT], 80 - P, cfgs,
                          lambda c: ForcedTokens([t[P + (c is not None):] for t in TEXT]), on_done=done)
        # what each family's engine resolved --weight-format to (ppl.py / needle.py record it per batch)
        # (random float weights: auto keeps every matmul weight raw, the projections and the head)
        formats = sweep.weight_formats()
        assert set(formats) == {"raw", "dkv"} and all(f.startswith("auto: raw (") for f in formats.values())
    finally:
        sweep.close()
    assert set(seen) == set(cfgs) and set(times["prefill_s"]) == {"raw", "dkv"}
    dense = seen[Config("dense")]
    assert torch.allclose(seen[Config(f"sparpr{F}", 1.0)], dense, atol=1e-6)  # keep 1 reads everything
    assert torch.allclose(seen[Config(f"h2o{F}", 1.0)], dense, atol=1e-6)
    assert not torch.allclose(seen[Config(f"h2o{F}", 0.25)], dense, atol=1e-3)  # a keep below 1 reads less
    assert seen[Config("dkv")].shape == dense.shape


def test_configs_reject_unknown_policies():
    with pytest.raises(ValueError, match="nope"):
        configs(["nope"], [0.5])
    assert [c.label for c in configs(["dkv", "quest"], [0.5, 0.1])] == ["dense", "dkv", "quest@0.5", "quest@0.1"]


def test_every_budgeted_policy_takes_a_keep_below_its_default_floor():
    """needle.py / ppl.py's keep 0.05: SparPR's floor (min_keep 0.1) follows the keep down instead
    of refusing the cell; a keep above it leaves the floor alone."""
    from flexgen_sparpr.bench.sweep import new_policy
    low = new_policy(Config("sparpr", 0.05))
    assert (low.keep_ratio, low.min_keep) == (0.05, 0.05)
    assert new_policy(Config("sparpr", 0.5)).min_keep == 0.1
    for name in ("quest", "h2o", "streaming-llm", "flexgen-topk"):
        assert new_policy(Config(name, 0.02)).keep_ratio == 0.02


def test_sweep_reads_blocks_stored_in_each_kv_dtype(tiny_llama_dir, tmp_path):
    """"A+q8" / "A+q4" / "A+float16": policy A decoding over blocks stored as --kv-dtype gives them
    on the disk tier (one dense prefill per dtype, every policy observing it): q8 stays near the
    float32 NLLs, q4 moves further, and SparPR over q8 blocks reads its keep of them."""
    src = resolve_source(str(tiny_llama_dir), "")
    cfgs = configs(["dense+q8", "dense+q4", "dense+float16", f"sparpr{F}+q8"], [0.25])
    assert [c.family for c in cfgs] == ["raw", "kv-q8", "kv-q4", "kv-float16", "kv-q8"]
    assert [c.label for c in cfgs] == ["dense", "dense+q8", "dense+q4", "dense+float16", f"sparpr{F}+q8@0.25"]
    seen = {}

    def done(cfg, res, sampler, secs):
        seen[cfg] = sampler.nll.clone()
    sweep = PolicySweep(src, block_size=8, offload_dir=str(tmp_path))
    try:
        times = sweep.run([t[:P] for t in TEXT], 80 - P, cfgs,
                          lambda c: ForcedTokens([t[P + (c is not None):] for t in TEXT]), on_done=done)
        assert any(tmp_path.iterdir())  # the disk tier's files, there while the engines are open
        homes = {fam: {t for tab in llm.engine.tables.values() for t in tab.homes[:-1]}
                 for (fam, _), llm in sweep._llms.items()}
    finally:
        sweep.close()
    assert not any(tmp_path.iterdir())  # and gone with them
    assert set(times["prefill_s"]) == {"raw", "kv-q8", "kv-q4", "kv-float16"}
    assert all(str(h) == "{<Tier.DISK: 'disk'>}" for f, h in homes.items() if f != "raw"), homes
    dense = seen[Config("dense")]
    err = {k: float((seen[Config(f"dense+{k}")] - dense).abs().max()) for k in ("float16", "q8", "q4")}
    assert 0 < err["q8"] < err["q4"] and err["q8"] < 5e-2, err
    assert not torch.allclose(seen[Config(f"sparpr{F}+q8", 0.25)], seen[Config("dense+q8")], atol=1e-3)


def test_kv_dtype_compositions_are_checked():
    with pytest.raises(ValueError, match="KV dtype"):
        configs(["dkv+q8"], [0.5])  # a codec policy stores its own blocks
    with pytest.raises(ValueError):
        configs(["dense+q3"], [0.5])
