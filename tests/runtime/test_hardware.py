"""Hardware files (runtime/hardware.py): YAML round trip, units, validation; CostModel.from_hardware."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from flexgen_sparpr.engine.config import ConfigError
from flexgen_sparpr.runtime.costs import CostModel
from flexgen_sparpr.runtime.hardware import GiB, Hardware, load_hardware, save_hardware

SHIPPED = sorted((Path(__file__).parents[2] / "configs" / "hardware").glob("*.yaml"))


def gpu_box(**kw) -> Hardware:
    base = dict(name="box", compute="cuda", compute_memory=8 * GiB, cpu_memory=16 * GiB, disk_free=100 * GiB,
                h2d_bw=12e9, d2h_bw=11e9, h2d_pageable_bw=6e9, d2h_pageable_bw=5e9, disk_read_bw=2e9,
                disk_write_bw=1e9, flops={"float16": 20e12, "float32": 8e12}, cpu_flops={"float32": 5e11},
                source="test", notes="why", matmul_latency_s={"float16": 1e-5}, compute_memory_bw=400e9)
    return Hardware(**(base | kw))


def test_round_trip_keeps_every_field(tmp_path):
    hw = gpu_box()
    save_hardware(hw, tmp_path / "hw.yaml")
    assert load_hardware(tmp_path / "hw.yaml") == hw


def test_file_is_in_human_units_under_a_hardware_section(tmp_path):
    save_hardware(gpu_box(), tmp_path / "hw.yaml")
    data = yaml.safe_load((tmp_path / "hw.yaml").read_text())["hardware"]
    assert data["compute_memory_GiB"] == 8 and data["h2d_GBps"] == 12 and data["flops_TFLOPS"]["float16"] == 20


def test_cpu_box_writes_links_as_not_applicable(tmp_path):
    hw = gpu_box(compute="cpu", h2d_bw=0.0, d2h_bw=0.0, h2d_pageable_bw=0.0, d2h_pageable_bw=0.0)
    save_hardware(hw, tmp_path / "hw.yaml")
    text = (tmp_path / "hw.yaml").read_text()
    assert "not applicable" in text and yaml.safe_load(text)["hardware"]["h2d_GBps"] is None
    back = load_hardware(tmp_path / "hw.yaml")
    assert back == hw and not back.is_cuda


def test_pageable_links_default_to_pinned(tmp_path):
    save_hardware(gpu_box(), tmp_path / "hw.yaml")
    data = yaml.safe_load((tmp_path / "hw.yaml").read_text())
    del data["hardware"]["h2d_pageable_GBps"]
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(data))
    assert load_hardware(tmp_path / "hw.yaml").h2d_pageable_bw == 12e9


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.pop("disk_read_GBps"), "missing hardware keys: disk_read_GBps"),
    (lambda d: d.update(compute="tpu"), "compute must be cuda or cpu"),
    (lambda d: d.update(h2d_GBps=None), "missing hardware keys: h2d_GBps"),
    (lambda d: d.update(cpu_memory_GiB=-1), "cpu_memory_GiB must be a finite number >= 0 \\(got -1\\)"),
    (lambda d: d.update(flops_TFLOPS={}), "flops_TFLOPS must map dtype names"),
    (lambda d: d.update(disk_write_GBps="fast"), "disk_write_GBps must be a finite number >= 0 \\(got 'fast'\\)"),
    (lambda d: d.update(disk_read_GBps=[1]), "disk_read_GBps must be a finite number >= 0 \\(got \\[1\\]\\)"),
    (lambda d: d.update(cpu_memory_GiB=float("inf")), "cpu_memory_GiB must be a finite number >= 0 \\(got inf\\)"),
    (lambda d: d.update(cpu_memory_GiB=1e308), "cpu_memory_GiB must be a finite number"),
    (lambda d: d.update(matmul_latency_s=[1, 2]), "matmul_latency_s must map dtype names"),
    (lambda d: d.update(flops_TFLOPS={"float16": float("nan")}), "flops_TFLOPS.float16 must be a finite number"),
    (lambda d: d.update(name=["a"]), "name must be a text"),
    (lambda d: d.update(pcie_lanes=8), "unknown hardware keys: pcie_lanes"),
    (lambda d: d.update(flops_TFLOPS={"fp16": 20}), "unknown dtypes"),
])
def test_bad_values_raise_one_line(tmp_path, edit, fragment):
    save_hardware(gpu_box(), tmp_path / "hw.yaml")
    data = yaml.safe_load((tmp_path / "hw.yaml").read_text())
    edit(data["hardware"])
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=fragment) as e:
        load_hardware(tmp_path / "hw.yaml")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, fragment", [
    (None, "not found"), ("hardware: [1, 2\n", "not valid YAML"), ("policy: {}\n", "top-level `hardware:`"),
    ("hardware: 3\n", "must be a mapping"),
])
def test_bad_files_raise_one_line(tmp_path, text, fragment):
    path = tmp_path / "hw.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_hardware(path)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_files_load_and_say_where_numbers_come_from(path):
    hw = load_hardware(path)
    assert hw.name == path.stem
    assert hw.source.startswith(("measured", "public spec sheets"))
    assert {"float16", "bfloat16", "float32"} <= set(hw.flops)
    assert hw.is_cuda == (hw.h2d_bw > 0)


def test_shipped_set_covers_the_issue():
    assert {p.stem for p in SHIPPED} >= {"rtx3070ti-laptop-8gb", "t4-flexgen", "rtx4090-desktop", "a100-80gb",
                                          "cpu-only"}


def test_cost_model_from_hardware():
    hw = gpu_box()
    cm = CostModel.from_hardware(hw)
    assert (cm.disk_read_Bps, cm.h2d_Bps, cm.matmul_flops) == (2e9, 12e9, hw.flops)
    cpu = CostModel.from_hardware(dataclasses.replace(hw, compute="cpu", h2d_bw=0.0, d2h_bw=0.0))
    assert cpu.h2d_Bps is None  # no link to cross on a CPU-only machine
