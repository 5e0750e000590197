"""The bad inputs of tests/cli/test_bad_input.py, and the broken files they point at.

A case is (id, argv, the words its one error line must hold); argv may name files as
{placeholders}: {llama}, {opt}, {tok} (a llama with a tokenizer), {in} (a folder of the case's
inputs), {off} (the offload folder), {file} (a plain file), broken checkpoints by name, and
{yaml} (the case's YAML text, written to a file). Options: log (keep the log file on),
env (variables set for the case), cmd (profile or prepare instead of run).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# --- the broken files ------------------------------------------------------------------------


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _edit_tensors(src: Path, dst: Path, fn) -> Path:
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    fn(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _cut(src: Path, dst: Path, keep) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep(len(data))])
    return dst


def _with_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of a tiny llama with a word-level tokenizer: words w0..w99, and `huge`, an id
    past the model's 300-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    shutil.copytree(src, dst)
    vocab = {f"w{i}": i for i in range(100)} | {"[UNK]": 100, "huge": 450}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "[UNK]"}))
    return dst


def _tiny_qwen2(dst: Path) -> Path:
    """A Qwen2 (q/k/v biases, no end token) whose every layer attends an 8-token window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=300, max_position_embeddings=256,
                      use_sliding_window=True, sliding_window=8, max_window_layers=0)
    Qwen2ForCausalLM(cfg).save_pretrained(dst)
    return dst


