"""--gpu-mem: the device cap from a flag, the YAML engine section or a hardware file, refused on
the CPU, and planned for by --policy auto."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexgen_sparpr.config import options
from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import apply_auto_policy, resolve
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime import capacity
from flexgen_sparpr.runtime.hardware import GiB, load_hardware
from flexgen_sparpr.runtime.placement import DEVICE_MARGIN

HW = Path(__file__).parents[2] / "configs" / "hardware"


def _opts(*argv):
    return resolve(build_parser().parse_args(list(argv)))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Device names resolve as on a one-GPU machine (nothing is allocated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_flag_and_yaml(tmp_path):
    assert _opts("--gpu-mem", "8")[2].gpu_mem == 8
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  gpu_mem: 7.5\n")
    assert _opts("--config", str(cfg))[2].gpu_mem == 7.5
    assert _opts("--config", str(cfg), "--gpu-mem", "6")[2].gpu_mem == 6
    assert _opts()[2].gpu_mem is None


@pytest.mark.parametrize("argv, fragment", [
    (["--gpu-mem", "8", "--device", "cpu"], "caps a CUDA device"),
    (["--gpu-mem", "0"], "must be > 0"),
])
def test_bad_cap_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(["run", "--model", "opt-125m", "--path", "_DUMMY_", "--no-log", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err


def test_hardware_file_caps_a_cuda_run_only(fake_cuda, monkeypatch):
    laptop = str(HW / "rtx3070ti-laptop-8gb.yaml")
    assert load_hardware(laptop).gpu_mem == 8 * GiB
    assert _opts("--hardware", laptop)[2].gpu_mem == 8
    assert _opts("--hardware", laptop, "--gpu-mem", "6")[2].gpu_mem == 6  # the flag wins
    assert _opts("--hardware", laptop, "--device", "cpu")[2].gpu_mem is None  # nothing to cap on the CPU


def test_policy_auto_plans_for_the_capped_card(fake_cuda, monkeypatch):
    """On an A100's file OPT-6.7B fits whole; capped at 8 GiB (6 GiB for torch after a 2 GiB
    context) the plan offloads and stays inside the cap."""
    monkeypatch.setattr(options, "cap_bytes", lambda device, gib: int(gib * GiB) - 2 * GiB)
    # an 80 GiB card with a roomy host free now (what the check before loading measures)
    monkeypatch.setattr(capacity, "live_capacity",
                        lambda device, offload_dir: capacity.Capacity(True, 80 * GiB, 500 * GiB, 2000 * GiB, "/x"))
    spec = opt_spec("opt-6.7b")
    a100 = str(HW / "a100-80gb.yaml")
    free = apply_auto_policy(*_opts("--hardware", a100, "--policy", "auto", "--gpu-mem", "80"), spec)
    capped = apply_auto_policy(*_opts("--hardware", a100, "--policy", "auto", "--gpu-mem", "8"), spec)
    assert free[2].percent == (100, 0, 100, 0, 100, 0)
    assert capped[2].percent[0] < 100 and capped[3].compute_memory == 6 * GiB
    assert capped[2].memory["compute"] <= 6 * GiB * (1 - DEVICE_MARGIN)
