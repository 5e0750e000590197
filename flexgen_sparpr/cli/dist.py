"""`python -m flexgen_sparpr.dist_flex_opt`: pipeline parallelism over torch.distributed, one rank
per stage, launched by torchrun (or upstream's --head-ip/--port/--world-size/--rank flags).

Every rank resolves the same flags (config/options.py), joins the others (cli/launch.py), checks that
they all resolved the same options (cli/peers.py), takes its stage (the split: --stage-layers, or
even by weight bytes, or --policy auto's choice, made on rank 0 and shared), then runs cli/run.py's
set_up and generate on its layers with a StageLink to its neighbours (engine/pipeline.py). Rank 0
writes the summary, the `fo-...` log and --output-json (run's report, plus a `pipeline` section:
each stage's layers, timings and idle time, bytes per link, peak memory); the other ranks print
nothing but their error line, and write nothing to the current folder.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from ..engine.config import EngineConfig, Policy
from ..engine.pipeline import Stage, StageLink
from ..errors import ConfigError
from ..runtime.stages import StagePlan, StageSplit, check_stages, even_by_bytes, parse_stage_layers
from .parser import build_parser
from ..utils.guard import describe
from .launch import DIST_FLAGS, Launch, add_dist_flags, choose_backend, init_group, launch_from, rendezvous
from ..config.options import RunOptions, resolve, workload_for
from .peers import Peers
from .run import engine_report, generate, report, set_up

PROG = "python -m flexgen_sparpr.dist_flex_opt"


def parser():
    p = build_parser(PROG)
    p.description = ("Pipeline-parallel offloaded generation: one rank per stage, launched by torchrun "
                     "(torchrun --nproc-per-node N -m flexgen_sparpr.dist_flex_opt <flags>) or with upstream "
                     "dist_flex_opt's flags on each node.")
    add_dist_flags(p)
    return p


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """This rank's part in the split: which stage it is, how many micro-batches a step runs as,
    and how the split is chosen (explicit, even by bytes, or --policy auto on rank 0)."""

    launch: Launch
    micro_batches: int
    stage_layers: str | None
    peers: Peers | None

    def place(self, opts: RunOptions, policy: Policy, ecfg: EngineConfig, spec) -> tuple:
        """(policy, engine config, Stage, plan, hardware) of this rank, for cli/run.py set_up."""
        world, rank = self.launch.world_size, self.launch.rank
        check_stages(spec, world)
        plan = hw = None
        if opts.policy == "auto":
            plan, hw = self._auto(opts, policy, ecfg, spec)
            split = plan.split
            pct = plan.percents[rank]
            policy = dataclasses.replace(policy, w_gpu_percent=pct[0], w_cpu_percent=pct[1], cache_gpu_percent=pct[2],
                                         cache_cpu_percent=pct[3], act_gpu_percent=pct[4], act_cpu_percent=pct[5])
            ecfg = dataclasses.replace(ecfg, kv_policy=ecfg.make_kv_policy().for_machine(hw))
        elif self.stage_layers:
            split = parse_stage_layers(self.stage_layers, spec, world)
        else:
            split = even_by_bytes(spec, world)
        return policy, ecfg, Stage(rank, world, split.first_layer(rank), split.counts[rank]), plan, hw

    def _auto(self, opts, policy, ecfg, spec) -> tuple[StagePlan, object]:
        """Rank 0 plans with its hardware file (or its probe), within its share of what its host
        has free (runtime/capacity.py: every stage is planned for that share), every rank follows
        its plan."""
        from ..runtime.capacity import live_capacity, planning_hardware
        from ..runtime.placement import NoPlacementFits
        from ..runtime.profile import hardware_from_probe
        from ..runtime.stages import choose_stages
        hw = opts.hardware
        if self.launch.rank == 0:
            device = ecfg.torch_device()
            hw = hw or hardware_from_probe(device, ecfg.torch_dtype(device), ecfg.offload_dir)
            hw = planning_hardware(hw, live_capacity(device, ecfg.offload_dir))
            dtype = ecfg.dtype if ecfg.dtype != "auto" else ("float16" if hw.is_cuda else "float32")
            try:
                plan = choose_stages(workload_for(spec, opts.prompt_len, opts.gen_len, policy, ecfg, dtype), hw,
                                     self.launch.world_size, self.micro_batches, policy.gpu_batch_size)
            except (NoPlacementFits, ValueError) as e:
                raise ConfigError(f"--policy auto: {e}") from None
            shared = {"plan": dataclasses.asdict(plan), "hardware": dataclasses.asdict(hw)}
        else:
            shared = None
        if self.peers is not None:
            shared = self.peers.share("auto-plan", shared)
        d = dict(shared["plan"])
        d["split"] = StageSplit(tuple(d["split"]["counts"]))
        d["percents"] = tuple(tuple(p) for p in d["percents"])
        d["stage_decode_s"] = tuple(d["stage_decode_s"])
        from ..runtime.hardware import Hardware
        return StagePlan(**d), hw if hw is not None else Hardware(**shared["hardware"])


def _split_args(argv) -> tuple[dict, dict]:
    """(run flags, dist flags) as dicts of the values given."""
    given = vars(parser().parse_args(argv))
    dist = {k: given.pop(k) for k in DIST_FLAGS}
    return given, dist


def _options_blob(opts: RunOptions, policy: Policy, ecfg: EngineConfig, dist: dict) -> dict:
    """What every rank must agree on: the resolved options and the pipeline's shape."""
    same = {k: v for k, v in dist.items() if k not in ("rank", "local_rank", "head_ip", "port", "use_mpi")}
    return {"run": dataclasses.asdict(opts), "policy": dataclasses.asdict(policy), "engine": engine_report(ecfg),
            "pipeline": same}


