"""One stop default: a served request ends where LLM.generate() ends by default (the model's end
token, engine/sampling.py STOP_DEFAULT), as `run --prompt` and `batch` do; a model that names no end
token is served to each request's max_tokens instead of refusing every request."""
from __future__ import annotations

import dataclasses

import pytest

from flexgen_sparpr import LLM
from flexgen_sparpr.errors import ConfigError
from flexgen_sparpr.serve.batcher import default_stop


def test_serve_stops_where_generate_stops_by_default(tiny_opt_dir, tmp_path, monkeypatch):
    with LLM(str(tiny_opt_dir), quiet=True, offload_dir=str(tmp_path / "off")) as llm:
        assert llm.spec.eos_id is not None
        assert default_stop(llm) == llm.params(1).stop == llm.spec.eos_id
        monkeypatch.setattr(llm, "spec", dataclasses.replace(llm.spec, eos_id=None))
        with pytest.raises(ConfigError, match="names no end token"):
            llm.params(1)  # the API's default asks for an end token this model lacks
        assert default_stop(llm) is None and llm.params(1, stop="none").stop is None
