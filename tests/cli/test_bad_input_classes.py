"""One test per class of bad input that once slipped through: a batch job that could destroy its
input, contradictory flags accepted in silence, a wrong value reaching the maths, the API raising
the wrong thing, messages that did not name the problem, and library noise or leftovers.
Each ends in one line naming the input (exit 2 / ConfigError), with the user's files intact."""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from flexgen_sparpr import LLM, ConfigError
from flexgen_sparpr.cli import outputs
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import resolve
from tests.cli.bad_inputs import _with_tokenizer

REPO = Path(__file__).resolve().parents[2]
RUN = ["--gen-len", "2", "--prompt-len", "8", "--gpu-batch-size", "1", "--no-log", "--verbose", "0", "--warmup", "false"]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error: " in err and "Traceback" not in err, err
    return err


def _code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


# --- lost data ---------------------------------------------------------------------------------
INPUT = b'{"id": "a", "prompt_ids": [5, 6]}\n{"id": "b", "prompt_ids": [7]}\n{"id": "c", "prompt_ids": [8, 9]}'


def _batch(model, inp, out, off, *extra) -> list[str]:
    return ["batch", "--model", str(model), "--input", str(inp), "--output", str(out), "--gen-len", "2",
            "--gpu-batch-size", "2", "--offload-dir", str(off), "--verbose", "0", *extra]


@pytest.mark.parametrize("how", ["same-path", "symlink", "hard-link", "dot-path"])
def test_batch_refuses_its_input_as_output_and_writes_nothing(tiny_opt_dir, tmp_path, capsys, how):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(INPUT)  # the last line lacks its newline: once cut off as "partly written"
    out = {"same-path": inp, "symlink": tmp_path / "link.jsonl", "hard-link": tmp_path / "hard.jsonl",
           "dot-path": tmp_path / "." / "in.jsonl"}[how]
    if how == "symlink":
        out.symlink_to(inp)
    elif how == "hard-link":
        os.link(inp, out)
    assert main(_batch(tiny_opt_dir, inp, out, tmp_path / "off")) == 2
    assert "is the same file as --input" in _err(capsys)
    assert inp.read_bytes() == INPUT


@pytest.mark.parametrize("content", [
    INPUT,  # another job's input
    b'{"id": "a", "prompt_ids": [1]}',  # one line, no newline
    b'{"id": "a", "token_ids": [1], "text": null, "finish_reason": "length"}\n{"id": "b", "prompt": "x"}',
    b'{"id": "a", "token_ids": [1], "text": null, "finish_reason": "length", "extra": 1}\n',
    b"notes I keep\n",
], ids=["an-input", "one-input-line", "ours-then-foreign-tail", "extra-key", "text"])
def test_batch_never_truncates_or_appends_to_a_file_not_its_own(tiny_opt_dir, tmp_path, capsys, content):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(INPUT + b"\n")
    out.write_bytes(content)
    assert main(_batch(tiny_opt_dir, inp, out, tmp_path / "off")) == 2
    assert "is not an output line of a batch job (the file is left as it is)" in _err(capsys)
    assert out.read_bytes() == content


def test_batch_refuses_an_output_that_is_not_a_regular_file(tiny_opt_dir, tmp_path, capsys):
    inp, fifo = tmp_path / "in.jsonl", tmp_path / "fifo"
    inp.write_bytes(INPUT + b"\n")
    os.mkfifo(fifo)  # reading it back would block
    assert main(_batch(tiny_opt_dir, inp, fifo, tmp_path / "off")) == 2
    assert f"--output {fifo} is not a regular file" in _err(capsys)


