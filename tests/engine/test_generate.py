"""Engine.generate: sampling, stop tokens, argument errors, offload-dir cleanup, bytes moved
per step, prefill snapshots."""
from __future__ import annotations


import pytest
import torch

from flexgen_sparpr.engine.config import ConfigError, EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.sampling import Sampler
from flexgen_sparpr.engine.weights import LOOKUP_TABLES
from flexgen_sparpr.storage.tiers import Tier
from flexgen_sparpr.weights.resolve import resolve_source

PROMPTS = [[17, 201, 33], [5, 6, 7, 8, 9, 10, 11]]
C_DISK = dict(cache_gpu_percent=0, cache_cpu_percent=0)


def engine(model_dir, tmp_path, policy=None, block_size=4, **cfg):
    src = resolve_source(str(model_dir), "")
    return Engine(src, policy or Policy(gpu_batch_size=2),
                  EngineConfig(block_size=block_size, offload_dir=str(tmp_path / "offload"), **cfg))


# --- sampling -----------------------------------------------------------------------------
def test_sampling_is_reproducible_per_seed_and_differs_across_seeds(tiny_model_dir, tmp_path):
    with engine(tiny_model_dir, tmp_path) as eng:
        def sample(seed, **kw):
            return eng.generate(PROMPTS, 12, sampler=Sampler(do_sample=True, seed=seed, **kw)).tokens

        a, b, c = sample(1), sample(1), sample(2)
        assert a == b
        assert a != c
        assert sample(1, top_p=0.9, temperature=0.7) == sample(1, top_p=0.9, temperature=0.7)
        greedy = eng.generate(PROMPTS, 12).tokens
        assert a != greedy  # near-uniform tiny-model logits: sampling really samples


def test_tiny_top_p_is_greedy(tiny_model_dir, tmp_path):
    with engine(tiny_model_dir, tmp_path, Policy(gpu_batch_size=2, **C_DISK)) as eng:
        greedy = eng.generate(PROMPTS, 10, keep_logits=True)
        nucleus = eng.generate(PROMPTS, 10, sampler=Sampler(do_sample=True, top_p=1e-6, seed=3))
        assert nucleus.tokens == greedy.tokens
        assert greedy.tokens == [row.argmax(-1).tolist() for row in torch.stack(greedy.logits, 1)]


def test_top_p_breaks_ties_by_token_id():
    """float16 logits tie often; the nucleus is cut from a stable sort, so among tied tokens
    the lower id comes first, as greedy's argmax picks it (an unstable sort picked any)."""
    logits = torch.zeros(3, 1000)
    logits[:, 1:] = 5.0  # 999 tied tokens
    logits[2, 7] = 6.0
    got = Sampler(do_sample=True, top_p=1e-6, seed=0)(logits)
    assert got.tolist() == logits.argmax(-1).tolist() == [1, 1, 7]


