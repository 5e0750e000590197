"""Both install routes: `pip` (pyproject.toml, PEP 517) and `python setup.py` build the same wheel
from the one set of metadata in pyproject.toml."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _wheel_facts(wheel: Path) -> tuple:
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if not n.endswith("RECORD"))
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = sorted(line for line in z.read(info).decode().splitlines()
                      if line.split(":")[0] in ("Name", "Version", "Requires-Dist", "Requires-Python"))
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    return names, meta, entry


def test_pip_and_setup_py_build_the_same_wheel(tmp_path):
    pytest.importorskip("setuptools", minversion="64", reason="builds without isolation need setuptools >= 64 "
                        "(pyproject.toml's build requirement) in this environment")
    src = tmp_path / "src"  # a copy: a build leaves build/ and *.egg-info beside the sources
    shutil.copytree(REPO / "flexgen_sparpr", src / "flexgen_sparpr", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / f, src / f)
    run = dict(cwd=src, capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "pip"), "."], **run)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "setup.py", "-q", "bdist_wheel", "-d", str(tmp_path / "setup")], **run)
    assert r.returncode == 0, r.stderr[-2000:]
    (pip_wheel,), (setup_wheel,) = (tmp_path / "pip").glob("*.whl"), (tmp_path / "setup").glob("*.whl")
    assert pip_wheel.name == setup_wheel.name == "flexgen_sparpr-0.1.0-py3-none-any.whl"
    names, meta, entry = _wheel_facts(pip_wheel)
    assert _wheel_facts(setup_wheel) == (names, meta, entry)
    assert "flexgen_sparpr/api/llm.py" in names and "Name: flexgen-sparpr" in meta
    assert "flexgen-sparpr = flexgen_sparpr.cli.main:main" in entry
    configs = REPO / "flexgen_sparpr" / "configs"  # policy and hardware files: package data, in the wheel
    shipped = {f"flexgen_sparpr/configs/{p.relative_to(configs).as_posix()}" for p in configs.rglob("*.yaml")}
    assert len(shipped) >= 10 and shipped <= set(names), sorted(shipped - set(names))


def test_the_shipped_configs_are_found_outside_a_checkout(tmp_path, monkeypatch):
    """configs/ is package data (flexgen_sparpr/configs; the checkout's configs/ links to it): a
    documented `--config configs/...` or `--hardware configs/...` resolves from any folder, as from a
    wheel install, and the wheel carries every file."""
    from flexgen_sparpr.config.options import load_yaml
    from flexgen_sparpr.runtime.hardware import load_hardware
    from flexgen_sparpr.utils.paths import SHIPPED_CONFIGS, config_file
    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = sorted(p.relative_to(SHIPPED_CONFIGS) for p in SHIPPED_CONFIGS.rglob("*.yaml"))
    assert len(shipped) >= 10 and (REPO / "configs").resolve() == SHIPPED_CONFIGS
    for rel in shipped:
        assert config_file(Path("configs") / rel) == SHIPPED_CONFIGS / rel
    assert load_hardware("configs/hardware/cpu-only.yaml").name
    assert load_yaml("configs/policies/opt-6.7b-cpu-only.yaml")
    assert config_file("configs/nothing.yaml") == Path("configs/nothing.yaml")  # missing: its own error names it
    import tomllib
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "configs/*/*.yaml" in data["flexgen_sparpr"]
