"""A newcomer's first commands: `run --prompt` with no model flag runs the prepared SmolLM2 (or
says in one line how to prepare it) and gives one answer that ends at the end token; `models`
lists every known name, what it needs and whether it is ready; one stop default everywhere."""
from __future__ import annotations

import json
import re

import pytest

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.engine.sampling import STOP_DEFAULT
from flexgen_sparpr.weights.resolve import KNOWN_NAMES


def test_models_lists_every_known_name_and_what_is_ready(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path))  # nothing prepared here
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in KNOWN_NAMES)
    assert "smollm2-135m  not prepared" in out and "flexgen-sparpr prepare" in out


def test_run_help_lists_every_known_model_name(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    listed = re.search(r"a known name \(([^)]*)\)", out).group(1)
    assert [n.strip() for n in listed.split(";")[0].split(",")] == list(KNOWN_NAMES)
    assert "flexgen-sparpr models" in out


def test_run_with_a_prompt_and_no_model_says_how_to_prepare(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXGEN_SPARPR_CACHE", str(tmp_path))
    assert main(["run", "--prompt", "Hi", "--no-log"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smollm2-135m is not prepared" in err[0] and "flexgen-sparpr prepare" in err[0]


def test_the_stop_default_is_the_end_token_for_a_users_prompt_only():
    def stop(*argv):
        return resolve(build_parser().parse_args(["--model", "opt-125m", "--path", "_DUMMY_", *argv]))[0].stop
    assert stop() is None  # FlexGen's benchmark prompt: --gen-len tokens, as upstream
    assert stop("--prompt", "Hi") == STOP_DEFAULT == "eos"
    assert stop("--prompt", "Hi", "--stop", "none") == "none"


@pytest.mark.slow
def test_run_hi_with_no_model_gives_one_answer_ending_at_the_end_token(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["run", "--prompt", "Hi", "--chat", "--gen-len", "64", "--no-log", "--offload-dir",
                 str(tmp_path / "off"), "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len(data["output_ids"]) == 1  # one prompt, one row: no copies
    ids = data["output_ids"][0]
    from flexgen_sparpr.weights.resolve import resolve_source
    assert ids[-1] == resolve_source("smollm2-135m", "").spec.eos_id and len(ids) < 64


def test_the_summary_counts_sizes_in_the_runs_dtype_and_the_log_names_the_real_prompt(tmp_path, capsys,
                                                                                     monkeypatch):
    from flexgen_sparpr.models.spec import opt_spec
    monkeypatch.chdir(tmp_path)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[5, 6, 7, 8, 9, 10, 11]]))  # 7 tokens, not --prompt-len's 16
    assert main(["run", "--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "16", "--gen-len", "3",
                 "--gpu-batch-size", "1", "--dtype", "float32", "--prompt-ids-file", str(ids),
                 "--offload-dir", str(tmp_path / "off"), "--verbose", "1"]) == 0
    out = capsys.readouterr().out
    import re
    got = float(re.search(r"model size: ([\d.]+) GB", out).group(1))
    fp16 = opt_spec("opt-125m").num_params() * 2 / (1 << 30)  # upstream's formula (it always runs float16)
    assert got == pytest.approx(2 * fp16, rel=0.02)  # float32: 4 bytes a parameter (a smaller position table)
    logs = list(tmp_path.glob("fo-*.log"))
    assert len(logs) == 1 and "-prompt7-" in logs[0].name, logs


@pytest.mark.parametrize("argv, model", [
    (["run", "--prompt", "Hi"], "smollm2-135m"),  # a newcomer's first command
    (["run"], "facebook/opt-6.7b"),  # FlexGen's benchmark prompt: FlexGen's default model
    (["run", "--prompt", "Hi", "--model", "opt-125m"], "opt-125m"),
    (["run", "--prompt", "Hi", "--path", "_DUMMY_"], "facebook/opt-6.7b"),  # --path names FlexGen's weights
    (["flex_opt", "--prompt", "Hi"], "facebook/opt-6.7b"),  # upstream's entry keeps upstream's default
])
def test_which_model_a_command_runs_when_none_is_named(argv, model, monkeypatch):
    import flexgen_sparpr.cli.run as run_mod
    from flexgen_sparpr import flex_opt
    seen = []

    def stop_here(args):  # the options resolved, before anything loads
        seen.append(real(args)[0].model)
        raise SystemExit(0)
    real = run_mod.resolve
    monkeypatch.setattr(run_mod, "resolve", stop_here)
    with pytest.raises(SystemExit):
        (flex_opt.main if argv[0] == "flex_opt" else main)(argv[1:] if argv[0] == "flex_opt" else argv)
    assert seen == [model]
