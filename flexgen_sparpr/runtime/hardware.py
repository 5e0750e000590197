"""A machine's capacities and speeds as one frozen object, read from / written to a YAML file.

The file is for people: memory in GiB, bandwidth in GB/s (1e9 bytes/s), matmul throughput in
TFLOPS (1e12 FLOP/s), each unit in the key name, all under a top-level `hardware:` section so the
same text can sit inside a `--config` policy file. The dataclass holds bytes, bytes/s and FLOP/s.
`flexgen-sparpr profile` (runtime/profile.py) measures one; configs/hardware/ ships others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from ..errors import ConfigError
from ..utils.files import write_atomic
from ..utils.paths import config_file

GiB = 1 << 30
GB = 1e9
TFLOPS = 1e12
COMPUTE_KINDS = ("cuda", "cpu")
DTYPE_NAMES = ("float16", "bfloat16", "float32")

# dataclass field -> (YAML key, scale from the file's unit to the dataclass's)
_SCALARS = {
    "compute_memory": ("compute_memory_GiB", GiB),
    "cpu_memory": ("cpu_memory_GiB", GiB),
    "disk_free": ("disk_free_GiB", GiB),
    "h2d_bw": ("h2d_GBps", GB),
    "d2h_bw": ("d2h_GBps", GB),
    "h2d_pageable_bw": ("h2d_pageable_GBps", GB),
    "d2h_pageable_bw": ("d2h_pageable_GBps", GB),
    "disk_read_bw": ("disk_read_GBps", GB),
    "disk_write_bw": ("disk_write_GBps", GB),
    "compute_memory_bw": ("compute_memory_GBps", GB),
    "gpu_mem": ("gpu_mem_GiB", GiB),
    "interconnect_bw": ("interconnect_GBps", GB),
}
_OPTIONAL = ("compute_memory_bw", "gpu_mem", "interconnect_bw")  # 0.0 when unknown / not given
_LINKS = ("h2d_bw", "d2h_bw", "h2d_pageable_bw", "d2h_pageable_bw")
_DICTS = {"flops": ("flops_TFLOPS", TFLOPS), "cpu_flops": ("cpu_flops_TFLOPS", TFLOPS)}


@dataclass(frozen=True)
class Hardware:
    """One machine. Bytes, bytes/s and FLOP/s. Host <-> device links are 0.0 when the compute
    device is the CPU (there is no link to cross)."""

    name: str
    compute: str                 # "cuda" or "cpu"
    compute_memory: float        # bytes usable on the compute device (cpu-only: the host's)
    cpu_memory: float            # bytes of host memory usable
    disk_free: float             # bytes free on the offload disk
    h2d_bw: float                # bytes/s host -> device, pinned (0.0 when compute is cpu)
    d2h_bw: float                # bytes/s device -> host, pinned
    h2d_pageable_bw: float
    d2h_pageable_bw: float
    disk_read_bw: float          # bytes/s, page-cache bypass
    disk_write_bw: float
    flops: dict[str, float]      # compute device FLOP/s per dtype name
    cpu_flops: dict[str, float]  # host matmul FLOP/s per dtype name
    source: str                  # "measured YYYY-MM-DD on <host>" or "public spec sheets: <which>"
    notes: str = ""              # why numbers are derated, what is assumed
    matmul_latency_s: dict[str, float] = field(default_factory=dict)  # one small matmul call
    compute_memory_bw: float = 0.0  # bytes/s the compute device reads its own memory (0: unknown)
    # bytes: the card's whole memory; a run on a bigger CUDA device is capped to it (--gpu-mem; 0: no cap)
    gpu_mem: float = 0.0
    # bytes/s between two such machines (pipeline stages' hidden states; 0: unknown, not counted)
    interconnect_bw: float = 0.0

    def __post_init__(self):
        if self.compute not in COMPUTE_KINDS:
            raise ConfigError(f"hardware {self.name!r}: compute must be cuda or cpu (got {self.compute!r})")
        for name in _SCALARS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"hardware {self.name!r}: {_SCALARS[name][0]} must be a number >= 0 (got {v!r})")
        for name in ("compute_memory", "cpu_memory", "disk_read_bw", "disk_write_bw"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware {self.name!r}: {_SCALARS[name][0]} must be > 0")
        if self.gpu_mem and (self.compute != "cuda" or self.gpu_mem < self.compute_memory):
            raise ConfigError(f"hardware {self.name!r}: gpu_mem_GiB is a cuda card's whole memory, at least "
                              f"compute_memory_GiB")
        if self.compute == "cuda" and not (self.h2d_bw > 0 and self.d2h_bw > 0):
            raise ConfigError(f"hardware {self.name!r}: a cuda machine needs h2d_GBps and d2h_GBps > 0")
        for name, (key, _) in _DICTS.items():
            d = getattr(self, name)
            if not isinstance(d, dict) or not d or not all(
                    isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in d.values()):
                raise ConfigError(f"hardware {self.name!r}: {key} must map dtype names to numbers > 0")
            unknown = set(d) - set(DTYPE_NAMES)
            if unknown:
                raise ConfigError(f"hardware {self.name!r}: {key} has unknown dtypes {sorted(unknown)} "
                                  f"(use {', '.join(DTYPE_NAMES)})")

    @property
    def is_cuda(self) -> bool:
        return self.compute == "cuda"

    def compute_flops(self, dtype: str) -> float:
        """FLOP/s of the compute device for a dtype name; float32's when the dtype is missing."""
        return self.flops.get(dtype) or self.flops.get("float32") or max(self.flops.values())

    def to_yaml_dict(self) -> dict:
        """The file's layout (human units), without the top-level `hardware:` key."""
        out = {"name": self.name, "compute": self.compute, "source": self.source}
        for name, (key, scale) in _SCALARS.items():
            v = getattr(self, name)
            if name in ("gpu_mem", "interconnect_bw") and not v:
                continue  # no cap, no interconnect known: the key stays absent
            out[key] = None if (name in _LINKS and not self.is_cuda) else _round(v / scale)
        for name, (key, scale) in _DICTS.items():
            out[key] = {k: _round(v / scale) for k, v in getattr(self, name).items()}
        if self.matmul_latency_s:
            out["matmul_latency_s"] = {k: float(f"{v:.3g}") for k, v in self.matmul_latency_s.items()}
        if self.notes:
            out["notes"] = self.notes
        return out


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def hardware_from_dict(section: dict, where: str = "hardware file") -> Hardware:
    """A Hardware from the body of a `hardware:` section (human units); ConfigError when bad."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: the hardware section must be a mapping")
    known = {"name", "compute", "source", "notes", "matmul_latency_s",
             *(k for k, _ in _SCALARS.values()), *(k for k, _ in _DICTS.values())}
    unknown = set(section) - known
    if unknown:
        raise ConfigError(f"{where}: unknown hardware keys: {', '.join(sorted(map(str, unknown)))}")
    compute = section.get("compute")
    required = ["name", "compute", "source", "compute_memory_GiB", "cpu_memory_GiB", "disk_free_GiB",
                "disk_read_GBps", "disk_write_GBps", "flops_TFLOPS", "cpu_flops_TFLOPS"]
    if compute == "cuda":
        required += ["h2d_GBps", "d2h_GBps"]
    missing = [k for k in required if section.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: missing hardware keys: {', '.join(missing)}")
    if compute not in COMPUTE_KINDS:
        raise ConfigError(f"{where}: compute must be cuda or cpu (got {compute!r})")
    for key in ("name", "source", "notes"):
        if section.get(key) is not None and not isinstance(section[key], (str, int, float)):
            raise ConfigError(f"{where}: {key} must be a text (got {section[key]!r})")
    kw = {"name": str(section["name"]), "compute": compute, "source": str(section["source"]),
          "notes": str(section.get("notes") or "")}
    for name, (key, scale) in _SCALARS.items():
        v = section.get(key)
        if v is None and name in _LINKS:
            # pageable copies default to the pinned figure; no link at all on a CPU-only box
            pinned = section.get(key.replace("_pageable", "")) if "pageable" in key else None
            v, key = (pinned, key.replace("_pageable", "")) if (compute == "cuda" and pinned is not None) else (0.0, key)
        elif v is None and name in _OPTIONAL:
            v = 0.0
        kw[name] = _number(v, scale, f"{where}: {key}")
    for name, (key, scale) in _DICTS.items():
        kw[name] = _per_dtype(section[key], scale, f"{where}: {key}")
    lat = section.get("matmul_latency_s")
    kw["matmul_latency_s"] = {} if lat is None else _per_dtype(lat, 1.0, f"{where}: matmul_latency_s")
    try:
        return Hardware(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _number(v, scale: float, name: str) -> float:
    """A file's value (human units) as the dataclass's: a finite number >= 0 that stays finite
    scaled; ConfigError naming the key and the value otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or not math.isfinite(float(v) * scale):
        raise ConfigError(f"{name} must be a finite number >= 0 (got {v!r})")
    return float(v) * scale