def _with_inner_iterations(policy: Policy, dist: dict) -> tuple[Policy, int]:
    """(policy, micro-batches): upstream's --num-inner-iterations I runs I blocks of the GPU batches
    as I micro-batches; without it each GPU batch of the one block is a micro-batch."""
    inner = dist.get("num_inner_iterations")
    if inner is None:
        return policy, policy.num_gpu_batches
    return dataclasses.replace(policy, num_gpu_batches=policy.num_gpu_batches * inner), inner


def run_dist(argv=None) -> dict | None:
    given, dist = _split_args(argv)
    launch = launch_from(dist)
    opts, policy, ecfg = resolve(given)
    policy, micro = _with_inner_iterations(policy, dist)
    if launch.local_rank and ecfg.device == "auto" and torch.cuda.is_available():
        ecfg = dataclasses.replace(ecfg, device=f"cuda:{launch.local_rank}")
    blob = _options_blob(opts, policy, ecfg, dist)
    if launch.rank != 0:  # only rank 0 reports, prints and writes
        opts = dataclasses.replace(opts, output_json=None, no_log=True, verbose=0)
    if launch.world_size == 1:
        pipe = Pipeline(launch, micro, dist.get("stage_layers"), None)
        s = set_up(opts, policy, ecfg, pipe)
        return report(s, generate(s))
    store = rendezvous(launch)
    peers = Peers(store, launch.rank, launch.world_size, launch.timeout,
                  "rank 0" if launch.url != "env://" else "the torchrun launcher")
    failed = False
    try:
        peers.check_same_options(blob)
        backend, comm = choose_backend(launch, store)
        init_group(launch, store, backend)
        pipe = Pipeline(launch, micro, dist.get("stage_layers"), peers)
        try:  # every check before loading, on every rank (the memory check counts this host's ranks)
            s = set_up(opts, policy, ecfg, pipe)
        except BaseException as e:
            peers.ready(describe(e)[1])  # the others stop before loading too; this rank's own error follows
            raise
        peers.ready(None)
        link = StageLink(s.stage, micro, comm)
        g = generate(s, link)
        mine = _stage_report(s, g, link, backend)
        reports = peers.gather("stage-report", mine)
        if reports is None:
            return None
        g = dataclasses.replace(g, bytes_moved=_summed([r["bytes_moved"] for r in reports]), kv_stats=None)
        return report(s, g, {"pipeline": {"world_size": launch.world_size, "backend": backend,
                                          "micro_batches": micro, "stage_layers": [r["num_layers"] for r in reports],
                                          "stages": reports}})
    except BaseException as e:  # noqa: BLE001  (the rank's one failure line names the rank that failed)
        failed = True
        raise peers.explain(e, ecfg.offload_dir) from None
    finally:
        peers.leave(failed)
        _leave()


def _stage_report(s, g, link: StageLink, backend: str) -> dict:
    st = link.stage
    out = {"rank": st.index, "first_layer": st.first_layer, "num_layers": st.num_layers,
           "percent": [s.policy.w_gpu_percent, s.policy.w_cpu_percent, s.policy.cache_gpu_percent,
                       s.policy.cache_cpu_percent, s.policy.act_gpu_percent, s.policy.act_cpu_percent],
           "device": g.device, "backend": backend, "peak_memory": g.memory, "bytes_moved": g.bytes_moved,
           "link": {f"stage{st.index}->stage{st.index + 1}": link.stats.bytes_sent} if not st.is_last else {},
           "timings": link.stats.to_dict()}
    if g.kv_stats is not None:
        out["kv_policy_stats"] = json.loads(json.dumps(g.kv_stats, default=str))
    return out


def _summed(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _leave() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass
