"""The compute tier's memory on CUDA (storage/device_memory.py, engine/memory.py), with torch.cuda
and NVML answered by stand-ins: the --gpu-mem cap leaves room for the CUDA context, NVML is read
per process when it sees this process (else device-wide, labelled so), and the peak a card must
hold is reserved + context."""
from __future__ import annotations

import os
import sys
import time
import types
from types import SimpleNamespace

import pytest
import torch

from flexgen_sparpr.engine.memory import PeakMemory
from flexgen_sparpr.storage import device_memory
from flexgen_sparpr.storage.device_memory import GiB, NvmlReader, apply_cap, context_bytes

CUDA0 = torch.device("cuda", 0)


class FakeNvml(types.ModuleType):
    """pynvml answering for one device: this process's bytes (listed or not) and the device's."""

    def __init__(self, mine: int | None, device_used: int):
        super().__init__("pynvml")
        self.mine, self.device_used = mine, device_used

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return "handle"

    nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByUUID

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        other = SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=7 * GiB)
        return [other] + ([SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.mine)] if self.mine else [])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.device_used)


@pytest.fixture
def fake_gpu(monkeypatch):
    """An 80 GiB device with 2 GiB used by this process outside torch (context) + 1 GiB reserved,
    and other processes' 5 GiB; records the memory fraction set."""
    state = {"fraction": None, "reserved": 1 * GiB, "peak_reserved": 3 * GiB, "peak_alloc": 2 * GiB}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: state["peak_reserved"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: state["peak_alloc"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (72 * GiB, 80 * GiB))  # 8 GiB used in all
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        total_memory=80 * GiB, uuid="0000"))
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: state.update(fraction=fraction))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(mine=3 * GiB, device_used=8 * GiB))
    return state


def test_nvml_reads_this_process_when_it_can_see_it(fake_gpu):
    r = NvmlReader(CUDA0)
    assert (r.scope, r.used()) == ("process", 3 * GiB)
    assert context_bytes(CUDA0) == 2 * GiB  # NVML's 3 GiB for this process less torch's 1 GiB reserved


def test_without_this_process_in_nvml_the_reading_is_device_wide(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(mine=None, device_used=8 * GiB))
    r = NvmlReader(CUDA0)
    assert (r.scope, r.used()) == ("device", 8 * GiB)
    assert context_bytes(CUDA0) == 7 * GiB  # device used (other processes too) less reserved


def test_without_nvml_torch_alone_answers(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    r = NvmlReader(CUDA0)
    assert (r.scope, r.used()) == (None, None)
    assert context_bytes(CUDA0) == 7 * GiB  # mem_get_info: 8 GiB used less 1 GiB reserved


def test_cap_leaves_the_context_out_of_the_allocators_share(fake_gpu):
    limit = apply_cap(CUDA0, 8)
    assert limit == 6 * GiB  # an 8 GiB card whose context holds 2 GiB
    assert fake_gpu["fraction"] == pytest.approx(6 / 80)
    with pytest.raises(ValueError, match="more than"):
        apply_cap(CUDA0, 100)
    with pytest.raises(ValueError, match="context"):
        apply_cap(CUDA0, 1.5)


def test_peak_is_reserved_plus_context_with_the_sampled_nvml_peak(fake_gpu, monkeypatch):
    nv = FakeNvml(mine=3 * GiB, device_used=8 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    with PeakMemory(CUDA0, interval=0.001) as mem:
        nv.mine = 9 * GiB  # a short burst the sampler must catch
        time.sleep(0.05)
        nv.mine = 3 * GiB
    rep = mem.report()
    assert rep["gpu_peak_reserved_bytes"] == 3 * GiB and rep["gpu_peak_allocated_bytes"] == 2 * GiB
    assert rep["gpu_context_bytes"] == 2 * GiB and rep["gpu_peak_bytes"] == 5 * GiB
    assert rep["gpu_peak_nvml_bytes"] == 9 * GiB and rep["gpu_nvml_scope"] == "process"
    assert rep["host_rss_peak_bytes"] > 0


def test_cpu_peak_has_no_gpu_figures():
    with PeakMemory(torch.device("cpu")) as mem:
        pass
    rep = mem.report()
    assert rep["gpu_peak_bytes"] == 0 and rep["gpu_nvml_scope"] is None and rep["host_rss_peak_bytes"] > 0


def test_handle_falls_back_to_the_index(fake_gpu):
    nv = FakeNvml(mine=1, device_used=1)
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: (_ for _ in ()).throw(RuntimeError("no uuid"))
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"index {i}"
    assert device_memory._handle(nv, CUDA0) == "index 0"
