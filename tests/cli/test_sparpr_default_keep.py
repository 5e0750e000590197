"""sparpr's default ceiling (issue 17): `--kv-policy sparpr` alone reads at most half the context."""
from __future__ import annotations

import pytest

from flexgen_sparpr.cli.parser import build_parser
from flexgen_sparpr.config.options import resolve
from flexgen_sparpr.errors import ConfigError


def test_default_ceiling_and_the_floor_checked_with_the_knobs_given():
    """sparpr alone reads at most half the context (issue 17); its floor is checked against the
    ceiling given with it, and another policy's keep is not refused by sparpr's default floor."""
    def kv(*argv):
        return resolve(build_parser().parse_args(list(argv)))[2].kv_policy
    assert kv("--kv-policy", "sparpr").keep_ratio == 0.5 and kv("--kv-policy", "quest").keep_ratio == 1.0
    assert kv("--kv-policy", "sparpr", "--min-keep", "0.6", "--keep-ratio", "0.8").min_keep == 0.6
    assert kv("--kv-policy", "quest", "--keep-ratio", "0.05").keep_ratio == 0.05
    for argv in (("--min-keep", "0.6"), ("--keep-ratio", "0.05")):  # above the default ceiling; below the floor
        with pytest.raises(ConfigError, match="--min-keep .* is above --keep-ratio"):
            kv("--kv-policy", "sparpr", *argv)
