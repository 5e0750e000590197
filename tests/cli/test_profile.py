"""`flexgen-sparpr profile`, `--hardware`, `--policy auto` and the shipped config files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import apply_auto_policy, resolve
from flexgen_sparpr.engine.config import ConfigError
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.runtime.hardware import load_hardware

CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*/*.yaml"))
LAPTOP = str(CONFIGS / "hardware" / "rtx3070ti-laptop-8gb.yaml")


def _opts(*argv):
    return resolve(build_parser().parse_args(list(argv)))


def test_profile_quick_writes_a_loadable_cpu_file(tmp_path, capsys):
    out = tmp_path / "hw" / "this.yaml"
    assert main(["profile", "--quick", "--device", "cpu", "--out", str(out), "--offload-dir", str(tmp_path)]) == 0
    hw = load_hardware(out)
    assert hw.compute == "cpu" and hw.h2d_bw == 0.0 and "not applicable" in out.read_text()
    assert hw.disk_read_bw > 0 and hw.disk_write_bw > 0 and hw.flops["float32"] > 0
    assert hw.source.startswith("measured") and hw.cpu_memory > 0 and hw.disk_free > 0
    assert "wrote" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["this.yaml"]  # no temp file left behind
    assert [p for p in tmp_path.iterdir() if p.is_file()] == []  # the disk test file is gone


@pytest.mark.parametrize("argv, fragment", [
    (["--device", "tpu"], "--device must be"),
    (["--offload-dir", __file__], "not a folder"),
    pytest.param(["--device", "cuda"], "no CUDA device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA, so --device cuda is not an error")),
])
def test_profile_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, fragment):
    assert main(["profile", "--quick", "--out", str(tmp_path / "x.yaml"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1
    assert not (tmp_path / "x.yaml").exists()


def test_run_with_a_bad_hardware_file_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "hw.yaml"
    bad.write_text("hardware:\n  name: x\n  compute: cuda\n")
    assert main(["run", "--model", "opt-125m", "--path", "_DUMMY_", "--hardware", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hardware file") and "missing hardware keys" in err and err.count("\n") == 1


def test_hardware_file_feeds_sparpr_costs():
    _, _, eng = _opts("--kv-policy", "sparpr", "--hardware", LAPTOP, "--percent", "100", "0", "0", "0", "100", "0")
    costs = eng.kv_policy.costs
    assert isinstance(costs, CostModel) and costs.h2d_Bps == 10e9 and costs.disk_read_Bps == 2.5e9
    assert eng.kv_policy.probe_dir is None  # nothing is probed


def test_config_hardware_section_is_read(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(Path(LAPTOP).read_text() + "engine:\n  kv_policy: sparpr\n")
    run, _, eng = _opts("--config", str(cfg))
    assert run.hardware.name == "rtx3070ti-laptop-8gb" and eng.kv_policy.costs.h2d_Bps == 10e9


@pytest.mark.parametrize("argv, config, fragment", [
    (["--policy", "auto", "--percent", "100", "0", "100", "0", "100", "0"], None, "drop --percent"),
    (["--policy", "auto"], "policy:\n  percent: [100, 0, 100, 0, 100, 0]\n", "drop --percent"),
    ([], "policy:\n  policy: manual\n", "policy.policy must be one of auto"),
])
def test_policy_auto_refuses_explicit_percents(tmp_path, argv, config, fragment):
    if config:
        (tmp_path / "c.yaml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "c.yaml")]
    with pytest.raises(ConfigError, match=fragment):
        _opts(*argv)


def test_policy_auto_replaces_placement_and_split():
    run, pol, eng = _opts("--policy", "auto", "--hardware", LAPTOP, "--kv-policy", "sparpr",
                          "--prompt-len", "1920", "--gen-len", "128")
    pol, eng, plan, hw, _ = apply_auto_policy(run, pol, eng, opt_spec("opt-6.7b"))
    assert pol.batch_size == 4 and (pol.gpu_batch_size, pol.num_gpu_batches) == (plan.gpu_batch_size,
                                                                                 plan.num_gpu_batches)
    assert (pol.w_gpu_percent, pol.w_cpu_percent, pol.cache_gpu_percent) == plan.percent[:3]
    assert pol.w_gpu_percent < 100 and hw.name == "rtx3070ti-laptop-8gb"
    assert eng.kv_policy.costs.h2d_Bps == 10e9


def test_policy_auto_without_a_file_uses_the_cached_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path / "cache"))
    run, pol, eng = _opts("--policy", "auto", "--device", "cpu", "--offload-dir", str(tmp_path / "off"),
                          "--prompt-len", "64", "--gen-len", "4")
    pol, eng, plan, hw, _ = apply_auto_policy(run, pol, eng, opt_spec("opt-125m"))
    assert hw.source.startswith("start-up probe") and hw.compute == "cpu" and "float32" in hw.flops
    assert list((tmp_path / "cache").glob("probe-*.json"))  # measured once, cached for the next run
    assert plan.percent == (100, 0, 100, 0, 100, 0)  # 250 MB of weights fit any host


def test_policy_auto_run_prints_and_records_the_plan(tmp_path, capsys, tiny_opt_dir):
    out = tmp_path / "o.json"
    argv = ["run", "--model", str(tiny_opt_dir), "--path", str(tiny_opt_dir), "--prompt-len", "16", "--gen-len", "3",
            "--warmup", "false", "--no-log", "--verbose", "1", "--policy", "auto",
            "--hardware", str(CONFIGS / "hardware" / "cpu-only.yaml"), "--output-json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "policy auto for cpu-only" in printed and "policy auto: predicted" in printed
    data = json.loads(out.read_text())
    assert data["auto_policy"]["percent"] == [data["policy"][k] for k in (
        "w_gpu_percent", "w_cpu_percent", "cache_gpu_percent", "cache_cpu_percent", "act_gpu_percent",
        "act_cpu_percent")]
    assert data["auto_policy"]["predicted_per_token_s"] > 0


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_config_loads_with_config(path):
    run, pol, eng = _opts("--config", str(path))
    if path.parent.name == "policies":
        assert run.model == "facebook/opt-6.7b" and pol.batch_size == 4 and eng.kv_policy.name == "sparpr"
        assert run.hardware is not None and path.stem.endswith(run.hardware.name)