def test_sampler_rejects_bad_settings():
    for kw in (dict(temperature=0), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampler(do_sample=True, **kw)


def test_result_shapes(tiny_opt_dir, tmp_path):
    with engine(tiny_opt_dir, tmp_path) as eng:
        r = eng.generate(PROMPTS, 5)
        assert len(r.tokens) == 2 and all(len(t) == 5 for t in r.tokens)
        assert len(r.step_times) == 5 and all(t > 0 for t in r.step_times)
        assert r.logits == []
        r = eng.generate(PROMPTS, 5, keep_logits=True)
        assert len(r.logits) == 5 and r.logits[0].shape == (2, 300) and r.logits[0].dtype == torch.float32


# --- stop tokens --------------------------------------------------------------------------
def expected_with_stop(ref, stop):
    """Each row runs up to and including its first `stop`, then repeats `stop`; generation ends
    once every row has stopped."""
    firsts = [row.index(stop) if stop in row else None for row in ref]
    n = len(ref[0]) if None in firsts else max(firsts) + 1
    return [row[:n] if f is None else (row[:f + 1] + [stop] * n)[:n] for row, f in zip(ref, firsts)]


def _first_new(ref):
    """A token first generated at a step > 0 of row 0 (so the prefill step is not involved)."""
    for i, t in enumerate(ref[0]):
        if i > 0 and t not in ref[0][:i] and t not in ref[1][:1]:
            return t
    pytest.skip("no suitable stop token in this greedy run")


def test_stop_token_stops_and_pads_with_the_stop_id(tiny_llama_dir, tmp_path):
    with engine(tiny_llama_dir, tmp_path, Policy(gpu_batch_size=2, **C_DISK)) as eng:
        ref = eng.generate(PROMPTS, 10).tokens
        assert len(set(ref[0])) > 2, ref  # a varied sequence, so stopping is visible
        stop = _first_new(ref)
        got = eng.generate(PROMPTS, 10, stop=stop).tokens
        assert got == expected_with_stop(ref, stop)
        assert got[0][ref[0].index(stop):] == [stop] * (len(got[0]) - ref[0].index(stop))
        # once every row has stopped, generation ends early
        same = [PROMPTS[0], PROMPTS[0]]
        ref = eng.generate(same, 10).tokens
        stop = _first_new(ref)
        got = eng.generate(same, 10, stop=stop).tokens
        assert got == expected_with_stop(ref, stop)
        assert len(got[0]) == ref[0].index(stop) + 1 < 10


def test_stop_token_as_the_first_new_token(tiny_llama_dir, tmp_path):
    with engine(tiny_llama_dir, tmp_path) as eng:
        ref = eng.generate(PROMPTS, 6).tokens
        stop = ref[0][0]
        got = eng.generate(PROMPTS, 6, stop=stop).tokens
        assert got == expected_with_stop(ref, stop)


# --- argument errors ----------------------------------------------------------------------
def test_wrong_prompt_count_empty_prompt_and_no_new_tokens_raise(tiny_opt_dir, tmp_path):
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=2, num_gpu_batches=2)) as eng:
        with pytest.raises(ConfigError, match="prompts"):
            eng.generate(PROMPTS, 4)  # 2 prompts, the policy runs 2 x 2
        with pytest.raises(ConfigError):
            eng.generate(PROMPTS + [[4], []], 4)
        with pytest.raises(ConfigError):
            eng.generate(PROMPTS * 2, 0)
        eng.generate(PROMPTS * 2, 2)  # the engine is still usable


def test_too_long_for_the_opt_position_table_raises(tiny_opt_dir, tmp_path):
    src = resolve_source(str(tiny_opt_dir), "")
    assert src.spec.max_pos == 256
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=1)) as eng:
        with pytest.raises(ConfigError, match="position"):
            eng.generate([list(range(3, 253))], 7)  # 250 + 7 > 256
        r = eng.generate([list(range(3, 253))], 6)  # 250 + 6 fits
        assert len(r.tokens[0]) == 6


@pytest.mark.parametrize("kwargs", [
    dict(gpu_batch_size=0), dict(num_gpu_batches=0), dict(w_gpu_percent=70, w_cpu_percent=40),
    dict(cache_gpu_percent=-1), dict(attn_sparsity=0), dict(attn_sparsity=1.5),
    dict(act_gpu_percent=50, act_cpu_percent=50), dict(act_gpu_percent=0, act_cpu_percent=0),
    dict(compress_cache=True, attn_sparsity=0.5),
])
def test_bad_policies_raise(kwargs):
    with pytest.raises(ConfigError):
        Policy(**kwargs)


def test_bad_engine_config_raises():
    with pytest.raises(ConfigError):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError):
        EngineConfig(dtype="int8")


