"""Optional: this engine's seeded dummy weights inside upstream FlexGen.

Upstream's `_DUMMY_` weights are all ones: activations overflow float16 within a layer and every
sequence generates the same id, which is fine for timing but says nothing about correctness.
`use_engine_dummy_weights()` makes upstream fill its dummy tensors with the values this engine's
`DummySource` gives the same tensor (seeded per name), so the two engines run the same model.
"""
from __future__ import annotations

import importlib
import os

import numpy as np

_state: dict = {"seed": None, "sources": {}}


def hf_name(upstream_file: str) -> str:
    """Upstream's weight file path -> the HF tensor name this engine's sources use."""
    name = os.path.basename(upstream_file)
    if name.startswith("decoder.layer_norm."):  # upstream's converter renamed the final norm
        name = name.replace("decoder.layer_norm.", "decoder.final_layer_norm.")
    return "model." + name


def _source(model: str, seed: int, max_seq_len: int | None = None):
    key = (model, seed, max_seq_len)
    if key not in _state["sources"]:
        from ..weights.resolve import DUMMY, resolve_source
        _state["sources"][key] = resolve_source(model, DUMMY, max_seq_len=max_seq_len, seed=seed)
    return _state["sources"][key]


def engine_dummy_values(model: str, upstream_file: str, shape: tuple, dtype, seed: int = 0) -> np.ndarray:
    """The values this engine's dummy source gives upstream's tensor `upstream_file`, as `dtype`."""
    name = hf_name(upstream_file)
    positions = shape[0] - 2 if name.endswith("embed_positions.weight") else None  # table sized to the run
    t = _source(model, seed, positions).get(name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{upstream_file}: upstream shape {tuple(shape)} != engine shape {tuple(t.shape)}")
    return t.numpy().astype(dtype)


def use_engine_dummy_weights(seed: int = 0) -> None:
    """Upstream's dummy tensors get this engine's seeded values (idempotent; a new seed replaces
    the old one). Real weight files are untouched."""
    flex_opt = importlib.import_module("flexgen.flex_opt")
    first = _state["seed"] is None
    _state["seed"] = seed
    if not first:
        return
    init = flex_opt.init_weight_list

    def init_weight_list(weight_specs, policy, env):
        weights = init(weight_specs, policy, env)  # allocated, filled with ones
        for (shape, dtype, filename), w in zip(weight_specs, weights):
            if flex_opt.DUMMY_WEIGHT in filename:
                model = os.path.basename(os.path.dirname(filename)).removesuffix("-np")
                w.load_from_np(engine_dummy_values(model, filename, shape, dtype, _state["seed"]))
        return weights

    flex_opt.init_weight_list = init_weight_list
