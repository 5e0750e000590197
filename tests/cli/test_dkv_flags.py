"""DKV's flags: where they land (the policy's knobs, the cold codec's, the block size) and what they refuse."""
import pytest

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.cli.main import main
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.errors import ConfigError


def _opts(*argv):
    return resolve(build_parser().parse_args(list(argv)))


def test_dkv_policy_args_and_block_size():
    _, _, eng = _opts("--kv-policy", "dkv", "--dkv-rank", "48", "--dkv-residuals", "8", "--dkv-topk", "4",
                      "--dkv-sparse-prefill", "--dkv-residual-pick", "attention")
    pol = eng.kv_policy
    assert eng.block_size == 256 and eng.cold_codec == "raw" and eng.make_cold_codec() is None
    assert (pol.name, pol.rank, pol.residuals, pol.topk, pol.recent_blocks, pol.sparse_prefill, pol.route,
            pol.residual_pick) == ("dkv", 48, 8, 4, 1, True, "lowrank", "attention")


def test_cold_codec_args_and_explicit_block_size():
    _, _, eng = _opts("--kv-policy", "sparpr", "--cold-codec", "dkv", "--block-size", "128", "--dkv-recent", "2",
                      "--dkv-residual-pick", "mixed")
    cold = eng.make_cold_codec()
    assert eng.block_size == 128 and cold.name == "dkv"
    assert (cold.rank, cold.residuals, cold.residual_pick, cold.recent_blocks) == (32, 16, "mixed", 2)
    assert eng.kv_policy.name == "sparpr" and eng.kv_policy.keep_ratio == 0.5  # sparpr's default ceiling


def test_without_dkv_nothing_changes():
    _, _, eng = _opts("--kv-policy", "quest")
    assert eng.block_size == 16 and eng.make_cold_codec() is None and not hasattr(eng.kv_policy, "rank")
    with pytest.raises(ConfigError, match="--dkv-rank is a knob of dkv; --kv-policy quest ignores it"):
        _opts("--kv-policy", "quest", "--dkv-rank", "8")  # a knob no policy of the run reads is refused


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
