"""Model architectures as plain functions over weight dicts."""
from .hf_config import spec_from_hf_config
from .llama import Llama
from .opt import OPT
from .spec import ModelSpec, opt_spec


def build_arch(spec: ModelSpec):
    return {"opt": OPT, "llama": Llama}[spec.arch](spec)


__all__ = ["Llama", "OPT", "ModelSpec", "opt_spec", "spec_from_hf_config", "build_arch"]
