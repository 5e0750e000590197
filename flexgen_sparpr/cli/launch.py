"""Who this rank is in a distributed run, and joining the others (torch.distributed).

A rank learns its place from upstream FlexGen's flags (`--head-ip --port --world-size --rank
--local-rank`, or `--use-mpi`: OpenMPI's OMPI_COMM_WORLD_* variables, as upstream reads them), else
from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; multi-node
through torchrun's --nnodes --rdzv-endpoint). Joining: the rendezvous store first (rank 0 hosts it
on --head-ip:--port; under torchrun the launcher's), where every rank says whether it has CUDA, then
the process group: NCCL when every rank has CUDA (or --comm-device gpu), gloo otherwise (or
--comm-device cpu). Every wait is bounded by --dist-timeout.
"""
from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError

DIST_FLAGS = ("head_ip", "port", "world_size", "rank", "local_rank", "use_mpi", "comm_device",
              "num_inner_iterations", "async_comm", "stage_layers", "dist_timeout")
DEFAULT_TIMEOUT = 60.0


def add_dist_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline parallelism (upstream dist_flex_opt's flags, plus ours; torchrun sets "
                             "the rank, world size and address itself)")
    g.add_argument("--head-ip", help="address of rank 0, which hosts the rendezvous (default: torchrun's MASTER_ADDR)")
    g.add_argument("--port", type=int, help="its port (default: torchrun's MASTER_PORT)")
    g.add_argument("--world-size", type=int, help="number of ranks = pipeline stages (default: torchrun's, else 1)")
    g.add_argument("--rank", type=int, help="this rank, 0 .. world size - 1 (default: torchrun's)")
    g.add_argument("--local-rank", type=int, help="this rank's CUDA device index on its node (default: torchrun's, else 0)")
    g.add_argument("--use-mpi", action="store_true", default=None,
                   help="take the rank, world size and local rank from OpenMPI's OMPI_COMM_WORLD_* variables (mpirun)")
    g.add_argument("--comm-device", choices=["cpu", "gpu"],
                   help="where stage boundaries' messages go: gpu (NCCL) or cpu (gloo) (default: gpu when every rank "
                        "has CUDA, else cpu)")
    g.add_argument("--num-inner-iterations", type=int,
                   help="upstream's micro-batches: the batch is gpu-batch-size x num-gpu-batches x this, each block of "
                        "num-gpu-batches GPU batches one micro-batch (default: none, the batch is one block and each "
                        "GPU batch a micro-batch)")
    g.add_argument("--async-comm", action="store_true", default=None,
                   help="accepted for upstream's launch lines: stage boundaries always send asynchronously")
    g.add_argument("--stage-layers", help="decoder layers per stage, one count per rank, e.g. 5,7 (default: even by "
                   "weight bytes; --policy auto chooses them from the hardware file)")
    g.add_argument("--dist-timeout", type=float, help=f"seconds any rank waits for another before giving up and "
                   f"naming it (default {DEFAULT_TIMEOUT:g})")


@dataclass(frozen=True)
class Launch:
    """This rank's place: rank, world size, CUDA device index on its node, where to meet (a
    tcp://host:port URL, env:// under torchrun, None for one rank), the comm device asked for
    (None: chosen) and the timeout in seconds."""

    rank: int
    world_size: int
    local_rank: int
    url: str | None
    comm_device: str | None
    timeout: float

    @property
    def timeout_td(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout)

    @property
    def where(self) -> str:
        return self.url.removeprefix("tcp://") if self.url and self.url.startswith("tcp://") else \
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} (torchrun)"


MAX_TIMEOUT = 7 * 24 * 3600.0


def _env_int(names: tuple[str, ...], env) -> int | None:
    for n in names:
        if env.get(n, "").strip():
            try:
                return int(env[n])
            except ValueError:
                raise ConfigError(f"environment variable {n}={env[n]!r} is not an integer") from None
    return None


