"""Upstream FlexGen (PyPI flexgen==0.1.8) as the measured peer: CPU patches, a SparPR hook, a runner."""
from .patches import apply_cpu_patches, upstream_available
from .sparpr_hook import apply_sparpr, remove_sparpr

__all__ = ["apply_cpu_patches", "apply_sparpr", "remove_sparpr", "run_upstream", "upstream_available"]


def __getattr__(name):
    if name == "run_upstream":  # lazy: `python -m flexgen_sparpr.upstream.run` must import run.py once
        from .run import run_upstream
        return run_upstream
    raise AttributeError(name)
