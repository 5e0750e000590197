"""flexgen-sparpr: offloading LLM inference (FlexGen's three-tier executor, SparPR, DKV).

    from flexgen_sparpr import LLM
    with LLM("smollm2-135m", kv_policy="sparpr", keep_ratio=0.25) as llm:
        print(llm.generate(["The capital of France is"], max_new_tokens=8)[0].text)

Importing the package is cheap: LLM and its outputs load (torch included) on first use.
"""
from .errors import CapacityError, ConfigError, ModelNotFound

__all__ = ["LLM", "Output", "StreamEvent", "Stats", "ConfigError", "CapacityError", "ModelNotFound"]

_LAZY = {"LLM": "llm", "Output": "outputs", "StreamEvent": "outputs", "Stats": "outputs"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".api.{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
