"""DKV's flags: where they land (policy args, codec args, block size) and what they refuse."""
import pytest

from flexgen_sparpr.cli.flags import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.cli.options import resolve


def _opts(*argv):
    return resolve(build_parser().parse_args(list(argv)))


def test_dkv_policy_args_and_block_size():
    _, _, eng = _opts("--kv-policy", "dkv", "--dkv-rank", "48", "--dkv-residuals", "8", "--dkv-topk", "4",
                      "--dkv-sparse-prefill", "--dkv-residual-pick", "attention")
    assert eng.block_size == 256 and eng.cold_codec == "raw" and eng.codec_args == {}
    assert eng.policy_args == {"rank": 48, "residuals": 8, "topk": 4, "recent_blocks": 1, "sparse_prefill": True,
                               "route": "lowrank", "residual_pick": "attention"}


def test_cold_codec_args_and_explicit_block_size():
    _, _, eng = _opts("--kv-policy", "sparpr", "--cold-codec", "dkv", "--block-size", "128", "--dkv-recent", "2",
                      "--dkv-residual-pick", "mixed")
    assert eng.block_size == 128 and eng.cold_codec == "dkv"
    assert eng.codec_args == {"rank": 32, "residuals": 16, "residual_pick": "mixed", "recent": 2}
    assert "rank" not in eng.policy_args and eng.policy_args["keep_ratio"] == 1.0


def test_without_dkv_nothing_changes():
    _, _, eng = _opts("--kv-policy", "quest", "--dkv-rank", "8")
    assert eng.block_size == 64 and eng.codec_args == {} and "rank" not in eng.policy_args


@pytest.mark.parametrize("argv,fragment", [
    (["--kv-policy", "dkv", "--dkv-rank", "0"], "--dkv-rank must be >= 1"),
    (["--kv-policy", "dkv", "--dkv-residuals", "-1"], "--dkv-residuals must be >= 0"),
    (["--kv-policy", "dkv", "--dkv-residual-pick", "worst"], "--dkv-residual-pick must be one of"),
    (["--kv-policy", "sparpr", "--cold-codec", "dkv", "--dkv-residual-pick", "Attention"], "error, attention, mixed"),
    (["--kv-policy", "dkv", "--block-size", "64", "--dkv-block", "128"], "disagree"),
    (["--kv-policy", "dkv", "--compress-cache"], "one KV codec at a time"),
    (["--kv-policy", "dkv", "--cold-codec", "dkv"], "one KV codec at a time"),
])
def test_bad_dkv_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(["run", "--model", "opt-125m", "--path", "_DUMMY_", "--no-log", "--verbose", "0", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err