def test_batch_cuts_a_partial_line_only_from_its_own_output(tiny_opt_dir, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(INPUT + b"\n")
    out.write_bytes(b'{"id": "b", "token_ids": [4, 4], "text": null, "finish_reason": "length"}\n{"id": "c", "tok')
    assert main(_batch(tiny_opt_dir, inp, out, tmp_path / "off")) == 0
    assert "removed a partly written last line" in capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["a", "b", "c"] and rows[0]["token_ids"] == [4, 4]


def test_a_failed_batch_leaves_no_output_it_created(tiny_opt_dir, tmp_path, capsys, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "new" / "sub" / "out.jsonl"
    inp.write_bytes(INPUT + b"\n")

    def fail(*a, **k):
        raise ConfigError("generation failed")
    monkeypatch.setattr(LLM, "generate", fail)
    assert main(_batch(tiny_opt_dir, inp, out, tmp_path / "off")) == 2
    assert _err(capsys) == "error: generation failed"
    assert not (tmp_path / "new").exists()


# --- contradictions --------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--attn-sparsity", "0.5", "--keep-ratio", "0.2"], "--attn-sparsity 0.5 and --keep-ratio 0.2 both set"),
    (["--prompt", "hi", "--prompt-file", "p.txt"], "--prompt and --prompt-file both give the prompt"),
    (["--prompt", "hi", "--prompt-ids-file", "ids.json"], "--prompt and --prompt-ids-file both give the prompt"),
    (["--prompt-file", "p.txt", "--prompt-ids-file", "ids.json"], "--prompt-file and --prompt-ids-file"),
    (["--keep-ratio", "0.5"], "--keep-ratio is a knob of flexgen-topk, h2o, quest, sparpr, streaming-llm; "
                              "--kv-policy dense ignores it"),
    (["--kv-policy", "quest", "--min-keep", "0.2"], "--min-keep is a knob of sparpr; --kv-policy quest ignores it"),
    (["--kv-policy", "sparpr", "--dkv-rank", "8"], "--dkv-rank is a knob of dkv; --kv-policy sparpr ignores it"),
    (["--temperature", "0.7"], "--temperature 0.7 does nothing without --do-sample"),
    (["--top-p", "0.9"], "--top-p 0.9 does nothing without --do-sample"),
])
def test_contradictory_or_ignored_flags_are_refused_naming_both(tiny_llama_dir, tmp_path, capsys, argv, words):
    assert _code(["run", "--model", str(tiny_llama_dir), *RUN, *argv, "--offload-dir", str(tmp_path)]) == 2
    assert words in _err(capsys)


def test_a_knob_read_through_the_cold_codec_is_not_refused():
    _, _, engine = resolve({"kv_policy": "sparpr", "cold_codec": "dkv", "dkv_rank": 8})
    assert engine.cold_codec.rank == 8