# --- the offload directory ----------------------------------------------------------------
def test_offload_dir_is_left_empty_after_close(tiny_opt_dir, tmp_path):
    off = tmp_path / "offload"
    off.mkdir()
    pol = Policy(gpu_batch_size=2, w_gpu_percent=50, w_cpu_percent=0, **C_DISK)
    eng = engine(tiny_opt_dir, tmp_path, pol)
    runs = list(off.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("run-")
    eng.generate(PROMPTS, 6)
    assert any(runs[0].iterdir())  # weight and KV files while running
    eng.generate(PROMPTS, 3)  # a second generate replaces the KV files
    eng.close()
    assert list(off.iterdir()) == []
    eng.close()  # twice is fine


def test_offload_dir_created_by_the_engine_is_removed(tiny_opt_dir, tmp_path):
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=2, **C_DISK)) as eng:
        eng.generate(PROMPTS, 3)
        assert (tmp_path / "offload").is_dir()
    assert not (tmp_path / "offload").exists()


def test_no_offload_dir_without_disk_placement(tiny_opt_dir, tmp_path):
    with engine(tiny_opt_dir, tmp_path) as eng:
        eng.generate(PROMPTS, 3)
        assert eng.disk is None
    assert not (tmp_path / "offload").exists()


def test_offload_dir_empty_after_a_failed_generate(tiny_opt_dir, tmp_path):
    off = tmp_path / "offload"
    off.mkdir()
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=2, **C_DISK)) as eng:
        with pytest.raises(ConfigError):
            eng.generate([[1], [2], [3]], 3)  # more prompts than the batch
    assert list(off.iterdir()) == []


def test_fewer_prompts_than_the_batch_run_as_a_smaller_batch(tiny_opt_dir, tmp_path):
    """One prompt under --gpu-batch-size 4 computes one row (no copies), with the tokens a batch of
    one gives; several GPU batches keep their shape (the caller fills them up)."""
    prompt = [list(range(3, 20))]
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=4, **C_DISK)) as eng:
        assert eng.can_shrink
        got = eng.generate(prompt, 5).tokens
        assert {t.block_shape[1] for t in eng.tables.values()} == {1}  # the tables hold one row
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=1, **C_DISK)) as eng:
        assert got == eng.generate(prompt, 5).tokens
    with engine(tiny_opt_dir, tmp_path, Policy(gpu_batch_size=2, num_gpu_batches=2, **C_DISK)) as eng:
        assert not eng.can_shrink
        with pytest.raises(ConfigError):
            eng.generate(prompt, 3)


# --- bytes moved --------------------------------------------------------------------------
def record_steps(eng):
    """Wrap eng._step to keep the link counters' increments of every step."""
    steps, orig = [], eng._step

    def step(*args, **kwargs):
        before = eng.devices.counters.snapshot()
        out = orig(*args, **kwargs)
        after = eng.devices.counters.snapshot()
        steps.append({k: after.get(k, 0) - before.get(k, 0) for k in after})
        return out

    eng._step = step
    return steps


def test_cache_on_compute_moves_nothing(tiny_model_dir, tmp_path, device):
    """Weights, cache and activations on the compute tier: no link is crossed (on CUDA too: a
    tensor already on `cuda:0` is not a copy)."""
    with engine(tiny_model_dir, tmp_path, Policy(gpu_batch_size=2, num_gpu_batches=2), device=device,
                dtype="float32") as eng:
        eng.generate(PROMPTS * 2, 6)
        snap = eng.devices.counters.snapshot()
    assert sum(snap.values()) == 0, snap


