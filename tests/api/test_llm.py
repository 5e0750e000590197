"""The Python API: the same greedy tokens as HF transformers (each prompt alone) and as the CLI,
whatever the batch split; streaming yields generate's tokens; bad arguments raise ConfigError with
the CLI's one-line messages; close(), garbage collection and exit leave no offload files."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexgen_sparpr import LLM, ConfigError
from flexgen_sparpr.cli.main import main
from tests.hf_reference import hf_generate

N_NEW = 6
REPO = Path(__file__).resolve().parents[2]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


RAGGED = [_prompt(n, 20 + i) for i, n in enumerate([9, 3, 17, 1, 12])]  # 5 prompts, 1 to 17 tokens
DISK = dict(percent=(100, 0, 50, 0, 100, 0), block_size=4)  # half the KV blocks on the disk tier


@pytest.fixture(scope="module")
def hf_alone(tiny_model_dir):
    """HF's greedy tokens for each prompt alone (no padding): what every batch split must give."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return [hf_generate(model, [p], N_NEW, pad=0)[0][0] for p in RAGGED]


def _llm(model_dir, tmp_path, **kw) -> LLM:
    return LLM(str(model_dir), offload_dir=str(tmp_path / "off"), **kw)


@pytest.mark.parametrize("split", [dict(gpu_batch_size=2), dict(gpu_batch_size=5),
                                   dict(gpu_batch_size=1, num_gpu_batches=3), dict(gpu_batch_size=8)],
                         ids=["2 (5 = 2+2+1)", "5 (one batch)", "1x3 (5 = 3+2)", "8 (more than the prompts)"])
