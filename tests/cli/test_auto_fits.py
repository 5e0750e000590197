"""`--policy auto` through the command line's own steps (config/options.py apply_auto_policy, then
config/preflight.py's check, as `run` makes them): the plan passes the check, and where nothing
fits it says so in one line (tests/runtime/test_plan_passes_check.py: the arithmetic alone)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flexgen_sparpr.config import preflight
from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config.options import apply_auto_policy, resolve
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.runtime import capacity
from flexgen_sparpr.runtime.capacity import Capacity
from flexgen_sparpr.runtime.hardware import GiB

HW_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
MODELS = ("opt-125m", "opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b")
CONTEXTS = ((64, 8), (512, 32), (1920, 128))


def _resolved(*argv):
    return resolve(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("free_gib", (8, 22.7))
def test_the_cli_plan_passes_the_cli_check(model, free_gib, monkeypatch, tmp_path):
    """The dtype, block size and prompt length the check counts are the ones planned with."""
    box = Capacity(False, free_gib * GiB, free_gib * GiB, 70 * GiB, str(tmp_path))
    monkeypatch.setattr(capacity, "live_capacity", lambda device, offload_dir: box)
    # the check's own name for it too: else it measured this machine, and failed whenever less than
    # 22.7 GiB was free (another job running beside the suite)
    monkeypatch.setattr(preflight, "live_capacity", lambda device, offload_dir: box)
    monkeypatch.delenv(capacity.SKIP_ENV, raising=False)
    spec = opt_spec(model)
    for p, g in CONTEXTS:
        for block in ("16", "256"):
            opts, pol, eng = _resolved("--model", f"facebook/{model}", "--path", "_DUMMY_", "--policy", "auto",
                                       "--gpu-batch-size", "4", "--device", "cpu", "--prompt-len", str(p),
                                       "--gen-len", str(g), "--block-size", block, "--offload-dir", str(tmp_path),
                                       "--hardware", str(HW_DIR / "cpu-only.yaml"))
            try:
                pol, eng, plan, hw, cap = apply_auto_policy(opts, pol, eng, spec)
            except ConfigError as e:  # nothing fits: said in one line
                assert "--policy auto: no placement" in str(e) and "\n" not in str(e)
                continue
            assert cap is box and hw.compute_memory <= box.compute_memory
            # the same check with a fresh measurement of the same free memory, as before_loading makes it
            need = preflight.check_capacity(opts, pol, eng, spec, p)
            assert need == pytest.approx(plan.memory)


def test_nothing_fits_is_one_line_before_loading(monkeypatch, tmp_path, capsys):
    from flexgen_sparpr.cli.main import main
    box = Capacity(False, 8 * GiB, 8 * GiB, 20 * GiB, str(tmp_path))
    monkeypatch.setattr(capacity, "live_capacity", lambda device, offload_dir: box)
    code = main(["run", "--model", "facebook/opt-30b", "--path", "_DUMMY_", "--policy", "auto", "--device", "cpu",
                 "--hardware", str(HW_DIR / "cpu-only.yaml"), "--offload-dir", str(tmp_path), "--no-log"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --policy auto: no placement of opt-30b") and "7.2 GiB of memory and 19.0" in err[0]
