"""The three storage tiers, the devices behind them, and the bytes moved between them."""
from __future__ import annotations

import enum
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .host_memory import HostMemory
from .streams import CudaAPI, Streams


class Tier(str, enum.Enum):
    COMPUTE = "compute"
    CPU = "cpu"
    DISK = "disk"


class LinkCounters:
    """Bytes moved per link ('disk->cpu', 'cpu->compute', ...) and the requests that moved them
    (one per call unless told: a span of adjacent blocks is one); thread-safe. Transfers that
    were timed also add their seconds, so the engine's own I/O measures each link's bandwidth."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = defaultdict(int)
        self._requests: dict[str, int] = defaultdict(int)
        self._timed: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # link -> [bytes, s]
        self._tagged: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # tag -> link -> bytes
        self._local = threading.local()

    @contextmanager
    def tag(self, name: str):
        """Bytes this thread adds meanwhile are also counted under `name` (e.g. "serial": reads
        made inside a layer's compute, which the time model does not overlap)."""
        old, self._local.tag = getattr(self._local, "tag", None), name
        try:
            yield
        finally:
            self._local.tag = old

    def tagged(self, name: str) -> dict[str, int]:
        with self._lock:
            return dict(self._tagged.get(name, {}))

    def add(self, src: str, dst: str, nbytes: int, seconds: float | None = None, requests: int = 1) -> None:
        link = f"{src}->{dst}"
        tag = getattr(self._local, "tag", None)
        with self._lock:
            self._bytes[link] += int(nbytes)
            self._requests[link] += int(requests)
            if tag is not None:
                self._tagged[tag][link] += int(nbytes)
            if seconds is not None and seconds > 0:
                self._timed[link][0] += nbytes
                self._timed[link][1] += seconds

    def bandwidth(self, src: str, dst: str) -> float | None:
        """Bytes per second measured on a link so far (None before any timed transfer)."""
        with self._lock:
            b, s = self._timed.get(f"{src}->{dst}", (0.0, 0.0))
        return b / s if s > 0 else None

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def requests(self) -> dict[str, int]:
        """Requests per link so far (a read of a span of adjacent blocks is one)."""
        with self._lock:
            return dict(self._requests)

    def reset(self) -> None:
        """Clear the byte and request counts (measured bandwidths are kept: they describe the machine)."""
        with self._lock:
            self._bytes.clear()
            self._requests.clear()
            self._tagged.clear()

    def total(self) -> int:
        return sum(self.snapshot().values())


def normalize_device(device) -> torch.device:
    """The one spelling of a compute device: CUDA with its index, the CPU without one.

    Tensors report `cuda:0` and `cpu`, while torch.device("cuda") != torch.device("cuda:0") and
    torch.device("cpu:0") != torch.device("cpu"): every "is this tensor already on the compute
    device?" test must compare against this form, or it is always false (counted copies,
    reallocated buffers)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cpu":
        return torch.device("cpu")
    return dev


def resolve_device(name: str) -> torch.device:
    """auto (CUDA when present, else the CPU), cpu, cuda or cuda:N -> a normalized device;
    ValueError with a one-line reason otherwise."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N (got {name!r})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    return normalize_device(dev)


@dataclass
class Devices:
    """The physical devices behind the tiers of one run, the compute device's streams (every
    cross-stream hand-off: storage/streams.py) and the host memory behind the CPU tier with its
    copies to and from the compute device (storage/host_memory.py).

    On a CPU-only machine the compute tier *is* host memory, so the CPU tier folds into it:
    blocks placed on 'cpu' live beside the compute tier and no link is crossed. `stream_api`
    stands in for CUDA's streams on a CPU engine (tests/stream_double.py); None: CUDA's on a CUDA
    device, none on the CPU.
    """

    compute: torch.device
    pin_memory: bool = True
    counters: LinkCounters = field(default_factory=LinkCounters)
    stream_api: object = None
    streams: Streams = field(init=False, repr=False)
    host: HostMemory = field(init=False, repr=False)

    def __post_init__(self):
        self.compute = normalize_device(self.compute)
        api = self.stream_api if self.stream_api is not None else CudaAPI if self.is_cuda else None
        self.streams = Streams(self.compute, api)
        self.host = HostMemory(self.streams, pin=self.pin_memory)

    @property
    def is_cuda(self) -> bool:
        return self.compute.type == "cuda"

    def effective(self, tier: Tier) -> Tier:
        return Tier.COMPUTE if (tier == Tier.CPU and not self.is_cuda) else tier

    def device_of(self, tier: Tier) -> torch.device:
        return self.compute if self.effective(tier) == Tier.COMPUTE else torch.device("cpu")

    def empty_host(self, shape, dtype) -> torch.Tensor:
        """A short-lived host buffer for one read, pinned when a CUDA link will read it."""
        return self.host.empty(shape, dtype)


def split_by_percent(sizes: list[int], percents: tuple[float, float, float]) -> list[Tier]:
    """FlexGen's rule: each tensor goes to the tier whose cumulative-percent range holds the
    midpoint of its own byte range. percents = (compute, cpu, disk), summing to 100."""
    total = max(1, sum(sizes))
    bounds = (percents[0], percents[0] + percents[1])
    tiers, acc = [], 0
    for s in sizes:
        mid = (acc + s / 2) / total * 100
        acc += s
        tiers.append(Tier.COMPUTE if mid < bounds[0] else Tier.CPU if mid < bounds[1] else Tier.DISK)
    return tiers


def block_homes(num_blocks: int, percents: tuple[float, float, float]) -> list[Tier]:
    """Home tier per KV block, recency-ordered: the oldest blocks go to disk, then CPU, and the
    newest to the compute tier, since every attention policy reads the recent window."""
    # cumulative rounding: a tier with a 0 % share never gets a block
    n_disk = round(num_blocks * percents[2] / 100)
    n_cpu = round(num_blocks * (percents[2] + percents[1]) / 100) - n_disk
    return [Tier.DISK] * n_disk + [Tier.CPU] * n_cpu + [Tier.COMPUTE] * (num_blocks - n_disk - n_cpu)
