"""Upstream FlexGen fixtures: skip the directory's tests when flexgen==0.1.8 is not installed."""
from __future__ import annotations

import pytest

from flexgen_sparpr.upstream.patches import upstream_available

B, P, G = 2, 32, 3  # batch, prompt, new tokens: opt-125m stays about a second a run on 2 cores


def pytest_collection_modifyitems(config, items):
    if upstream_available():
        return
    skip = pytest.mark.skip(reason="upstream FlexGen not installed (`make setup` installs flexgen==0.1.8)")
    for item in items:
        if "tests/upstream" in str(item.fspath):
            item.add_marker(skip)


def run_recording(sparpr=None, **kwargs):
    """Upstream with this engine's dummy weights, no warm-up; returns (result, outs): outs holds
    every decode attention layer's hidden output ([B, 1, h]) in call order."""
    import flexgen.pytorch_backend as backend
    from flexgen_sparpr.upstream.run import generate_upstream
    outs, mha_gen = [], backend.TorchDevice.mha_gen

    def recording(self, *args, **kw):
        ret = mha_gen(self, *args, **kw)
        outs.append(ret[0].data.clone())
        return ret

    backend.TorchDevice.mha_gen = recording
    try:
        args = dict(batch=B, prompt_len=P, gen_len=G, weights="engine", warmup=False) | kwargs
        return generate_upstream(sparpr=sparpr, **args), outs
    finally:
        backend.TorchDevice.mha_gen = mha_gen


@pytest.fixture(scope="session")
def dense_recorded():
    """One dense upstream run on the CPU (opt-125m) and its decode attention outputs."""
    return run_recording()


@pytest.fixture(scope="session")
def upstream_dense(dense_recorded):
    return dense_recorded[0]
