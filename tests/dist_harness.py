"""Pipeline runs for the tests: tiny 4-layer HF models made locally, the jobs the ranks run, and
the ranks themselves (spawned processes over gloo on 127.0.0.1, one torch thread each; one
process group serves every job, so a whole matrix costs one launch per world size)."""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch

LAYERS = 4
N_NEW = 6


def save_tiny(kind: str, path: Path) -> Path:
    """A tiny random HF checkpoint with LAYERS layers (enough for 2 and 3 stages)."""
    torch.manual_seed(0)
    if kind == "opt":
        from transformers import OPTConfig, OPTForCausalLM
        model = OPTForCausalLM(OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=LAYERS,
                                         ffn_dim=128, vocab_size=300, max_position_embeddings=256,
                                         word_embed_proj_dim=64))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             num_hidden_layers=LAYERS, intermediate_size=128, vocab_size=300,
                                             max_position_embeddings=512, tie_word_embeddings=False))
    model.eval().save_pretrained(path)
    return path


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 11, 7, 1, 9, 5, 2, 13][:n]
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in lens]


DISK = dict(cache_gpu_percent=0, cache_cpu_percent=0)  # every KV block on the disk tier
SPARPR = ("sparpr", {"keep_ratio": 0.5})


def job(model: str, gbs: int, ngb: int, micro_batches: int, kv=("dense", {}), sample=None, seed: int = 1,
        **placement) -> dict:
    """One generation: model kind, batch split, micro-batches, KV policy and knobs, sampling."""
    return dict(model=model, policy=dict(gpu_batch_size=gbs, num_gpu_batches=ngb, **(placement or DISK)),
                micro_batches=micro_batches, kv=kv, sample=sample, prompts=prompts(gbs * ngb, seed))


def engine_args(j: dict, model_dirs: dict, offload: Path):
    """(source, Policy, EngineConfig) of a job; SparPR gets fixed costs (no machine probe), so
    every process decides alike."""
    from flexgen_sparpr.engine.config import EngineConfig, Policy
    from flexgen_sparpr.runtime.costs import CostModel
    from flexgen_sparpr.weights.resolve import resolve_source
    name, args = j["kv"]
    if name == "sparpr":
        args = {**args, "costs": CostModel(disk_read_Bps=1e9, matmul_flops={"float32": 1e9},
                                           matmul_latency_s={"float32": 0.0}, live=False)}
    cfg = EngineConfig(device="cpu", dtype="float32", block_size=4, offload_dir=str(offload), kv_policy=name,
                       policy_args=args)
    return resolve_source(str(model_dirs[j["model"]]), ""), Policy(**j["policy"]), cfg


def sampler(j: dict):
    from flexgen_sparpr.engine.sampling import Sampler
    return Sampler(**j["sample"]) if j["sample"] else None


def single_process(j: dict, model_dirs: dict, offload: Path):
    """(tokens, logits [n, B, V]) of the job in this process, FlexGen's schedule, no pipeline."""
    from flexgen_sparpr.engine.executor import Engine
    with Engine(*engine_args(j, model_dirs, offload)) as eng:
        r = eng.generate(j["prompts"], N_NEW, sampler(j), keep_logits=True)
    return r.tokens, torch.stack(r.logits)


def run_rank(rank: int, world: int, port: int, jobs: dict, model_dirs: dict, out: str) -> None:
    """One rank: join the group through the test's store, run every job on this rank's stage
    (split even by bytes), save {job: (tokens, logits or None, offload dir empty after)}."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from flexgen_sparpr.engine.executor import Engine
    from flexgen_sparpr.engine.pipeline import Stage, StageLink
    from flexgen_sparpr.runtime.stages import even_by_bytes
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for name, j in jobs.items():
            offload = Path(out) / f"offload-{rank}"
            src, policy, cfg = engine_args(j, model_dirs, offload)
            split = even_by_bytes(src.spec, world)
            stage = Stage(rank, world, split.first_layer(rank), split.counts[rank])
            link = StageLink(stage, j["micro_batches"])
            with Engine(src, policy, cfg, micro_batches=j["micro_batches"], link=link) as eng:
                r = eng.generate(j["prompts"], N_NEW, sampler(j), keep_logits=True)
            left = sorted(p.name for p in offload.glob("*")) if offload.exists() else []
            logits = torch.stack(r.logits) if r.logits else None
            results[name] = (r.tokens, logits, left, link.stats.to_dict())
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def run_pipeline(world: int, jobs: dict, model_dirs: dict, out: Path) -> list[dict]:
    """Spawn `world` ranks running every job; their results, per rank."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    out.mkdir(parents=True, exist_ok=True)
    # the test holds the store on a free port, so no port is guessed
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(run_rank, args=(world, store.port, jobs, {k: str(v) for k, v in model_dirs.items()},
                                           str(out)), nprocs=world, start_method="spawn")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
