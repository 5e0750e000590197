"""The command line: FlexGen's flags, summary lines, log file and errors; our JSON output."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.cli.report import flexgen_log_name, project_decode_latency, size_label
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.models.spec import opt_spec
from flexgen_sparpr.weights.resolve import resolve_source

TINY = ["--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "16", "--gen-len", "4",
        "--gpu-batch-size", "2", "--warmup", "false"]


def _opts(*argv):
    return resolve(build_parser().parse_args(list(argv)))


def test_flexgen_defaults():
    run, pol, eng = _opts()
    assert (run.model, run.path, run.prompt_len, run.gen_len) == ("facebook/opt-6.7b", "~/opt_weights", 512, 32)
    assert (pol.gpu_batch_size, pol.num_gpu_batches, pol.overlap, pol.sep_layer, pol.pin_weight) == (4, 1, True, True, True)
    assert pol.weight_percents == (100, 0, 0) and pol.cache_percents == (100, 0, 0)
    assert (pol.attn_sparsity, pol.compress_weight, pol.compress_cache, pol.cpu_cache_compute) == (1.0, False, False, False)
    assert (run.log_file, run.verbose, eng.offload_dir) == ("auto", 2, "~/flexgen_offload_dir")


def test_flexgen_boolean_flags_accept_upstream_spellings():
    _, pol, _ = _opts("--sep-layer", "false", "--overlap", "False", "--pin-weight", "0")
    assert (pol.sep_layer, pol.overlap, pol.pin_weight) == (False, False, False)
    _, pol, _ = _opts("--sep-layer", "--overlap")
    assert pol.sep_layer and pol.overlap


def test_config_file_sits_between_defaults_and_flags(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("policy:\n  gpu_batch_size: 8\n  percent: [50, 50, 0, 100, 100, 0]\n"
                   "engine:\n  block_size: 32\nrun:\n  gen_len: 7\n")
    run, pol, eng = _opts("--config", str(cfg), "--gen-len", "9")
    assert pol.gpu_batch_size == 8 and pol.w_gpu_percent == 50 and pol.cache_cpu_percent == 100
    assert eng.block_size == 32 and run.gen_len == 9


def test_log_name_matches_upstream():
    run, pol, _ = _opts("--percent", "0", "100", "0", "100", "100", "0", "--compress-weight")
    assert flexgen_log_name(run, pol, opt_spec("opt-6.7b")) == "fo-6.7b-gbs4-ngbs1-prompt512-gen32-percent-0-100-0-100-100-0-gpu-cache-compw.log"


def test_projection_keeps_two_warmup_steps():
    times = [5.0, 2.0, 1.5, 1.0, 1.0]  # prefill, then 4 decode steps
    assert project_decode_latency(times, 11) == pytest.approx(2.0 + 1.5 + 1.0 * 8)


@pytest.mark.parametrize("argv, fragment", [
    (["--percent", "1", "2"], "six numbers"),
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "facebook/opt-30b", "--path", "/nonexistent"], "_DUMMY_"),
    (["--gpu-batch-size", "0"], "in [1, "),
    (["--percent", "100", "0", "100", "0", "50", "50"], "activations"),
    (["--config", "/nonexistent.yaml"], "not found"),
    (["--model", "opt-125m", "--path", "_DUMMY_", "--prompt-ids-file", "/nonexistent.json"], "--prompt-ids-file"),
    (["--kv-policy", "nope", "--model", "opt-125m", "--path", "_DUMMY_"], "unknown --kv-policy"),
    (["--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "3000", "--gen-len", "8",
      "--max-seq-len", "2048"], "position"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(["run", *argv, "--no-log"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err


def test_run_writes_flexgen_log_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.json"
    argv = ["run", *TINY, "--percent", "100", "0", "0", "0", "100", "0", "--block-size", "4",
            "--offload-dir", str(tmp_path / "off"),
            "--output-json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for line in ("model size:", "peak gpu mem:", "prefill latency:", "decode latency:", "total latency:"):
        assert line in text
    log = tmp_path / "fo-125m-gbs2-ngbs1-prompt16-gen4-percent-100-0-0-0-100-0-gpu-cache.log"
    assert log.read_text().count("total throughput:") == 1
    data = json.loads(out.read_text())
    assert len(data["output_ids"]) == 2 and all(len(t) == 4 for t in data["output_ids"])
    assert data["bytes_moved"]["disk->cpu"] > 0 and data["peak_memory"]["host_rss_peak_bytes"] > 0
    assert set(data["timings"]) >= {"prefill_s", "decode_s", "total_s", "per_token_s"}
    conf = data["resolved"]  # the engine's settings as resolved (api/resolved.py), as every results file records
    assert conf["block_size"] == 4 and conf["placement"]["kv"] == [0.0, 0.0, 100.0] and conf["kv_policy"]["name"]
    assert not (tmp_path / "off").exists()  # the disk tier leaves nothing behind


def test_prompt_ids_file_and_stop(tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[5, 6, 7], [8, 9]]))
    out = tmp_path / "o.json"
    assert main(["run", *TINY, "--prompt-ids-file", str(ids), "--no-log", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["prompt_ids"] == [[5, 6, 7], [8, 9]] and data["prompt_len"] == 3


def test_flex_opt_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flexgen_sparpr.flex_opt", *TINY, "--no-log", "--verbose", "1"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode throughput:" in r.stdout


def test_help_mentions_every_upstream_flag():
    text = build_parser().format_help()
    for flag in ("--model", "--path", "--offload-dir", "--prompt-len", "--gen-len", "--cut-gen-len",
                 "--debug-mode", "--gpu-batch-size", "--num-gpu-batches", "--percent", "--sep-layer",
                 "--pin-weight", "--cpu-cache-compute", "--attn-sparsity", "--compress-weight",
                 "--compress-cache", "--log-file", "--no-log", "--verbose", "--overlap"):
        assert flag in text


def test_attn_sparsity_maps_onto_flexgen_topk():
    _, pol, eng = _opts("--attn-sparsity", "0.25")
    assert eng.kv_policy.name == "flexgen-topk" and eng.kv_policy.keep_ratio == 0.25
    assert pol.attn_sparsity == 1.0  # not applied twice
    with pytest.raises(Exception, match="cannot be combined"):
        _opts("--attn-sparsity", "0.25", "--kv-policy", "quest")


@pytest.mark.parametrize("cmd, argv, fragment", [
    ("run", ["--checkpoints", "never"], "invalid choice"),
    ("run", ["--no-such-flag"], "unrecognized arguments"),
    ("profile", ["--bogus"], "unrecognized arguments"),
])
def test_a_bad_flag_is_one_line_not_the_usage(capsys, cmd, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main([cmd, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and fragment in err and f"flexgen-sparpr {cmd}: error:" in err


def test_a_run_from_python_without_a_command_line(tiny_llama_dir, tmp_path):
    """resolve takes a dict of flag values; set_up -> generate -> report is the CLI's run, the
    same tokens and bytes, with no argparse."""
    from flexgen_sparpr.cli.run import generate, report, run, set_up
    values = {"model": str(tiny_llama_dir), "path": "", "prompt_len": 20, "gen_len": 4, "gpu_batch_size": 2,
              "kv_policy": "quest", "keep_ratio": 0.5, "min_keep_tokens": 0, "block_size": 4, "percent": [100, 0, 0, 0, 100, 0],
              "offload_dir": str(tmp_path / "off"), "warmup": False, "verbose": 0, "no_log": True}
    opts, pol, eng = resolve(values)
    assert eng.kv_policy.name == "quest" and eng.kv_policy.keep_ratio == 0.5
    setup = set_up(opts, pol, eng)
    out = report(setup, generate(setup))
    argv = [f"--{k.replace('_', '-')}" for k in ("no_log",)] + [
        x for k, v in values.items() if k != "no_log" for x in (f"--{k.replace('_', '-')}",
                                                                *map(str, v if isinstance(v, list) else [v]))]
    cli = run(argv)
    assert out["output_ids"] == cli["output_ids"] and out["bytes_moved"] == cli["bytes_moved"]
    assert out["engine"]["kv_policy"] == "quest" and out["engine"]["policy_args"]["keep_ratio"] == 0.5
    with pytest.raises(ConfigError, match="unknown options: keep"):
        resolve({"keep": 0.5})


def test_a_local_model_folder_keeps_its_run(tmp_path, monkeypatch, tiny_llama_dir):
    """The log name comes from the model's size, never from its path (a path once made the
    name a missing folder, and the run was lost after generating everything)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o.json"
    argv = ["run", "--model", str(Path(tiny_llama_dir).resolve()), "--prompt-len", "8", "--gen-len", "3",
            "--gpu-batch-size", "1", "--warmup", "false", "--verbose", "0", "--output-json", str(out)]
    assert main(argv) == 0
    size = size_label(resolve_source(str(tiny_llama_dir), "").spec)
    assert (tmp_path / f"fo-{size}-gbs1-ngbs1-prompt8-gen3-percent-100-0-100-0-100-0-gpu-cache.log").is_file()
    assert len(json.loads(out.read_text())["output_ids"][0]) == 3


