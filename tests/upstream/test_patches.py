"""apply_cpu_patches: upstream FlexGen runs on the CPU, the patches are idempotent and reach
upstream's code only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_sparpr.upstream.patches import PATCHES, apply_cpu_patches, applied


def test_apply_is_idempotent():
    first = apply_cpu_patches()
    import flexgen.pytorch_backend as backend
    state = (backend.TorchDevice.__init__, torch.Tensor.cuda, torch.Tensor.pin_memory, backend.torch)
    assert apply_cpu_patches() == first == applied() == [p.__name__ for p in PATCHES]
    assert (backend.TorchDevice.__init__, torch.Tensor.cuda, torch.Tensor.pin_memory, backend.torch) == state
    assert all(p.__doc__ and len(p.__doc__.strip().splitlines()) == 1 for p in PATCHES)  # one-line why each


def test_patches_reach_upstream_only():
    apply_cpu_patches()
    import flexgen.flex_opt as flex_opt
    import flexgen.pytorch_backend as backend
    assert torch.cuda.synchronize is not flex_opt.torch.cuda.synchronize  # the real one is untouched
    flex_opt.torch.cuda.synchronize()  # upstream's is a no-op on the CPU
    with flex_opt.torch.cuda.stream(flex_opt.torch.cuda.Stream()):
        pass
    if not torch.cuda.is_available():  # outside upstream, .cuda() still means CUDA
        with pytest.raises((AssertionError, RuntimeError)):
            torch.zeros(2).cuda()
        with pytest.raises(RuntimeError):
            torch.zeros(2).pin_memory()
    from flexgen_sparpr.upstream.patches import use_float32_compute
    use_float32_compute(True)
    try:
        assert torch.zeros(2).half().dtype == torch.float16  # the float32 opt-in is upstream's only
    finally:
        use_float32_compute(False)
    gpu = backend.TorchDevice("cuda:0")
    assert gpu.dev.type == "cpu" and gpu.device_type == backend.DeviceType.CUDA
    t = gpu.allocate((3, 4), np.float16)
    assert t.data.device.type == "cpu" and t.data.dtype == torch.float16


def test_upstream_as_shipped_generates_on_cpu():
    """Upstream's own dummy weights (all ones) and float16: it runs; the ids are valid."""
    from flexgen_sparpr.upstream.run import generate_upstream
    toks = np.asarray(generate_upstream(batch=2, prompt_len=16, gen_len=2, dtype="float16", warmup=False)["tokens"])
    assert toks.shape == (2, 2) and ((toks >= 0) & (toks < 50272)).all()


def test_upstream_generates_on_cpu(upstream_dense):
    from flexgen.opt_config import get_opt_config
    vocab = get_opt_config("opt-125m").vocab_size
    c, toks = upstream_dense["config"], np.asarray(upstream_dense["tokens"])
    assert toks.shape == (c["batch"], c["gen_len"])
    assert ((toks >= 0) & (toks < vocab)).all()
    assert upstream_dense["prefill_s"] > 0 and upstream_dense["decode_s"] > 0
    assert toks[0].tolist() != toks[1].tolist()  # distinct prompts, distinct continuations


def test_upstream_is_deterministic(upstream_dense):
    from flexgen_sparpr.upstream.run import generate_upstream
    c = upstream_dense["config"]
    again = generate_upstream(batch=c["batch"], prompt_len=c["prompt_len"], gen_len=c["gen_len"],
                              weights="engine", warmup=False)
    assert again["tokens"] == upstream_dense["tokens"]


def test_upstream_dense_equals_this_engine(upstream_dense, tmp_path):
    """Same dummy weights (this engine's seeded values), same prompts: same greedy tokens."""
    from flexgen_sparpr.engine.config import EngineConfig, Policy
    from flexgen_sparpr.engine.executor import Engine
    from flexgen_sparpr.upstream.run import _prompt_ids
    from flexgen_sparpr.weights.resolve import resolve_source
    c = upstream_dense["config"]
    prompts = _prompt_ids(c["batch"], c["prompt_len"], 50272, c["seed"]).tolist()
    cfg = EngineConfig(dtype="float32", offload_dir=str(tmp_path))
    with Engine(resolve_source("opt-125m", "_DUMMY_"), Policy(gpu_batch_size=c["batch"]), cfg) as eng:
        assert eng.generate(prompts, c["gen_len"]).tokens == upstream_dense["tokens"]


def test_offloaded_placements_give_the_same_tokens(upstream_dense):
    """Half the weights on disk (upstream's disk copy threads), the KV cache split GPU/CPU (its
    mixed-device attention, with `.cuda()` hops)."""
    from flexgen_sparpr.upstream.run import generate_upstream
    c = upstream_dense["config"]
    for percent in ((0, 50, 50, 50, 100, 0),):  # weights CPU/disk, cache GPU/CPU
        r = generate_upstream(batch=c["batch"], prompt_len=c["prompt_len"], gen_len=c["gen_len"],
                              percent=percent, weights="engine", warmup=False)
        assert r["tokens"] == upstream_dense["tokens"], percent
