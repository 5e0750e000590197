"""Property tests of the bad-input promise: values drawn from wide strategies (wrong types, NaN,
±inf, huge, empty, negative) for the flags, the --config YAML keys, a config.json's fields, a
hardware file's values and the Python API's arguments end either in success or in one line
(exit 2 / a ConfigError) that names the input. Everything is checked in-process, before any
weight is read: no model loads per example (the API's tests share one tiny model)."""
from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from flexgen_sparpr.api.llm import LLM
from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.errors import CapacityError, ConfigError
from flexgen_sparpr.kv import policies
from flexgen_sparpr.models.hf_config import spec_from_hf_config
from flexgen_sparpr.runtime.hardware import Hardware, hardware_from_dict

# examples per property: bounded for CI; FLEXGEN_SPARPR_PROPERTY_EXAMPLES=1000 searches deeper
N = int(os.environ.get("FLEXGEN_SPARPR_PROPERTY_EXAMPLES", "40"))
FAST = settings(max_examples=N, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
REPO = Path(__file__).resolve().parents[2]

# --- wide values ---------------------------------------------------------------------------
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e308, -1.0, 5e-324]
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70), st.sampled_from([0, -1, 1, 2, 3, (1 << 63), (1 << 31)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(SPECIAL_FLOATS),
    st.text(max_size=12), st.sampled_from(["", " ", "nan", "inf", "-1", "1e400", "abc", "0x10", "eos", "cuda:x"]))
WIDE = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=6), SCALARS, max_size=3))
# a flag's text on the command line
FLAG_TEXT = st.one_of(
    st.integers(min_value=-(1 << 70), max_value=1 << 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(SPECIAL_FLOATS).map(str),
    st.sampled_from(["", " ", "nan", "-inf", "1e400", "abc", "0x10", "1_0", "99999999999999999999", "-0"]),
    st.text(max_size=10).filter(lambda t: "\0" not in t))


def _numeric_flags() -> list[argparse.Action]:
    return [a for a in build_parser()._actions if a.option_strings and a.type in (int, float)]


NUMERIC = _numeric_flags()
DESTS = sorted(a.dest for a in build_parser()._actions if a.option_strings and a.dest != "help")


def _one_line_naming(msg: str, *names: str) -> None:
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg
    assert any(n in msg for n in names), (names, msg)


def _owner_args(dest: str) -> list[str]:
    """A knob's flag is tried under a policy that reads it (else it is refused as ignored)."""
    flag = policies.flags().get(dest)
    return ["--kv-policy", sorted(flag.policies)[0]] if flag else []


@FAST
@given(action=st.sampled_from(NUMERIC), text=FLAG_TEXT)
def test_a_numeric_flag_is_accepted_or_refused_in_one_line_naming_it(action, text):
    flag = action.option_strings[0]
    argv = [f"{flag}={text}"] * (6 if action.nargs == "+" else 1)
    argv = [flag, *[text] * 6] if action.nargs == "+" and not text.startswith("-") else argv
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            resolve(build_parser().parse_args(argv + _owner_args(action.dest)))
        except SystemExit as e:  # argparse's one line
            assert e.code == 2
            _one_line_naming(err.getvalue(), flag, action.dest)
            return
        except ConfigError as e:
            _one_line_naming(str(e), flag, action.dest)
            return
    # accepted: the value is a finite number of its type
    value = getattr(build_parser().parse_args(argv), action.dest)
    for v in value if isinstance(value, list) else [value]:
        assert isinstance(v, action.type) and math.isfinite(v)


YAML_DIR = Path(tempfile.mkdtemp(prefix="flexgen-sparpr-yaml-"))
atexit.register(shutil.rmtree, YAML_DIR, ignore_errors=True)  # hypothesis draws files here: gone at exit


@FAST
@given(section=st.sampled_from(["run", "policy", "engine"]), key=st.sampled_from([*DESTS, "policy_args"]),
       value=st.one_of(WIDE, st.dictionaries(st.sampled_from(["keep_ratio", "min_keep", "gamma", "costs", "x"]),
                                             SCALARS, max_size=2)))
def test_a_config_value_is_accepted_or_refused_in_one_line_naming_its_key(section, key, value):
    if key in ("config", "hardware"):
        return  # files of their own (the hardware test below)
    text = yaml.safe_dump({section: {key: value}}, allow_unicode=True)
    path = YAML_DIR / "c.yaml"
    path.write_text(text)
    try:
        resolve({"config": str(path), **({"kv_policy": sorted(policies.flags()[key].policies)[0]}
                                        if key in policies.flags() else {})})
    except ConfigError as e:
        _one_line_naming(str(e), key, "--" + key.replace("_", "-"))


# --- config.json ---------------------------------------------------------------------------
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
         "eos_token_id": 2, "hidden_act": "silu"}