def test_log_name_uses_the_size_and_the_placement_run():
    import dataclasses
    run, pol, _ = _opts()
    spec = opt_spec("opt-6.7b")
    assert size_label(dataclasses.replace(spec, name="/models/my-opt")) == "6.66b"  # from the count, not the path
    assert size_label(dataclasses.replace(spec, name="model-q4.gguf")) == "6.66b"
    assert size_label(opt_spec("opt-125m")) == "125m"
    chosen = dataclasses.replace(pol, w_gpu_percent=40, w_cpu_percent=45, cache_gpu_percent=5,
                                 cache_cpu_percent=75, act_gpu_percent=0, act_cpu_percent=100)
    assert "-percent-40-45-5-75-0-100-" in flexgen_log_name(run, chosen, spec)  # --policy auto's choice


def test_warm_up_only_for_flexgens_benchmark_prompt_unless_asked():
    from flexgen_sparpr.cli.parser import build_parser
    from flexgen_sparpr.config.options import resolve

    def warmup(*argv):
        return resolve(build_parser().parse_args(["--model", "opt-125m", "--path", "_DUMMY_", *argv]))[0].warmup
    assert warmup() is True  # FlexGen's benchmark, as upstream
    assert warmup("--prompt", "Hi") is False  # a user's prompt: one generation, no warm-up
    assert warmup("--prompt", "Hi", "--warmup") is True
    assert warmup("--warmup", "false") is False
