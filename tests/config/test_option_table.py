"""config/flags.py's option table is the one description of the options: the command line's parser
is built from it (cli/parser.py), and YAML values and the API's keyword arguments are typed by it
(config/validate.py) with the same one-line errors."""
from __future__ import annotations

import pytest

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config import flags
from flexgen_sparpr.config.validate import typed_config_values, typed_flag_values
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.kv import policies


def test_every_option_is_a_flag_and_every_flag_an_option():
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    table = flags.options()
    assert list(actions) == list(table)  # the same options, in the table's order
    for dest, o in table.items():
        a = actions[dest]
        assert a.option_strings == [o.flag] and a.default is None
        assert (tuple(a.choices) if a.choices else None) == (tuple(o.choices) if o.choices else None)


def test_defaults_cover_the_options_that_are_no_policy_knob():
    knobs = set(policies.flags())
    assert set(flags.DEFAULTS) == set(flags.options()) - knobs
    assert knobs <= set(flags.options())  # every registered policy's knobs are options


def test_knob_options_follow_their_policies():
    table = flags.options()
    for dest, flag in policies.flags().items():
        o = table[dest]
        assert o.kind == ("switch" if flag.knob.type is bool else flag.knob.type.__name__)
        shared = len(flag.policies) > 1
        assert o.group.startswith("KV policies") == shared
        assert flag.knob.help in o.help


@pytest.mark.parametrize("dest, value, rule", [
    ("gen_len", "8", "must be an integer (got '8')"),
    ("gen_len", True, "must be an integer (got True)"),
    ("top_p", "x", "must be a number (got 'x')"),
    ("do_sample", "yes", "must be true or false (got 'yes')"),
    ("overlap", "maybe", "must be true or false (got 'maybe')"),
    ("percent", 5, "must be a list (got 5)"),
    ("percent", [100, "0"], "must be an integer (got '0')"),
    ("dtype", "float8", "must be one of auto, float16, bfloat16, float32 (got 'float8')"),
    ("model", ["m"], "must be a string (got ['m'])"),
    ("keep_ratio", "half", "must be a number (got 'half')"),
    ("checkpoints", "never", "must be one of auto, always (got 'never')"),
])
def test_yaml_and_api_values_get_the_same_one_line_errors(dest, value, rule):
    flag = flags.options()[dest].flag
    with pytest.raises(ConfigError) as api:
        typed_flag_values({dest: value})
    assert str(api.value) == f"{flag} {rule}"
    with pytest.raises(ConfigError) as yaml:
        typed_config_values({dest: value}, "run", "--config c.yaml")
    assert str(yaml.value) == f"--config c.yaml: run.{dest} {rule}"


def test_values_are_typed_as_their_flags_parse_them():
    assert typed_flag_values({"overlap": "no", "percent": (50, 50, 100, 0, 100, 0), "top_p": 1, "stop": 2}) == \
        {"overlap": False, "percent": [50, 50, 100, 0, 100, 0], "top_p": 1.0, "stop": "2"}
    args = build_parser().parse_args(["--overlap", "no", "--percent", "50", "50", "100", "0", "100", "0",
                                      "--top-p", "1", "--stop", "2"])
    assert (args.overlap, args.percent, args.top_p, args.stop) == (False, [50, 50, 100, 0, 100, 0], 1.0, "2")
    assert typed_flag_values({"max_new_tokens": 3}, names={"gen_len": "max_new_tokens"}) == {"max_new_tokens": 3}
    with pytest.raises(ConfigError, match="^max_new_tokens must be an integer"):
        typed_flag_values({"gen_len": 1.5}, names={"gen_len": "max_new_tokens"})


def test_a_bool_option_reads_the_same_words_on_both_faces():
    for word, value in (("yes", True), ("T", True), ("0", False), ("n", False)):
        assert flags.parse_bool(word) is value
        assert build_parser().parse_args(["--warmup", word]).warmup is value
    assert build_parser().parse_args(["--warmup"]).warmup is True
    with pytest.raises(ValueError, match="expected a boolean, got 'maybe'"):
        flags.parse_bool("maybe")


def test_the_parser_error_stays_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--sep-layer", "maybe"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == "flexgen-sparpr run: error: argument --sep-layer: expected a boolean, got 'maybe' (see --help)\n"