OPT = {"model_type": "opt", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_dim": 128,
       "vocab_size": 300, "max_position_embeddings": 256, "word_embed_proj_dim": 64, "do_layer_norm_before": True,
       "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}
LLAMA_KEYS = [*LLAMA, "head_dim", "pad_token_id", "attention_bias", "mlp_bias", "rope_scaling", "rope_parameters",
              "partial_rotary_factor", "architectures", "sliding_window", "use_sliding_window", "layer_types"]
OPT_KEYS = [*OPT, "enable_bias", "layer_norm_elementwise_affine", "_remove_final_layer_norm", "tie_word_embeddings"]


def _check_spec(spec) -> None:
    """What the engine's maths needs of a spec it accepts."""
    for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "ffn", "vocab", "max_pos"):
        v = getattr(spec, f)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, (f, v)
    assert spec.num_heads * spec.head_dim == spec.hidden and spec.num_heads % spec.num_kv_heads == 0
    assert math.isfinite(spec.norm_eps) and spec.norm_eps > 0 and math.isfinite(spec.rope_theta) and spec.rope_theta > 0
    for t in (spec.bos_id, spec.pad_id, spec.eos_id):
        assert t is None or (isinstance(t, int) and 0 <= t < spec.vocab)
    assert all(isinstance(getattr(spec, b), bool) for b in ("tie_embeddings", "pre_norm", "qkv_bias", "o_bias",
                                                             "mlp_bias"))


@settings(FAST, max_examples=2 * N)
@given(family=st.sampled_from(["llama", "qwen2", "mistral", "opt"]), data=st.data())
def test_a_config_json_field_is_accepted_or_refused_naming_file_and_key(family, data):
    base = dict(OPT if family == "opt" else LLAMA, model_type=family)
    key = data.draw(st.sampled_from(OPT_KEYS if family == "opt" else LLAMA_KEYS))
    value = data.draw(WIDE)
    cfg = json.loads(json.dumps(dict(base, **{key: value})))  # as a config.json holds it
    try:
        spec = spec_from_hf_config(cfg, "m", where="/models/m/config.json")
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("/models/m/config.json:"), msg
        assert key in msg or key == "architectures" or (key == "model_type" and "model_type" in msg) or (
            key in ("head_dim", "hidden_size", "num_attention_heads", "num_key_value_heads") and "head" in msg) or (
            key == "vocab_size" and "vocabulary" in msg), (key, value, msg)
        return
    _check_spec(spec)


# --- hardware files --------------------------------------------------------------------------
HW = yaml.safe_load((REPO / "configs/hardware/cpu-only.yaml").read_text())["hardware"]
HW_KEYS = sorted({*HW, "h2d_GBps", "d2h_GBps", "gpu_mem_GiB", "interconnect_GBps", "compute_memory_GBps",
                  "matmul_latency_s"})