def launch_from(args: dict, env=os.environ) -> Launch:
    """The launch from the dist flags (their dest names) and the environment; ConfigError when
    they do not add up."""
    timeout = args.get("dist_timeout")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if not 0 < timeout <= MAX_TIMEOUT:  # a timedelta overflows past ~1e9 days; inf and NaN are no timeout
        raise ConfigError(f"--dist-timeout must be > 0 seconds, at most {MAX_TIMEOUT:g} (a week) (got {timeout:g})")
    if args.get("use_mpi"):
        names = {k: f"OMPI_COMM_WORLD_{k.upper()}" for k in ("rank", "size", "local_rank")}
        vals = {k: _env_int((n,), env) for k, n in names.items()}
        if None in vals.values():
            raise ConfigError("--use-mpi: OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK are not all set (launch with "
                              "OpenMPI's mpirun)")
        rank, world, local = vals["rank"], vals["size"], vals["local_rank"]
    else:
        rank = args["rank"] if args.get("rank") is not None else _env_int(("RANK",), env)
        world = args["world_size"] if args.get("world_size") is not None else _env_int(("WORLD_SIZE",), env)
        local = args["local_rank"] if args.get("local_rank") is not None else _env_int(("LOCAL_RANK",), env)
    world = 1 if world is None else world
    rank = 0 if rank is None and world == 1 else rank
    if world < 1:
        raise ConfigError(f"--world-size must be >= 1 (got {world})")
    if rank is None:
        raise ConfigError(f"a world of {world} ranks needs this rank's --rank (torchrun sets RANK)")
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is outside the world of {world} ranks (0 .. {world - 1})")
    if local is not None and local < 0:
        raise ConfigError(f"--local-rank must be >= 0 (got {local})")
    if args.get("num_inner_iterations") is not None and args["num_inner_iterations"] < 1:
        raise ConfigError(f"--num-inner-iterations must be >= 1 (got {args['num_inner_iterations']})")
    url = None
    if world > 1:
        head, port = args.get("head_ip"), args.get("port")
        if head is not None and port is not None:
            if not 0 < port < 65536:
                raise ConfigError(f"--port must be in 1..65535 (got {port})")
            url = f"tcp://{head}:{port}"
        elif head is None and port is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            url = "env://"
        else:
            raise ConfigError("a distributed run needs --head-ip and --port (rank 0's address), or torchrun's "
                              "MASTER_ADDR and MASTER_PORT")
    return Launch(rank, world, local or 0, url, args.get("comm_device"), float(timeout))


def label(argv: list[str] | None, env=os.environ) -> str:
    """`rank N: ` for this process's error lines, read before the flags are checked ('' if unknown)."""
    argv = list(argv or [])
    for flag in ("--rank",):
        for i, a in enumerate(argv):
            v = a.split("=", 1)[1] if a.startswith(flag + "=") else argv[i + 1] if a == flag and i + 1 < len(argv) else None
            if v is not None and v.isdigit():
                return f"rank {v}: "
    for n in ("OMPI_COMM_WORLD_RANK", "RANK") if "--use-mpi" in argv else ("RANK",):
        if env.get(n, "").isdigit():
            return f"rank {env[n]}: "
    return ""


def rendezvous(launch: Launch):
    """The store every rank meets at (rank 0 hosts it, or torchrun's), all ranks there; ConfigError
    when it cannot be reached within the timeout."""
    import torch.distributed as dist
    try:
        if launch.url == "env://":
            store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world_size, timeout=launch.timeout_td))
        else:
            host, port = launch.url.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), launch.world_size, is_master=launch.rank == 0,
                                  timeout=launch.timeout_td)
    except (RuntimeError, OSError, ValueError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise ConfigError(f"the distributed run cannot start: rank {launch.rank} could not meet the others at "
                          f"{launch.where} within {launch.timeout:g} s ({' '.join(str(e).split())[:160]})") from None
    # a launcher's store outlives a restart of its workers: keys of an earlier attempt stay apart
    return dist.PrefixStore(f"flexgen-sparpr/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def choose_backend(launch: Launch, store) -> tuple[str, torch.device]:
    """(backend, comm device) agreed by every rank: NCCL on the CUDA device when every rank has
    CUDA (or --comm-device gpu), else gloo on the CPU."""
    has_cuda = torch.cuda.is_available()
    store.set(f"cuda/{launch.rank}", "1" if has_cuda else "0")
    all_cuda = all(store.get(f"cuda/{r}") == b"1" for r in range(launch.world_size))
    want = launch.comm_device or ("gpu" if all_cuda else "cpu")
    if want == "gpu":
        if not all_cuda:
            lacking = [r for r in range(launch.world_size) if store.get(f"cuda/{r}") != b"1"]
            raise ConfigError(f"--comm-device gpu needs CUDA on every rank; rank(s) {', '.join(map(str, lacking))} "
                              "have none (use --comm-device cpu)")
        if not torch.distributed.is_nccl_available():
            raise ConfigError("--comm-device gpu needs NCCL, which this torch build lacks (use --comm-device cpu)")
        torch.cuda.set_device(launch.local_rank)
        return "nccl", torch.device("cuda", launch.local_rank)
    if not torch.distributed.is_gloo_available():
        raise ConfigError("the gloo backend is missing from this torch build: the CPU ranks cannot talk")
    return "gloo", torch.device("cpu")


def init_group(launch: Launch, store, backend: str) -> None:
    """The default process group over the store, its collectives bounded by the timeout."""
    import torch.distributed as dist
    if backend == "nccl":  # waits raise on the timeout instead of hanging the rank
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=launch.rank,
                                world_size=launch.world_size, timeout=launch.timeout_td)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"the distributed run cannot start: the {backend} backend failed on rank {launch.rank} "
                          f"({' '.join(str(e).split())[:200]})") from None