@pytest.mark.parametrize("config", sorted((REPO / "configs/policies").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_config_file_may_hold_other_policies_knobs(config):
    """A --config file sets several policies' knobs (the one chosen reads its own): not refused."""
    resolve({"config": str(config)})
    resolve({"config": str(config), "kv_policy": "dense"})


# --- a wrong value reaching the maths ----------------------------------------------------------
@pytest.mark.parametrize("changes, words", [
    ({"rms_norm_eps": "abc"}, "rms_norm_eps='abc' is not supported (expected a finite number > 0)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta='abc'"),
    ({"eos_token_id": []}, "eos_token_id=[] is not supported"),
    ({"eos_token_id": 999}, "eos_token_id=999 is not supported (outside the vocabulary [0, 300))"),
    ({"num_attention_heads": 5, "head_dim": None}, "num_attention_heads=5 is not supported (it must divide hidden_size 64)"),
    ({"num_attention_heads": 8}, "num_attention_heads 8 x head_dim 16 must equal hidden_size 64"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 is not supported (it must divide num_attention_heads 4)"),
    ({"head_dim": 8}, "num_attention_heads 4 x head_dim 8 must equal hidden_size 64"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    ({"vocab_size": 1 << 40}, "vocab_size=1099511627776"),
    ({"hidden_size": None}, "hidden_size=None"),
], ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("path", ["real", "_DUMMY_"])
def test_a_config_json_value_is_refused_naming_file_and_key(tiny_llama_dir, tmp_path, capsys, changes, words, path):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "config.json").read_text()) | changes
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "model.safetensors").write_bytes(b"")  # were it read, a different error would say so
    argv = ["run", "--model", str(model), *RUN, "--offload-dir", str(tmp_path / "off")]
    assert _code(argv + (["--path", "_DUMMY_"] if path == "_DUMMY_" else [])) == 2
    err = _err(capsys)
    assert err.startswith(f"error: {model / 'config.json'}: ") and words in err, err


@pytest.mark.parametrize("key, value, words", [
    ("cpu_memory_GiB", [1, 2], "cpu_memory_GiB must be a finite number >= 0 (got [1, 2])"),
    ("matmul_latency_s", [1, 2], "matmul_latency_s must map dtype names"),
    ("disk_read_GBps", float("inf"), "disk_read_GBps must be a finite number >= 0 (got inf)"),
    ("flops_TFLOPS", {"float32": float("nan")}, "flops_TFLOPS.float32 must be a finite number >= 0 (got nan)"),
    ("name", {"a": 1}, "name must be a text"),
    ("compute_memory_GiB", 1e308, "compute_memory_GiB must be a finite number >= 0 (got 1e+308)"),
])
def test_a_hardware_value_is_refused_naming_file_and_key(tiny_llama_dir, tmp_path, capsys, key, value, words):
    data = yaml.safe_load((REPO / "configs/hardware/cpu-only.yaml").read_text())
    data["hardware"][key] = value
    hw = tmp_path / "hw.yaml"
    hw.write_text(yaml.safe_dump(data))
    assert _code(["run", "--model", str(tiny_llama_dir), *RUN, "--hardware", str(hw)]) == 2
    err = _err(capsys)
    assert f"hardware file {hw}: " in err and words in err, err


@pytest.mark.parametrize("argv, words", [
    (["--do-sample", "--temperature", "1e-45"], "--temperature must be a finite number >= 0.0001"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999 is too large"),
    (["--seed", "9223372036854775808"], "--seed 9223372036854775808 is too large"),
    (["--gen-len", "1e3"], "invalid int value"),
    (["--gpu-mem", "inf"], "--gpu-mem must be a finite number (got inf)"),
    (["--io-threads", "100000"], "--io-threads must be in [1, 256]"),
    (["--kv-policy", "sparpr", "--gamma", "inf"], "--gamma must be a finite number (got inf)"),
    (["--stop", "99999999999999999999999"], "--stop takes a token id"),
    (["--model", ""], "--model is empty"),
    (["--log-file", " "], "--log-file is empty"),
    (["--offload-dir", ""], "--offload-dir is empty"),
])
def test_a_numeric_or_empty_flag_is_refused_naming_it(tiny_llama_dir, tmp_path, capsys, argv, words):
    assert _code(["run", "--model", str(tiny_llama_dir), *RUN, "--offload-dir", str(tmp_path), *argv]) == 2
    assert words in _err(capsys)


def test_a_null_yaml_value_leaves_the_default(tmp_path):
    (tmp_path / "c.yaml").write_text("engine:\n  block_size:\npolicy:\n  attn_sparsity:\n")
    _, policy, engine = resolve({"config": str(tmp_path / "c.yaml")})
    assert engine.block_size == 16 and policy.attn_sparsity == 1.0


# --- the Python API -----------------------------------------------------------------------------
def test_llm_without_a_model_is_refused_not_opt_6_7b():
    for model in (None, "", 5, ["opt-125m"]):
        with pytest.raises(ConfigError, match="LLM\\(\\) model must be a model name or a path"):
            LLM(model)


def test_api_errors_name_the_argument(tiny_llama_dir, tmp_path):
    with LLM(str(tiny_llama_dir), gpu_batch_size=1, offload_dir=str(tmp_path)) as llm:
        for kv, words in [("sparpr", "kv_policies must be a non-empty dict"), ({}, "kv_policies must be"),
                          ({"s": "sparpr"}, "kv_policies must be"),
                          ({"s": {"kv_policy": "nope"}}, "kv_policies['s']: unknown --kv-policy 'nope'"),
                          ({"s": {"kv_policy": "sparpr", "keep_ratio": "x"}}, "kv_policies['s']: --keep-ratio must be"),
                          ({"s": {"kv_policy": "quest", "min_keep": 0.2}}, "kv_policies['s']: --min-keep is a knob")]:
            with pytest.raises(ConfigError) as e:
                llm.compare([[5, 6]], kv, max_new_tokens=2)
            assert words in str(e.value), str(e.value)
        for call, words in [(dict(max_new_tokens=None), "max_new_tokens must be in [1, 2147483647] (got None)"),
                            (dict(max_new_tokens=10 ** 9), "prompt + max_new_tokens"),
                            (dict(temperature=float("nan")), "temperature must be"),
                            (dict(seed=1 << 64), "seed must be in [0, 2^63 - 1]"),
                            (dict(stop=[2]), "stop takes a token id, 'eos' or None"),
                            (dict(do_sample="yes"), "do_sample must be true or false"),
                            (dict(progress="no"), "progress must be True, False or None"),
                            (dict(prompts="hello"), "prompt 0: this model has no tokenizer")]:
            with pytest.raises(ConfigError) as e:
                llm.generate(**{"prompts": [[5, 6]], **call})
            assert words in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="--offload-dir must be a string"):
        LLM(str(tiny_llama_dir), offload_dir=object())


# --- messages that name the problem ----------------------------------------------------------
def test_prepare_on_a_cut_gguf_says_damaged_and_names_the_file(tmp_path, capsys):
    from tests.weights.test_gguf import _write_tiny_gguf
    whole, cut = tmp_path / "whole.gguf", tmp_path / "cut.gguf"
    _write_tiny_gguf(whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert main(["prepare", "--gguf", str(cut), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {cut}: damaged GGUF file") and "\n" not in err, err
    assert not (tmp_path / "cache").exists()
    assert main(["run", "--model", str(cut), *RUN]) == 2
    assert _err(capsys).startswith(f"error: {cut}: damaged GGUF file")


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs a Linux /proc")
def test_an_offload_dir_under_proc_is_named_a_virtual_file_system(tiny_llama_dir, capsys):
    argv = ["run", "--model", str(tiny_llama_dir), *RUN, "--percent", "100", "0", "0", "0", "100", "0",
            "--offload-dir", "/proc/flexgen-nowhere"]
    assert main(argv) == 2
    assert "/proc is on a virtual file system with no disk behind it" in _err(capsys)


# --- noise and leftovers ------------------------------------------------------------------------
def test_a_tokenizer_warning_is_not_printed_beside_the_engines_line(tiny_llama_dir, tmp_path, capsys):
    model = _with_tokenizer(Path(tiny_llama_dir), tmp_path / "tok")
    cfg = json.loads((model / "tokenizer_config.json").read_text()) | {"model_max_length": 16}
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    argv = ["run", "--model", str(model), *RUN, "--prompt", " ".join(["w1"] * 600), "--offload-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "exceed" in _err(capsys)  # one line: no "Token indices sequence length is longer than ..."


def test_a_log_that_cannot_be_written_is_not_left_empty(tmp_path, monkeypatch):
    log = tmp_path / "run.log"
    real_open = open

    class Full:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            return self

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device", str(log))

        def __exit__(self, *exc):
            self.f.close()
    monkeypatch.setattr(outputs, "open", Full, raising=False)
    with pytest.raises(ConfigError, match="cannot append to the log file"):
        outputs.deliver({}, None, log, "summary")
    assert not log.exists()
    log.write_text("an earlier run's lines\n")
    with pytest.raises(ConfigError):
        outputs.deliver({}, None, log, "summary")
    assert log.read_text() == "an earlier run's lines\n"  # a log it did not create is kept


def test_a_newline_in_a_name_the_user_gave_stays_inside_one_line(tiny_llama_dir):
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny_llama_dir), hardware="\n0")
    assert str(e.value) == "hardware file not found: \\n0"


def test_compare_carries_the_llms_knobs_only_to_policies_that_read_them(tiny_llama_dir, tmp_path):
    with LLM(str(tiny_llama_dir), gpu_batch_size=1, offload_dir=str(tmp_path), kv_policy="quest",
             keep_ratio=0.5) as llm:
        runs = llm.compare([[5, 6, 7]], {"dense": {"kv_policy": "dense"}, "h2o": {"kv_policy": "h2o"}},
                           max_new_tokens=2)
    assert list(runs) == ["quest", "dense", "h2o"] and all(len(o[0].token_ids) == 2 for o, _ in runs.values())