def _per_dtype(d, scale: float, name: str) -> dict[str, float]:
    """A mapping of dtype names to numbers > 0, scaled."""
    if not isinstance(d, dict) or not d:
        raise ConfigError(f"{name} must map dtype names ({', '.join(DTYPE_NAMES)}) to numbers (got {d!r})")
    unknown = sorted(str(k) for k in d if k not in DTYPE_NAMES)
    if unknown:
        raise ConfigError(f"{name} has unknown dtypes {unknown} (use {', '.join(DTYPE_NAMES)})")
    out = {k: _number(v, scale, f"{name}.{k}") for k, v in d.items()}
    zero = next((k for k, v in out.items() if v <= 0), None)
    if zero is not None:
        raise ConfigError(f"{name}.{zero} must be > 0 (got {d[zero]!r})")
    return out


def load_hardware(path) -> Hardware:
    """Read a hardware YAML file (a top-level `hardware:` section); ConfigError with one line
    when the file is missing, not YAML, or its values are wrong."""
    p = config_file(path)
    if not p.is_file():
        raise ConfigError(f"hardware file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"hardware file {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"hardware file {p}: cannot read it ({e})") from None
    if not isinstance(data, dict) or "hardware" not in data:
        raise ConfigError(f"hardware file {p}: expected a top-level `hardware:` section")
    return hardware_from_dict(data["hardware"], where=f"hardware file {p}")


def dump_hardware(hw: Hardware) -> str:
    """The YAML text of a hardware file (a comment line says which links do not apply)."""
    head = "# flexgen-sparpr hardware file: GiB = 2**30 bytes, GB/s = 1e9 bytes/s, TFLOPS = 1e12 FLOP/s\n"
    if not hw.is_cuda:
        head += "# compute is cpu: host<->device links are not applicable (null)\n"
    body = yaml.safe_dump({"hardware": hw.to_yaml_dict()}, sort_keys=False, width=100)
    return head + body


def save_hardware(hw: Hardware, path) -> None:
    """Write hw as a hardware YAML file, atomically (temp file, then rename)."""
    write_atomic(path, dump_hardware(hw))


HARDWARE_FIELDS = tuple(f.name for f in fields(Hardware))


def gathers_ahead(cuda: bool) -> int:
    """Decode KV gathers planned without a query in flight beyond the computing cell's (engine/prefetch.py
    CacheReads; their buffers: this + 2): one on a GPU's scarce memory, three on the CPU (one at a time
    left the disk idle a third of a dense step with its KV on disk)."""
    return 1 if cuda else 3