@pytest.mark.parametrize("bs, gbs, ngb", [(4, 2, 1), (4, 1, 2), (1, 2, 2), (16, 2, 1)])
def test_disk_cache_bytes_per_step(tiny_model_dir, tmp_path, bs, gbs, ngb, device):
    """Decode step i reads every sealed block of every (layer, GPU batch) from disk (the tail is
    on compute) and writes the blocks this step seals; the prefill reads nothing. On CUDA each
    of those bytes also crosses the host<->device link once."""
    src = resolve_source(str(tiny_model_dir), "")
    spec = src.spec
    prompts = [[5 + b] * (3 + 4 * b) for b in range(gbs * ngb)]
    plen, n = max(map(len, prompts)), 9
    with engine(tiny_model_dir, tmp_path, Policy(gpu_batch_size=gbs, num_gpu_batches=ngb, **C_DISK),
                block_size=bs, device=device, dtype="float32") as eng:
        steps = record_steps(eng)
        eng.generate(prompts, n)
        cuda = eng.devices.is_cuda
    block_bytes = 2 * gbs * spec.num_kv_heads * bs * spec.head_dim * 2  # K and V stored float16 (--kv-dtype auto)
    tables = spec.num_layers * ngb
    assert len(steps) == n
    for i, moved in enumerate(steps):
        before = plen + i - 1 if i else 0  # tokens cached when the step starts
        after = plen + i  # ... and when it ends
        read, wrote = tables * (before // bs) * block_bytes, tables * (after // bs - before // bs) * block_bytes
        want = {"disk->cpu": read, "cpu->disk": wrote} | ({"cpu->compute": read, "compute->cpu": wrote} if cuda else {})
        assert {k: v for k, v in moved.items() if v} == {k: v for k, v in want.items() if v}, i


def test_weights_on_disk_are_read_once_per_step(tiny_model_dir, tmp_path, device):
    src = resolve_source(str(tiny_model_dir), "")
    pol = Policy(gpu_batch_size=2, w_gpu_percent=0, w_cpu_percent=0)
    with engine(tiny_model_dir, tmp_path, pol, device=device, dtype="float32") as eng:
        # per step every executor layer loads its tensors (a tied embedding twice: embed and head), but
        # the embedding layer's lookup tables, read by row (engine/table_rows.py)
        per_step = sum(src.get(n).numel() * 4 for layer in eng.layers for n in layer.names.values())
        tables = sum(src.get(n).numel() * 4 for short, n in eng.layers[0].names.items() if short in LOOKUP_TABLES)
        assert eng.weights.nbytes_on(Tier.DISK) == sum(src.get(n).numel() * 4 for n in eng.weights.stored)
        steps = record_steps(eng)
        eng.generate(PROMPTS, 4)
        links = ["disk->cpu"] + (["cpu->compute"] if eng.devices.is_cuda else [])
    assert len(steps) == 4 and all(sorted(k for k, v in s.items() if v) == sorted(links) for s in steps)
    for i, s in enumerate(steps):
        assert all(s[k] == s["disk->cpu"] for k in links)
        # the prefill's rows may be many (then the table is read whole); a decode step's, two a table
        assert per_step - tables < s["disk->cpu"] <= (per_step if i == 0 else per_step - tables + tables / 8), i


# --- prefill snapshots and padding --------------------------------------------------------
@pytest.mark.parametrize("placement", [dict(), C_DISK])
@pytest.mark.parametrize("sampled", [False, True])
def test_snapshot_restore_replays_the_same_decode(tiny_model_dir, tmp_path, placement, sampled):
    def sampler():  # a fresh sampler: the snapshot must carry its random state
        return Sampler(do_sample=True, seed=4) if sampled else None

    with engine(tiny_model_dir, tmp_path, Policy(gpu_batch_size=2, **placement)) as eng:
        plain = eng.generate(PROMPTS, 9, sampler=sampler(), keep_logits=True)
        st = eng.prefill(PROMPTS, 9, sampler=sampler(), keep_logits=True)
        snap = eng.snapshot(st)
        first = eng.decode(st)
        second = eng.decode(eng.restore(snap))
    assert first.tokens == second.tokens == plain.tokens
    for a, b, c in zip(first.logits, second.logits, plain.logits):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
        torch.testing.assert_close(b, c, rtol=0, atol=1e-5)


def test_extra_left_padding_changes_nothing(tiny_model_dir, tmp_path):
    with engine(tiny_model_dir, tmp_path, Policy(gpu_batch_size=2, **C_DISK)) as eng:
        a = eng.generate(PROMPTS, 6, keep_logits=True)
        b = eng.generate(PROMPTS, 6, keep_logits=True, pad_to=13)
    assert a.tokens == b.tokens
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=0, atol=1e-4)