@FAST
@given(key=st.sampled_from(HW_KEYS), value=WIDE)
def test_a_hardware_value_is_accepted_or_refused_naming_its_key(key, value):
    section = json.loads(json.dumps(dict(HW, **{key: value})))
    try:
        hw = hardware_from_dict(section, where="hardware file hw.yaml")
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("hardware file hw.yaml: "), msg
        assert key in msg or "missing hardware keys" in msg, (key, value, msg)
        return
    assert isinstance(hw, Hardware)
    for f in ("compute_memory", "cpu_memory", "disk_free", "disk_read_bw", "disk_write_bw", "h2d_bw", "gpu_mem"):
        assert math.isfinite(getattr(hw, f)) and getattr(hw, f) >= 0
    assert all(math.isfinite(v) and v > 0 for v in [*hw.flops.values(), *hw.cpu_flops.values()])


# --- the Python API ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir, tmp_path_factory):
    with LLM(str(tiny_llama_dir), gpu_batch_size=2, offload_dir=str(tmp_path_factory.mktemp("off"))) as m:
        yield m


CALL_ARGS = {"max_new_tokens": 2, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "stop": "eos", "seed": None,
             "progress": False}
PROMPTS = st.one_of(WIDE, st.lists(st.lists(st.one_of(st.integers(-5, 400), SCALARS), max_size=3), max_size=3))


def test_api_generate_arguments_are_checked_or_named(llm):
    @FAST
    @given(key=st.sampled_from([*CALL_ARGS, "prompts"]), value=st.one_of(WIDE, PROMPTS))
    def check(key, value):
        args = {**CALL_ARGS, "prompts": [[5, 6]], key: value}
        try:
            llm.stream(**args)  # every argument checked at the call; nothing runs until iterated
        except ConfigError as e:
            _one_line_naming(str(e), "prompt" if key == "prompts" else key)
    check()


def test_api_compare_arguments_are_checked_or_named(llm):
    kv = st.one_of(WIDE, st.dictionaries(st.text(max_size=5), st.one_of(WIDE, st.dictionaries(
        st.sampled_from(["kv_policy", "keep_ratio", "min_keep", "block_size", "gamma", "nope"]),
        st.one_of(SCALARS, st.sampled_from(sorted(policies.POLICIES))), max_size=2)), max_size=2))

    @settings(FAST, max_examples=max(N * 3 // 4, 1))
    @given(kv_policies=kv)
    def check(kv_policies):
        try:
            llm.compare([[5, 6]], kv_policies, max_new_tokens=2)
        except ConfigError as e:
            _one_line_naming(str(e), "kv_policies")
    check()


def test_api_constructor_arguments_are_checked_or_named(tiny_llama_dir, tmp_path, monkeypatch):
    """Every check LLM() makes before loading; the load itself is left out (a valid but huge
    batch would allocate it), so what is accepted is only recorded."""
    accepted = []
    monkeypatch.setattr(LLM, "_open", lambda self, *a, **k: accepted.append(a))
    keys = ["model", "path", "percent", "gpu_batch_size", "num_gpu_batches", "kv_policy", "device", "dtype",
            "block_size", "keep_ratio", "seed", "max_seq_len", "io_threads", "gpu_mem", "chat", "hardware"]

    @settings(FAST, max_examples=max(N * 3 // 4, 1))
    @given(key=st.sampled_from(keys), value=WIDE)
    def check(key, value):
        args = {"model": str(tiny_llama_dir), "offload_dir": str(tmp_path / "off"), "gpu_batch_size": 1, key: value}
        if key == "model" and value is not None and not isinstance(value, str):
            args["model"] = value
        try:
            LLM(**args)
        except ConfigError as e:
            # a valid value this machine cannot hold is refused with the numbers, not the value's name
            fits = isinstance(e, CapacityError) and "does not fit" in str(e)
            _one_line_naming(str(e), key, "--" + key.replace("_", "-"), *(["does not fit"] if fits else []))
    check()
    assert accepted  # the defaults and many drawn values pass
