"""A checkpoint checked against its config before any weight loads: every tensor the engine will
read is there, with the shape the config implies (else a wrong shape fails late, deep in RoPE)."""
from __future__ import annotations

from ..models import build_arch
from .sources import WeightSource, WeightsError, dummy_shapes


def check_tensors(src: WeightSource) -> WeightSource:
    """src itself, or WeightsError naming the file or folder, the tensor and the shapes."""
    for name, want in dummy_shapes(src.spec, build_arch(src.spec)).items():
        try:
            got = src.shape_of(name)
        except KeyError:
            raise WeightsError(f"{src.describe()}: tensor {name} is missing (the config says "
                               f"{src.spec.name} has it)") from None
        if got is not None and tuple(got) != tuple(want):
            raise WeightsError(f"{src.describe()}: tensor {name} has shape {list(got)}, but its config "
                               f"implies {list(want)}")
    return src
