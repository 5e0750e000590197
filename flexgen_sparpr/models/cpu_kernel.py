"""The compiled CPU kernels, built once per machine: decode attention (decode_kernel.cpp),
SparPR's low-rank block scores (lowrank_kernel.cpp, used by kv/policies/sparpr_lowrank.py) and a
block selection's top-k pick laid out as the rows attention reads (select_kernel.cpp, used by
kv/policies/fused_pick.py).

torch's fused CPU attention reads a one-query decode step's float32 K/V at about 12 GB/s on two
cores and splits its work by head (a batch of one has few); the attention kernel reads each key and
value row once for all the query heads that share it, widening bfloat16 / float16 rows as it goes,
splits the keys over the threads, and can read given rows of the cache in place (what it gains:
results/attention, docs/weights.md). The kernels are built with the machine's own instruction set
(`-march=native`) by torch's extension loader (g++ and ninja) the first time one is asked for, or
by `flexgen-sparpr prepare`, and cached under torch's extension folder, keyed by the sources, this
CPU's flags and the torch version. They are written for AVX-512 and for AVX2 with FMA and F16C (simd.h:
AMD Zen 2/3 and Intel's client cores since Alder Lake have AVX2 only). Where they cannot be built (no
compiler, neither instruction set) or FLEXGEN_SPARPR_CPU_KERNEL=0 is set, `kernel()` is None and the
torch paths run.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from pathlib import Path

import torch

_SRCS = [Path(__file__).with_name(n) for n in ("decode_kernel.cpp", "kernel_module.cpp", "lowrank_kernel.cpp",
                                                "select_kernel.cpp", "weight_kernel.cpp", "bf16_kernel.cpp",
                                                "glue_kernel.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "weight_avx2.h")]  # in the build's key, not compiled alone
# -fopenmp: at::parallel_for is inline OpenMP in torch's headers; without it the kernels run on one thread
# (the OpenMP runtime is the one torch has loaded: the same soname, libgomp.so.1)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_state: dict = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def simd_name() -> str | None:
    """The instruction set this CPU offers the kernels: "AVX-512", "AVX2", or None (neither; no build is tried)."""
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return "AVX-512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "AVX2"
    return None


def has_simd() -> bool:
    """Whether this CPU has an instruction set the kernels are written for (AVX-512F, or AVX2 + FMA + F16C)."""
    return simd_name() is not None


def kernel():
    """The built kernel module, or None where it cannot be (the reason in `why_not()`). Built on the
    first call (about 30 s on two cores, once per machine); later calls return it at once."""
    if "module" not in _state:
        _state["module"], _state["why"] = _build()
    return _state["module"]


def why_not() -> str | None:
    """Why `kernel()` is None (None: it is built, or not asked for yet)."""
    return _state.get("why")


def build_name() -> str:
    """The build's name: it changes with the sources, this CPU's flags and the torch install."""
    src = b"".join(p.read_bytes() for p in _SRCS + _HEADERS)
    # the torch install is in the key: another venv's headers make another build (no rebuild thrash)
    key = hashlib.sha1(src + " ".join(_FLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode()
                       + str(Path(torch.__file__).resolve().parent).encode())
    return f"flexgen_sparpr_decode_{key.hexdigest()[:12]}"


def build_folder() -> Path:
    """Where torch's extension loader builds and caches the kernels on this machine and torch."""
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory(build_name(), verbose=False))


def _build():
    if os.environ.get("FLEXGEN_SPARPR_CPU_KERNEL", "1") == "0":
        return None, "FLEXGEN_SPARPR_CPU_KERNEL=0"
    if sys.platform != "linux" or not has_simd():
        return None, "not a Linux CPU with AVX-512 or AVX2"
    try:
        from torch.utils.cpp_extension import load
        with _exclusive(build_folder()):
            mod = load(name=build_name(), sources=[str(p) for p in _SRCS], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                       verbose=False)
    except Exception as e:  # no compiler or ninja, a failed build: torch's kernel serves
        return None, f"build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    return (mod, None) if mod.simd() else (None, "built without AVX-512 or AVX2")


class _exclusive:
    """One build of `folder` at a time across processes, by an advisory lock the kernel drops when its
    holder dies. torch's own lock is a file that outlives a build killed midway (a timeout, a signal),
    and every later load waits on it forever; under this lock no live build holds that file, so one
    found there is stale and removed."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.folder / "flexgen_sparpr.flock", os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        (self.folder / "lock").unlink(missing_ok=True)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a decode step's q: [B, H, 1, D] over k, v: [B, Hkv, T, D] can go to the kernel (CPU; D 64
    or 128; at most 8 query heads per KV head; K and V of one float dtype, rows contiguous, one row
    stride)."""
    return (q.device.type == "cpu" and q.shape[-1] in (64, 128) and q.shape[1] // k.shape[1] <= 8
            and k.dtype == v.dtype and k.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(2) == v.stride(2) and kernel() is not None)


def built_for() -> str | None:
    """The instruction set the built kernels use, from the build itself ("AVX-512", "AVX2"), or None
    where they are not built (`why_not()` says why)."""
    mod = kernel()
    return None if mod is None else {512: "AVX-512", 256: "AVX2"}.get(mod.simd_width(), f"{mod.simd_width()}-bit")


def say_kernel(say) -> None:
    """Build the kernel (if it can be) and say whether decode attention uses it."""
    if built_for() is not None:
        say(f"CPU decode-attention kernel: built ({built_for()}); decode attention on the CPU uses it")
    else:
        say(f"CPU decode-attention kernel: not used ({why_not()}); decode attention stays on torch's kernel")