def make_files(root: Path, llama: Path, opt: Path) -> dict[str, str]:
    """Every file the cases name, made once under root; {placeholder: path}."""
    root.mkdir(parents=True, exist_ok=True)
    ll = lambda **kw: _edit_config(llama, root / kw.pop("_name"), **kw)  # noqa: E731
    f = {"llama": llama, "opt": opt, "tok": _with_tokenizer(llama, root / "tok"),
         "trunc": _cut(llama, root / "trunc", lambda n: n // 2),
         "headcut": _cut(llama, root / "headcut", lambda n: 20),
         "missing": _edit_tensors(llama, root / "missing", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
         "shape": _edit_tensors(llama, root / "shape", lambda sd: sd.update(
             {"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)})),
         "badjson": ll(_name="badjson"), "nokey": ll(_name="nokey", hidden_size=None),
         "gpt2": ll(_name="gpt2", model_type="gpt2"), "rope": ll(_name="rope", rope_scaling={"rope_type": "linear", "factor": 2.0}),
         "ropeparams": ll(_name="ropeparams", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
         "ropelayers": ll(_name="ropelayers", rope_parameters={
             "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
         "gelu": ll(_name="gelu", hidden_act="gelu"), "partial": ll(_name="partial", partial_rotary_factor=0.5),
         "strsize": ll(_name="strsize", hidden_size="64"),
         "qwen_window": _tiny_qwen2(root / "qwen_window"),
         "mistral": ll(_name="mistral", model_type="mistral", sliding_window=8),
         "noeos": ll(_name="noeos", eos_token_id=None),
         "optbias": _edit_config(opt, root / "optbias", enable_bias=False),
         "optgelu": _edit_config(opt, root / "optgelu", activation_function="gelu"),
         "optnorm": _edit_config(opt, root / "optnorm", layer_norm_elementwise_affine=False)}
    (f["badjson"] / "config.json").write_text('{"model_type": "llama", ')
    listcfg = _edit_config(llama, root / "listcfg")
    (listcfg / "config.json").write_text("[1, 2]")
    f["listcfg"] = listcfg
    empty = root / "empty"
    empty.mkdir()
    shutil.copy(llama / "config.json", empty / "config.json")
    f["empty"] = empty
    binjunk = root / "binjunk"
    binjunk.mkdir()
    shutil.copy(llama / "config.json", binjunk / "config.json")
    (binjunk / "pytorch_model.bin").write_bytes(b"\x80\x02junk" * 10)
    f["binjunk"] = binjunk
    (root / "junk.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    (root / "nomagic.gguf").write_bytes(b"NOPE" + bytes(64))
    (root / "empty.gguf").write_bytes(b"")
    f |= {"junk_gguf": root / "junk.gguf", "nomagic_gguf": root / "nomagic.gguf", "empty_gguf": root / "empty.gguf"}
    (root / "plain.txt").write_text("a plain file\n")
    (root / "binary.bin").write_bytes(bytes(range(128, 256)) * 8)
    f |= {"file": root / "plain.txt", "bin": root / "binary.bin"}
    return {k: str(v) for k, v in f.items()}


# --- the cases -------------------------------------------------------------------------------
CUDA = torch.cuda.is_available()
PCT_DISK = ["--percent", "100", "0", "0", "0", "100", "0"]  # the KV cache on the disk tier


def _ids(text: str) -> dict:
    return {"ids": text}


FLAGS = [
    ("gen-len-word", ["--gen-len", "abc"], "invalid int value"),
    ("prompt-len-float", ["--prompt-len", "1.5"], "invalid int value"),
    ("temperature-word", ["--temperature", "x"], "invalid float value"),
    ("percent-words", ["--percent", "a", "b", "c", "d", "e", "f"], "invalid int value"),
    ("percent-two", ["--percent", "1", "2"], "six numbers"),
    ("percent-seven", ["--percent", "100", "0", "100", "0", "100", "0", "100"], "six numbers"),
    ("dtype-choice", ["--dtype", "float8"], "invalid choice"),
    ("checkpoints-choice", ["--checkpoints", "never"], "invalid choice"),
    ("unknown-flag", ["--no-such-flag"], "unrecognized arguments"),
    ("missing-value", ["--gen-len"], "expected one argument"),
    ("bool-word", ["--sep-layer", "maybe"], "expected a boolean"),
    ("policy-choice", ["--policy", "manual"], "invalid choice"),
    ("cold-codec-choice", ["--cold-codec", "zip"], "invalid choice"),
    ("debug-mode-choice", ["--debug-mode", "x"], "invalid choice"),
    ("dkv-route-choice", ["--dkv-route", "x"], "invalid choice"),
    ("gen-len-0", ["--gen-len", "0"], "--gen-len"),
    ("prompt-len-0", ["--prompt-len", "0"], "--prompt-len"),
    ("prompt-len-neg", ["--prompt-len", "-5"], "--prompt-len"),
    ("gbs-0", ["--gpu-batch-size", "0"], "--gpu-batch-size must be in [1, 2147483647] (got 0)"),
    ("ngb-0", ["--num-gpu-batches", "0"], "--num-gpu-batches must be in [1, "),
    ("block-0", ["--block-size", "0"], "--block-size must be in"),
    ("block-huge", ["--block-size", "1000000000"], "--block-size must be in [1, 65536]"),
    ("io-threads-0", ["--io-threads", "0"], "--io-threads must be in [1, 256]"),
    ("seed-neg", ["--seed", "-1"], "--seed must be in [0, 2^63 - 1] (got -1)"),
    ("verbose-neg", ["--verbose", "-1"], "--verbose must be >= 0"),
    ("temperature-nan", ["--do-sample", "--temperature", "nan"], "--temperature must be a finite number"),
    ("temperature-0", ["--temperature", "0"], "--temperature"),
    ("temperature-inf", ["--temperature", "inf"], "--temperature"),
    ("temperature-neg", ["--temperature", "-1"], "--temperature"),
    ("top-p-0", ["--top-p", "0"], "--top-p must be in (0, 1]"),
    ("top-p-big", ["--top-p", "1.5"], "--top-p"),
    ("top-p-nan", ["--top-p", "nan"], "--top-p"),
    ("keep-0", ["--kv-policy", "quest", "--keep-ratio", "0"], "--keep-ratio must be in (0, 1]"),
    ("keep-big", ["--keep-ratio", "1.5"], "--keep-ratio"),
    ("keep-nan", ["--keep-ratio", "nan"], "--keep-ratio"),
    ("sparsity-0", ["--attn-sparsity", "0"], "--attn-sparsity"),
    ("sparsity-nan", ["--attn-sparsity", "nan"], "--attn-sparsity"),
    ("min-keep-0", ["--kv-policy", "sparpr", "--min-keep", "0"], "--min-keep"),
    ("min-keep-tokens-neg", ["--kv-policy", "h2o", "--min-keep-tokens", "-1"], "--min-keep-tokens must be >= 0 (got -1)"),
    ("gamma-2", ["--kv-policy", "sparpr", "--gamma", "2"], "--gamma"),
    ("min-keep-above-keep", ["--kv-policy", "sparpr", "--min-keep", "0.9", "--keep-ratio", "0.2"],
     "--min-keep 0.9 is above --keep-ratio 0.2"),
    ("device-tpu", ["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N (got 'tpu')"),
    ("device-cuda-x", ["--device", "cuda:x"], "--device"),
    ("stop-word", ["--stop", "abc"], "--stop takes a token id"),
    ("stop-neg", ["--stop", "-1"], "--stop"),
    ("stop-outside-vocab", ["--stop", "99999"], "--stop 99999 is outside"),
    ("max-seq-0", ["--max-seq-len", "0"], "--max-seq-len must be in [1, "),
    ("cut-gen-2", ["--cut-gen-len", "2"], "--cut-gen-len"),
    ("cut-gen-past", ["--cut-gen-len", "10"], "--cut-gen-len"),
    ("act-split", ["--percent", "100", "0", "100", "0", "50", "50"], "activations"),
    ("weights-over-100", ["--percent", "60", "60", "100", "0", "100", "0"], "--percent for w"),
    ("act-disk", ["--percent", "100", "0", "100", "0", "0", "0"], "activations"),
    ("percent-neg", ["--percent", "-1", "0", "100", "0", "100", "0"], "--percent for w"),
    ("kv-policy-unknown", ["--kv-policy", "nope"], "unknown --kv-policy 'nope'"),
    ("sparsity-with-quest", ["--attn-sparsity", "0.5", "--kv-policy", "quest"], "cannot be combined"),
    ("summary-not-divisor", ["--kv-policy", "sparpr", "--summary-tokens", "3"], "--summary-tokens"),
    ("summary-neg", ["--kv-policy", "sparpr", "--summary-tokens", "-1"], "--summary-tokens"),
    ("dkv-rank-0", ["--kv-policy", "dkv", "--dkv-rank", "0"], "--dkv-rank must be >= 1"),
    ("dkv-rank-above-block", ["--kv-policy", "dkv", "--dkv-rank", "300"], "--dkv-rank 300 is above the 256-token"),
    ("dkv-rank-above-width", ["--kv-policy", "dkv", "--dkv-rank", "100"], "--dkv-rank 100 is above"),
    ("dkv-res-above-block", ["--cold-codec", "dkv", "--dkv-residuals", "300"], "--dkv-residuals 300 is above"),
    ("dkv-block-0", ["--kv-policy", "dkv", "--dkv-block", "0"], "--dkv-block must be >= 1"),
    ("dkv-exact-neg", ["--kv-policy", "dkv", "--dkv-exact-routed", "-1"], "--dkv-exact-routed must be >= 0"),
    ("dkv-exact-home", ["--kv-policy", "dkv", "--dkv-exact-home", "gpu"], "invalid choice"),
    ("dkv-pick", ["--kv-policy", "dkv", "--dkv-residual-pick", "foo"], "--dkv-residual-pick"),
    ("dkv-block-disagree", ["--kv-policy", "dkv", "--block-size", "32", "--dkv-block", "64"], "disagree"),
    ("auto-with-percent", ["--policy", "auto", "--percent", "100", "0", "100", "0", "100", "0"], "drop --percent"),
    ("hardware-missing", ["--hardware", "{in}/none.yaml"], "hardware file not found"),
    ("two-codecs", ["--compress-cache", "--kv-policy", "dkv"], "one KV codec at a time"),
    ("model-unknown", ["--model", "no-such-model"], "unknown model 'no-such-model'"),
    ("model-no-weights", ["--model", "facebook/opt-30b", "--path", "{in}/nowhere"], "_DUMMY_"),
    ("smollm2-not-prepared", ["--model", "smollm2-135m", "--path", "{in}"], "not prepared", {"env": True}),
    ("gguf-missing", ["--model", "{in}/none.gguf"], "GGUF file not found"),
    ("model-dir-no-config", ["--model", "{in}"], "has no config.json"),
] + ([("device-cuda-absent", ["--device", "cuda"], "no CUDA device")] if not CUDA else [])

FILES = [
    ("prompt-file-missing", ["--prompt-file", "{in}/none.txt"], "--prompt-file: No such file"),
    ("prompt-file-binary", ["--prompt-file", "{bin}"], "is not UTF-8 text"),
    ("prompt-file-folder", ["--prompt-file", "{in}"], "--prompt-file: Is a directory"),
    ("ids-missing", ["--prompt-ids-file", "{in}/none.json"], "--prompt-ids-file"),
    ("ids-bad-json", ["--prompt-ids-file", "{ids}"], "not JSON", _ids("[1, 2")),
    ("ids-empty-list", ["--prompt-ids-file", "{ids}"], "must hold a JSON list", _ids("[]")),
    ("ids-count", ["--prompt-ids-file", "{ids}"], "2 prompts given but the batch is 1", _ids("[[1, 2], [3]]")),
    ("ids-outside-vocab", ["--prompt-ids-file", "{ids}"], "[0, 300)", _ids("[[1, 999]]")),
    ("ids-empty-prompt", ["--prompt-ids-file", "{ids}"], "non-empty", _ids("[[]]")),
    ("ids-object", ["--prompt-ids-file", "{ids}"], "must hold a JSON list", _ids('{"a": 1}')),
    ("ids-floats", ["--prompt-ids-file", "{ids}"], "token ids", _ids("[[1.5]]")),
    ("ids-binary", ["--prompt-ids-file", "{bin}"], "not JSON"),
    ("output-folder", ["--output-json", "{in}"], "is a folder"),
    ("output-under-file", ["--output-json", "{file}/out.json"], "cannot make its folder"),
    ("output-folder-made-only-at-the-end", ["--output-json", "{in}/../out/o.json", "--model", "no-such-model"],
     "unknown model"),
    ("output-in-proc", ["--output-json", "/proc/flexgen-nowhere/out.json"], "--output-json"),
    ("log-folder", ["--log-file", "{in}"], "--log-file", {"log": True}),
    ("log-under-file", ["--log-file", "{file}/x.log"], "--log-file", {"log": True}),
    ("offload-is-file", ["--offload-dir", "{file}", *PCT_DISK], "--offload-dir"),
    ("offload-under-file", ["--offload-dir", "{file}/sub", *PCT_DISK], "--offload-dir"),
    ("config-missing", ["--config", "{in}/none.yaml"], "--config file not found"),
    ("config-folder", ["--config", "{in}"], "--config file not found"),
    ("config-binary", ["--config", "{bin}"], "--config"),
]

PROMPTS = [
    ("prompt-without-tokenizer", ["--prompt", "hello"], "no tokenizer"),
    ("prompt-empty", ["--model", "{tok}", "--prompt", ""], "the prompt is empty"),
    ("chat-without-template", ["--model", "{tok}", "--chat", "--prompt", "w1 w2"], "no chat template"),
    ("prompt-token-past-vocab", ["--model", "{tok}", "--prompt", "w1 huge"], "outside the model's vocabulary"),
    ("prompt-past-table", ["--prompt-len", "500", "--gen-len", "20"], "512-position table"),
    ("ids-past-table", ["--prompt-ids-file", "{ids}", "--gen-len", "4"], "position table", _ids(json.dumps([[5] * 510]))),
    ("opt-dummy-past-table", ["--model", "opt-125m", "--path", "_DUMMY_", "--prompt-len", "3000",
                              "--max-seq-len", "2048"], "2048-position table"),
    ("mistral-past-window", ["--model", "{mistral}"], "8-token sliding attention window"),
    ("qwen2-past-window", ["--model", "{qwen_window}"], "sliding attention window"),
    ("stop-eos-without-eos", ["--model", "{noeos}", "--stop", "eos"], "names no end token"),
    ("real-model-max-seq", ["--max-seq-len", "1000"], "--max-seq-len sizes dummy weights only"),
]

WEIGHTS = [
    ("safetensors-cut", ["--model", "{trunc}"], "not a readable safetensors file"),
    ("safetensors-header-cut", ["--model", "{headcut}"], "not a readable safetensors file"),
    ("tensor-missing", ["--model", "{missing}"], "model.layers.1.mlp.up_proj.weight is missing"),
    ("tensor-shape", ["--model", "{shape}"], "model.layers.0.self_attn.k_proj.weight has shape [16, 64]"),
    ("config-not-json", ["--model", "{badjson}"], "config.json: not valid JSON"),
    ("config-list", ["--model", "{listcfg}"], "must hold a JSON object"),
    ("config-lacks-key", ["--model", "{nokey}"], "lacks 'hidden_size'"),
    ("config-wrong-type", ["--model", "{strsize}"], "hidden_size='64' is not supported (expected a positive integer)"),
    ("model-type-gpt2", ["--model", "{gpt2}"], "unsupported model_type 'gpt2'"),
    ("rope-scaling", ["--model", "{rope}"], "rope_scaling='linear'"),
    ("rope-parameters-yarn", ["--model", "{ropeparams}"], "rope_type='yarn'"),
    ("rope-per-layer-type", ["--model", "{ropelayers}"], "rope_parameters='per layer type'"),
    ("hidden-act", ["--model", "{gelu}"], "hidden_act='gelu'"),
    ("partial-rotary", ["--model", "{partial}"], "partial_rotary_factor=0.5"),
    ("no-weight-files", ["--model", "{empty}"], "no *.safetensors or pytorch_model*.bin"),
    ("bin-junk", ["--model", "{binjunk}"], "not a readable torch state dict"),
    ("opt-no-bias", ["--model", "{optbias}"], "enable_bias=False"),
    ("opt-gelu", ["--model", "{optgelu}"], "activation_function='gelu'"),
    ("opt-no-affine", ["--model", "{optnorm}"], "layer_norm_elementwise_affine=False"),
    ("gguf-junk", ["--model", "{junk_gguf}"], "junk.gguf"),
    ("gguf-no-magic", ["--model", "{nomagic_gguf}"], "nomagic.gguf"),
    ("gguf-empty", ["--model", "{empty_gguf}"], "empty.gguf"),
]

YAML = [
    ("yaml-gen-len-word", "run:\n  gen_len: lots\n", "run.gen_len must be an integer (got 'lots')"),
    ("yaml-gbs-float", "policy:\n  gpu_batch_size: 2.5\n", "policy.gpu_batch_size must be an integer (got 2.5)"),
    ("yaml-keep-word", "engine:\n  keep_ratio: high\n", "engine.keep_ratio must be a number (got 'high')"),
    ("yaml-percent-word", "policy:\n  percent: abc\n", "policy.percent must be a list (got 'abc')"),
    ("yaml-percent-item", "policy:\n  percent: [100, 0, 100, 0, 100, x]\n", "policy.percent must be an integer"),
    ("yaml-percent-float", "policy:\n  percent: [100.5, 0, 100, 0, 100, 0]\n", "must be an integer (got 100.5)"),
    ("yaml-flag-word", "run:\n  do_sample: sometimes\n", "run.do_sample must be true or false"),
    ("yaml-bool-word", "policy:\n  overlap: maybe\n", "policy.overlap must be true or false"),
    ("yaml-device", "engine:\n  device: tpu\n", "--device must be auto"),
    ("yaml-dtype", "engine:\n  dtype: float8\n", "engine.dtype must be one of"),
    ("yaml-list-for-string", "engine:\n  kv_policy: [a]\n", "engine.kv_policy must be a string"),
    ("yaml-bool-for-int", "run:\n  gen_len: true\n", "run.gen_len must be an integer (got True)"),
    ("yaml-nan", "run:\n  temperature: .nan\n", "--temperature"),
    ("yaml-gen-len-0", "run:\n  gen_len: 0\n", "--gen-len"),
    ("yaml-block-0", "engine:\n  block_size: 0\n", "--block-size"),
    ("yaml-unknown-key", "engine:\n  unknown_key: 1\n", "unknown engine keys: unknown_key"),
    ("yaml-unknown-section", "foo: 1\n", "expected top-level sections"),
    ("yaml-list-file", "- 1\n- 2\n", "expected top-level sections"),
    ("yaml-invalid", "run: [unclosed\n", "not valid YAML"),
    ("yaml-section-scalar", "run: 5\n", "section run: must be a mapping"),
    ("yaml-policy-args", "policy:\n  policy_args: 5\n", "policy_args must be a mapping"),
    ("yaml-io-threads", "engine:\n  io_threads: 0\n", "--io-threads"),
    ("yaml-max-seq", "run:\n  max_seq_len: -1\n", "--max-seq-len"),
    ("yaml-hardware-section", "hardware:\n  name: x\n", "missing hardware keys"),
    ("yaml-hardware-path", "engine:\n  hardware: none.yaml\n", "hardware file not found"),
    ("yaml-kv-policy-unknown", "engine:\n  kv_policy: nope\n", "unknown --kv-policy"),
    ("yaml-min-keep", "engine:\n  kv_policy: sparpr\n  min_keep: 0.9\n  keep_ratio: 0.2\n", "--min-keep 0.9"),
    ("yaml-stop-bool", "run:\n  stop: true\n", "run.stop must be a string"),
]

CAPACITY = [
    ("opt-175b-in-memory", ["--model", "opt-175b", "--path", "_DUMMY_", "--percent", "100", "0", "100", "0", "100", "0"],
     "does not fit"),
    ("kv-cache-too-big", ["--model", "opt-6.7b", "--path", "_DUMMY_", "--prompt-len", "4096", "--gen-len", "32",
                          "--gpu-batch-size", "256", "--max-seq-len", "5000"], "does not fit"),
]

COMMANDS = [
    ("profile-device", ["--device", "tpu"], "--device must be auto", {"cmd": "profile"}),
    ("profile-offload-file", ["--offload-dir", "{file}"], "--offload-dir is not a folder", {"cmd": "profile"}),
    ("profile-flag", ["--bogus"], "unrecognized arguments", {"cmd": "profile"}),
    ("prepare-no-wheel", ["--wheel", "{in}/none.whl", "--cache-dir", "{in}/cache"], "wheel not found", {"cmd": "prepare"}),
    ("prepare-junk-wheel", ["--wheel", "{file}", "--cache-dir", "{in}/cache"], "cannot read wheel", {"cmd": "prepare"}),
    ("unknown-command", [], "unknown command 'frobnicate'", {"cmd": "frobnicate"}),
]


def all_cases() -> list[tuple[str, list[str], str, dict]]:
    out = []
    for group in (FLAGS, FILES, PROMPTS, WEIGHTS, CAPACITY, COMMANDS):
        for case in group:
            cid, argv, words, *rest = case
            out.append((cid, argv, words, rest[0] if rest else {}))
    for cid, text, words in YAML:
        out.append((cid, ["--config", "{yaml}"], words, {"yaml": text}))
    return out
