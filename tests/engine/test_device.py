"""One normalized compute device: `cuda` is `cuda:<index>` and `cpu:0` is `cpu` everywhere, so
the engine's "already on the compute device?" tests hold for tensors that report the indexed
form (a resident weight is not counted as a copy; the gather ring is reused)."""
from __future__ import annotations

import pytest
import torch

from flexgen_sparpr.engine.config import ConfigError, EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.engine.recovery import GatherRing
from flexgen_sparpr.storage.tiers import Devices, normalize_device, resolve_device
from flexgen_sparpr.weights.resolve import resolve_source


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answering as on a one-GPU machine whose current device is 0 (nothing is
    allocated on it: only device names are resolved)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cuda_is_normalized_to_its_index(fake_cuda):
    cuda0 = torch.device("cuda", 0)
    assert torch.device("cuda") != cuda0  # why it matters: an unindexed device never equals a tensor's
    assert normalize_device("cuda") == normalize_device(torch.device("cuda")) == cuda0
    assert EngineConfig(device="cuda").torch_device() == cuda0
    assert EngineConfig(device="auto").torch_device() == cuda0
    assert Devices(torch.device("cuda")).compute == cuda0
    with pytest.raises(ConfigError, match="1 CUDA devices"):
        EngineConfig(device="cuda:1").torch_device()


def test_cpu_is_normalized_without_an_index():
    assert torch.zeros(1, device="cpu:0").device == torch.device("cpu") != torch.device("cpu:0")
    assert normalize_device("cpu:0") == torch.device("cpu")
    assert EngineConfig(device="cpu:0").torch_device() == torch.device("cpu")
    assert Devices(torch.device("cpu:0")).compute == torch.device("cpu")
    for bad in ("tpu", "meta", "cuda:x"):
        with pytest.raises(ValueError, match="--device"):
            resolve_device(bad)


def test_an_indexed_device_name_moves_no_resident_bytes(tiny_llama_dir, tmp_path):
    """Weights and cache all on the compute tier: nothing crosses a link, whatever spelling of
    the device was asked for (before normalization, `cpu:0` counted every weight each step)."""
    src = resolve_source(str(tiny_llama_dir), "")
    cfg = EngineConfig(device="cpu:0", block_size=4, offload_dir=str(tmp_path))
    with Engine(src, Policy(gpu_batch_size=2), cfg) as eng:
        assert eng.devices.compute == torch.device("cpu")
        eng.generate([[5, 6, 7], [8, 9, 10, 11]], 4)
        assert eng.devices.counters.snapshot() == {}


def test_gather_ring_reuses_its_buffers_on_the_compute_device():
    ring, dev = GatherRing(), Devices(torch.device("cpu:0")).compute
    first = [ring.take((2, 8), torch.float32, dev).data_ptr() for _ in range(2)]
    again = [ring.take((2, 8), torch.float32, dev).data_ptr() for _ in range(2)]
    assert first == again and first[0] != first[1]