def test_generate_equals_hf_whatever_the_batch_split(tiny_model_dir, tmp_path, hf_alone, split):
    with _llm(tiny_model_dir, tmp_path, **split, **DISK) as llm:
        outs = llm.generate(RAGGED, N_NEW, stop=None)
        stats = llm.last_stats
    assert [o.index for o in outs] == list(range(len(RAGGED)))
    assert [o.prompt_token_ids for o in outs] == RAGGED
    assert [o.token_ids for o in outs] == hf_alone
    assert all(o.finish_reason == "length" and o.text is None for o in outs)  # the tiny models have no tokenizer
    size = split["gpu_batch_size"] * split.get("num_gpu_batches", 1)
    assert stats.num_batches == -(-len(RAGGED) // size) and stats.generated_tokens == len(RAGGED) * N_NEW
    assert stats.bytes_moved.get("cpu->disk", 0) > 0  # the KV cache did go to the disk tier


def test_generate_equals_the_cli(tiny_llama_dir, tmp_path):
    """One batch of ragged prompts: the API's tokens and bytes are the CLI's (run and --stream)."""
    prompts = RAGGED[:4]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(prompts))
    out = tmp_path / "o.json"
    argv = ["run", "--model", str(tiny_llama_dir), "--prompt-ids-file", str(ids), "--gen-len", str(N_NEW),
            "--gpu-batch-size", "4", "--percent", "100", "0", "50", "0", "100", "0", "--block-size", "4",
            "--offload-dir", str(tmp_path / "off"), "--warmup", "false", "--no-log", "--verbose", "0"]
    assert main([*argv, "--output-json", str(out)]) == 0
    cli = json.loads(out.read_text())
    with _llm(tiny_llama_dir, tmp_path, gpu_batch_size=4, **DISK) as llm:
        api = [o.token_ids for o in llm.generate(prompts, N_NEW, stop=None)]
        moved = llm.last_stats.bytes_moved
    assert api == cli["output_ids"] and moved == cli["bytes_moved"]
    assert main([*argv, "--stream", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["output_ids"] == api


def test_stream_yields_generates_tokens(tiny_opt_dir, tmp_path):
    """Every prompt's events, in step order, are its generate() tokens; each ends once, with the
    reason generate gives (a stop token some prompts meet, the length for the others)."""
    with _llm(tiny_opt_dir, tmp_path, gpu_batch_size=2) as llm:
        plain = llm.generate(RAGGED, N_NEW, stop=None)
        stop = plain[0].token_ids[2]
        outs = llm.generate(RAGGED, N_NEW, stop=stop)
        events = list(llm.stream(RAGGED, N_NEW, stop=stop))
        one = list(llm.stream(RAGGED[2], N_NEW, stop=None))
    first = plain[0].token_ids
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == first[:first.index(stop) + 1]
    for o in outs:
        mine = [e for e in events if e.index == o.index]
        assert [e.token_id for e in mine] == o.token_ids
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == o.finish_reason
    assert [e.token_id for e in one] == plain[2].token_ids and {e.index for e in one} == {0}


def test_stream_stops_early_and_the_llm_goes_on(tiny_opt_dir, tmp_path):
    with _llm(tiny_opt_dir, tmp_path, gpu_batch_size=2) as llm:
        it = llm.stream(RAGGED, N_NEW, stop=None)
        first = [next(it) for _ in range(3)]
        it.close()  # a consumer that breaks out
        again = llm.generate(RAGGED, N_NEW, stop=None)
    assert [e.token_id for e in first[:2]] == [again[i].token_ids[0] for i in (first[0].index, first[1].index)]


def test_compare_decodes_several_policies_from_one_prefill(tiny_llama_dir, tmp_path):
    """The own policy's answers are generate()'s; a sparse one reads fewer disk bytes."""
    prompts = [_prompt(40, 1), _prompt(33, 2)]
    with _llm(tiny_llama_dir, tmp_path, gpu_batch_size=2, **DISK) as llm:
        plain = llm.generate(prompts, N_NEW, stop=None)
        runs = llm.compare(prompts, {"quest@0.25": {"kv_policy": "quest", "keep_ratio": 0.25, "min_keep_tokens": 0, "dense_layers": 0}},
                           N_NEW, stop=None)
        with pytest.raises(ConfigError, match="its own codec"):
            llm.compare(prompts, {"d": {"kv_policy": "dkv", "block_size": 4, "dkv_rank": 2, "dkv_residuals": 1}}, N_NEW)
        assert llm.engine.kv_policy.name == "dense"  # put back
    assert list(runs) == ["dense", "quest@0.25"]
    (dense, d), (_, q) = runs["dense"], runs["quest@0.25"]
    assert [o.token_ids for o in dense] == [o.token_ids for o in plain]
    assert 0 < q.bytes_moved["disk->cpu"] < d.bytes_moved["disk->cpu"]


# --- bad arguments: ConfigError, the CLI's line ------------------------------------------
CLI_ERRORS = [
    (dict(gpu_batch_size=0), ["--gpu-batch-size", "0"]),
    (dict(percent=(1, 2)), ["--percent", "1", "2"]),
    (dict(kv_policy="nope"), ["--kv-policy", "nope"]),
    (dict(kv_policy="sparpr", keep_ratio=1.5), ["--kv-policy", "sparpr", "--keep-ratio", "1.5"]),
    (dict(block_size=0), ["--block-size", "0"]),
    (dict(device="tpu"), ["--device", "tpu"]),
    (dict(config="/nonexistent.yaml"), ["--config", "/nonexistent.yaml"]),
]


@pytest.mark.parametrize("kwargs, argv", CLI_ERRORS, ids=[a[0] for _, a in CLI_ERRORS])
def test_bad_arguments_raise_the_clis_message(tiny_opt_dir, tmp_path, capsys, kwargs, argv):
    with pytest.raises(ConfigError) as e:
        _llm(tiny_opt_dir, tmp_path, **kwargs)
    assert main(["run", "--model", str(tiny_opt_dir), *argv, "--no-log"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {e.value}"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(gpu_batch_size="four"), "--gpu-batch-size must be an integer"),
    (dict(compress_cache="yes"), "--compress-cache must be true or false"),
    (dict(temperature=0.5), "LLM() takes no 'temperature': give it to generate()"),
    (dict(keep=0.5), "unknown options: keep"),
    (dict(model="no-such-model"), "unknown model"),
])
def test_bad_constructor_arguments(tiny_opt_dir, tmp_path, kwargs, fragment):
    kwargs = {"model": str(tiny_opt_dir), **kwargs}
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        LLM(offload_dir=str(tmp_path / "off"), **kwargs)


@pytest.mark.parametrize("call, fragment", [
    (dict(max_new_tokens=0), "max_new_tokens must be in [1, 2147483647] (got 0)"),
    (dict(temperature=0.0), "temperature must be a finite number >= 0.0001 (lower is greedy"),
    (dict(top_p=2.0), "top_p must be in (0, 1]"),
    (dict(stop="never"), "stop takes a token id, 'eos' or 'none'"),
    (dict(stop=300), "stop 300 is outside"),
    (dict(prompts=[[5, 300]]), "prompt 0: give a text or a non-empty list of token ids in [0, 300)"),
    (dict(prompts=[[1, 2], []]), "prompt 1:"),
    (dict(prompts="hello"), "this model has no tokenizer"),
    (dict(prompts=[_prompt(250, 0)], max_new_tokens=10), "exceed"),
])
def test_bad_generate_arguments(tiny_opt_dir, tmp_path, call, fragment):
    call = {"prompts": [[5, 6]], **call}
    with _llm(tiny_opt_dir, tmp_path, gpu_batch_size=1) as llm:
        with pytest.raises(ConfigError) as e:
            llm.generate(**call)
        with pytest.raises(ConfigError):
            llm.stream(**call)  # checked at the call, before the first event
    assert fragment in str(e.value) and "\n" not in str(e.value)


# --- clean-up ------------------------------------------------------------------------------
WEIGHTS_ON_DISK = dict(percent=(50, 0, 100, 0, 100, 0), gpu_batch_size=1)


def _runs(off: Path) -> list[Path]:
    return sorted(off.glob("run-*")) if off.exists() else []


def test_close_and_garbage_collection_remove_the_offload_files(tiny_opt_dir, tmp_path):
    off = tmp_path / "off"
    llm = _llm(tiny_opt_dir, tmp_path, **WEIGHTS_ON_DISK)
    assert len(_runs(off)) == 1  # half the weights live there
    llm.generate([[5, 6, 7]], 2)
    llm.close()
    assert _runs(off) == [] and llm.closed
    llm.close()  # twice is fine
    with pytest.raises(ConfigError, match="closed"):
        llm.generate([[5, 6]], 2)
    llm = _llm(tiny_opt_dir, tmp_path, **WEIGHTS_ON_DISK)
    assert len(_runs(off)) == 1
    del llm
    gc.collect()
    assert _runs(off) == []


def test_exit_removes_the_offload_files(tiny_opt_dir, tmp_path):
    off = tmp_path / "off"
    code = (f"from flexgen_sparpr import LLM\nllm = LLM({str(tiny_opt_dir)!r}, offload_dir={str(off)!r}, "
            f"percent=(50, 0, 100, 0, 100, 0), gpu_batch_size=1)\nprint(len(list(__import__('pathlib').Path("
            f"{str(off)!r}).glob('run-*'))), llm.generate([[5, 6, 7]], 2)[0].token_ids)\n")  # no close()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("1 [") and _runs(off) == []


def test_importing_the_package_is_cheap():
    code = "import sys, flexgen_sparpr; assert 'torch' not in sys.modules; print(flexgen_sparpr.__all__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0 and "LLM" in r.stdout, r.stderr
