"""Upstream FlexGen fixtures: skip the directory's tests when flexgen==0.1.8 is not installed."""
from __future__ import annotations

import pytest

from flexgen_sparpr.upstream.patches import upstream_available
from tests.upstream.recording import run_recording


def pytest_collection_modifyitems(config, items):
    if upstream_available():
        return
    skip = pytest.mark.skip(reason="upstream FlexGen not installed (`make setup` installs flexgen==0.1.8)")
    for item in items:
        if "tests/upstream" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dense_recorded():
    """One dense upstream run on the CPU (opt-125m) and its decode attention outputs."""
    return run_recording()


@pytest.fixture(scope="session")
def upstream_dense(dense_recorded):
    return dense_recorded[0]
