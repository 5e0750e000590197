"""Behaviour fingerprint for refactors: greedy tokens, bytes moved per link and the KV policy's
statistics of a fixed set of runs through the CLI (`flexgen-sparpr run`), so that a change that
must not change behaviour can be checked run for run.

    python scripts/fingerprint.py --out results/fingerprint/before.json        # on the old code
    python scripts/fingerprint.py --compare results/fingerprint/before.json    # on the new code

Runs: every KV policy (and SparPR's ablations, SparPR with --cold-codec dkv, --attn-sparsity)
on tiny random OPT and Llama models made here (the test suite's, seeded), with the KV cache
resident, on disk, and split over compute / CPU / disk, two left-padded prompts, several GPU
batches, compressed cache, speculative prefetch, --policy auto and a config file; then the
SmolLM2-135M passkey prompt at 2k tokens, dense and SparPR at keep 0.1 (skipped when SmolLM2 is
not prepared); then the upstream SparPR hook's selection on random inputs. SparPR's cost model
is pinned to the hardware file's figures (no live bandwidth), so every run is deterministic.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import machine_info, timer  # noqa: E402
from flexgen_sparpr.utils.files import write_atomic  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

HW = str(REPO / "configs/hardware/cpu-only.yaml")
PROMPTS = [list(range(3, 43)), list(range(50, 79))]  # 40 and 29 tokens: the second is left-padded
PLACEMENTS = {"resident": "100 0 100 0 100 0", "disk": "100 0 0 0 100 0", "split": "100 0 25 25 100 0"}
POLICIES = {
    "dense": [],
    "sparpr": ["--kv-policy", "sparpr", "--keep-ratio", "0.5", "--hardware", HW],
    "quest": ["--kv-policy", "quest", "--keep-ratio", "0.5"],
    "h2o": ["--kv-policy", "h2o", "--keep-ratio", "0.5"],
    "streaming-llm": ["--kv-policy", "streaming-llm", "--keep-ratio", "0.5"],
    "flexgen-topk": ["--kv-policy", "flexgen-topk", "--keep-ratio", "0.5"],
    "dkv": ["--kv-policy", "dkv", "--dkv-rank", "2", "--dkv-residuals", "2", "--dkv-topk", "1"],
    "sparpr+dkv": ["--kv-policy", "sparpr", "--keep-ratio", "0.5", "--hardware", HW, "--cold-codec", "dkv",
                   "--dkv-rank", "2", "--dkv-residuals", "2"],
}
EXTRAS = {  # name -> (placement, flags)
    "attn-sparsity": ("disk", ["--attn-sparsity", "0.5"]),
    "compress-cache-dense": ("split", ["--compress-cache"]),
    "compress-cache-sparpr": ("split", POLICIES["sparpr"] + ["--compress-cache"]),
    "sparpr-2gb": ("disk", POLICIES["sparpr"] + ["--num-gpu-batches", "2", "--gpu-batch-size", "1"]),
    "quest-2gb": ("disk", POLICIES["quest"] + ["--num-gpu-batches", "2", "--gpu-batch-size", "1"]),
    "h2o-2gb": ("split", POLICIES["h2o"] + ["--num-gpu-batches", "2", "--gpu-batch-size", "1"]),
    "sparpr-speculative": ("disk", POLICIES["sparpr"] + ["--speculative-prefetch"]),
    "sparpr+dkv-speculative": ("disk", POLICIES["sparpr+dkv"] + ["--speculative-prefetch"]),
    "sparpr-quest-only": ("disk", POLICIES["sparpr"] + ["--quest-only"]),
    "sparpr-no-recompute": ("disk", POLICIES["sparpr"] + ["--no-recompute", "--keep-ratio", "0.25"]),
    "sparpr-no-fallback": ("disk", POLICIES["sparpr"] + ["--no-fallback", "--no-dynamic-budget"]),
    "sparpr-ckpt-always": ("disk", POLICIES["sparpr"] + ["--checkpoints", "always", "--min-keep", "0.2",
                                                         "--gamma", "0.5"]),
    "sparpr-summary0": ("split", POLICIES["sparpr"] + ["--summary-tokens", "0"]),
    "sparpr-probe-resident": ("resident", ["--kv-policy", "sparpr", "--keep-ratio", "0.5"]),
    "dkv-sparse-prefill": ("disk", POLICIES["dkv"] + ["--dkv-sparse-prefill", "--dkv-route", "mean"]),
    "dkv-error-pick": ("split", POLICIES["dkv"] + ["--dkv-residual-pick", "error", "--dkv-recent", "2"]),
    "dkv-mixed-pick": ("disk", POLICIES["dkv"] + ["--dkv-residual-pick", "mixed", "--dkv-topk", "0"]),
    "overlap-off-sparpr": ("disk", POLICIES["sparpr"] + ["--overlap", "false"]),
    "sep-layer-off-quest": ("split", POLICIES["quest"] + ["--sep-layer", "false"]),
    "cpu-cache-compute": ("split", ["--cpu-cache-compute"]),
}


def tiny_models(root: Path) -> dict[str, Path]:
    """The test suite's tiny random OPT and Llama (tests/conftest.py), saved under root."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM
    out = {}
    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128,
                    vocab_size=300, max_position_embeddings=256, word_embed_proj_dim=64)
    OPTForCausalLM(cfg).eval().save_pretrained(root / "tiny-opt")
    out["opt"] = root / "tiny-opt"
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=300, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(root / "tiny-llama")
    out["llama"] = root / "tiny-llama"
    return out


def pin_costs() -> None:
    """SparPR's cost model keeps the hardware file's (or the cached probe's) disk bandwidth instead
    of the engine's live timings, which differ from run to run."""
    from flexgen_sparpr.runtime.costs import CostModel
    CostModel.disk_Bps = lambda self, devices: self.disk_read_Bps


def digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_one(argv: list[str], offload: Path) -> dict:
    from flexgen_sparpr.cli.run import run
    off = offload / "run"
    shutil.rmtree(off, ignore_errors=True)
    with contextlib.redirect_stdout(io.StringIO()):
        out = run(argv + ["--offload-dir", str(off), "--verbose", "0", "--no-log"])
    shutil.rmtree(off, ignore_errors=True)
    stats = out.get("kv_policy_stats")
    return {"tokens": out["output_ids"], "bytes_moved": out["bytes_moved"],
            "stats": json.loads(json.dumps(stats, default=str)) if stats is not None else None}


def tiny_runs(models: dict[str, Path], ids_file: Path) -> dict[str, list[str]]:
    common = ["--prompt-ids-file", str(ids_file), "--gpu-batch-size", "2", "--gen-len", "8", "--block-size", "8",
              "--device", "cpu"]
    runs = {}
    for m, d in models.items():
        for place, pct in PLACEMENTS.items():
            for pol, flags in POLICIES.items():
                runs[f"{m}/{place}/{pol}"] = ["--model", str(d), "--path", "", "--percent", *pct.split(), *common,
                                              *flags]
        for name, (place, flags) in EXTRAS.items():
            argv = ["--model", str(d), "--path", "", "--percent", *PLACEMENTS[place].split(), *common, *flags]
            if "--gpu-batch-size" in flags:  # the extra's own split (2 x 1) replaces the common 2 x 1
                i = argv.index("--gpu-batch-size")
                del argv[i:i + 2]
            runs[f"{m}/{place}/{name}"] = argv
        runs[f"{m}/auto/sparpr"] = ["--model", str(d), "--path", "", "--policy", "auto", *common,
                                    *POLICIES["sparpr"]]
        runs[f"{m}/config/cache-on-disk"] = ["--config", str(REPO / "configs/examples/cache-on-disk.yaml"),
                                             "--model", str(d), "--path", "", *common]
    return runs


def needle_runs(ids_file: Path) -> dict[str, list[str]]:
    common = ["--model", "smollm2-135m", "--prompt-ids-file", str(ids_file), "--gpu-batch-size", "1",
              "--gen-len", "8", "--device", "cpu", "--warmup", "false"]
    sparpr = ["--kv-policy", "sparpr", "--keep-ratio", "0.1", "--hardware", HW]
    return {"smollm2/needle2k/resident/dense": common,
            "smollm2/needle2k/resident/sparpr-0.1": common + sparpr,
            "smollm2/needle2k/disk/sparpr-0.1": common + ["--percent", "100", "0", "0", "0", "100", "0"] + sparpr,
            "smollm2/needle2k/disk/sparpr-0.1+dkv": common + ["--percent", "100", "0", "0", "0", "100", "0"] + sparpr
            + ["--cold-codec", "dkv"]}


def needle_ids(path: Path) -> bool:
    from transformers import AutoTokenizer

    from flexgen_sparpr.bench.needle_prompt import NeedlePrompts, random_key
    from flexgen_sparpr.weights.resolve import smollm2_dir
    d = smollm2_dir()
    if not (d / "config.json").exists():
        return False
    rng = random.Random(7)
    prompts = NeedlePrompts(AutoTokenizer.from_pretrained(str(d)), REPO / "tests/data/alice29.txt")
    needle = prompts.build(2048, 0.25, random_key(rng, 5), rng)
    path.write_text(json.dumps([needle.ids]))
    return True


def hook_cases() -> dict:
    """The upstream hook's block choice (pick_blocks over its summaries) on random inputs, with left padding."""
    from flexgen_sparpr.kv.policies.sparpr import SparPR
    from flexgen_sparpr.upstream.sparpr_hook import SparPRConfig, _Summaries, pick_blocks
    out = {}
    g = torch.Generator().manual_seed(3)
    for case, (b, h, d, s, bs, keep, pads) in enumerate([(2, 4, 8, 97, 8, 0.3, [0, 13]), (3, 2, 16, 150, 16, 0.5,
                                                         [5, 0, 40]), (1, 4, 8, 65, 4, 0.1, [0])]):
        q = torch.randn(b, h, 1, d, generator=g)
        k = torch.randn(s - 1, b * h, d, generator=g)  # k: [S-1, B*H, D] the cached keys
        mask = torch.arange(s)[None, :] >= torch.tensor(pads)[:, None]
        cfg = SparPRConfig(SparPR(keep_ratio=keep), block_size=bs)
        summ = _Summaries(s, b * h, d, b, cfg.run, torch.float32, torch.device("cpu"))
        summ.add(k, mask[:, :s - 1], 0)
        out[f"hook/{case}"] = pick_blocks(q, summ, mask, cfg)
    return out


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprint here (JSON)")
    ap.add_argument("--compare", help="compare with this fingerprint and list every run that differs")
    ap.add_argument("--only", default="", help="substring: run only the runs whose name holds it")
    ap.add_argument("--offload-dir", default="/tmp/offload-fingerprint", help="scratch disk tier (removed)")
    args = ap.parse_args(argv)
    if not args.out and not args.compare:
        die("give --out, --compare or both")
    pin_costs()
    torch.manual_seed(0)
    offload = Path(args.offload_dir).expanduser()
    results = {}
    with tempfile.TemporaryDirectory() as tmp, timer() as wall:
        tmp = Path(tmp)
        ids = tmp / "prompts.json"
        ids.write_text(json.dumps(PROMPTS))
        runs = tiny_runs(tiny_models(tmp), ids)
        if needle_ids(tmp / "needle.json"):
            runs |= needle_runs(tmp / "needle.json")
        for name, argv_ in runs.items():
            if args.only in name:
                results[name] = run_one(argv_, offload)
                print(f"{name}: {digest(results[name])}", flush=True)
        if args.only in "hook":
            results |= hook_cases()
    shutil.rmtree(offload, ignore_errors=True)
    payload = {"config": {"runs": runs if not args.only else {k: v for k, v in runs.items() if args.only in k},
                          "machine": machine_info(), "wall_s": round(wall(), 1)},
               "results": results}
    if args.out:
        write_atomic(Path(args.out), json.dumps(payload, indent=1, default=str) + "\n")
    if args.compare:
        old = json.loads(Path(args.compare).read_text())["results"]
        diff = [k for k in results if k in old and old[k] != results[k]]
        missing = [k for k in old if k not in results and args.only in k]
        for k in diff:
            print(f"DIFFERS: {k}")
            if isinstance(results[k], dict):
                for part in results[k]:
                    if old[k].get(part) != results[k][part]:
                        print(f"  {part}: {json.dumps(old[k].get(part), default=str)[:300]}\n"
                              f"  now: {json.dumps(results[k][part], default=str)[:300]}")
        print(f"{len(results) - len(diff)} of {len(results)} identical; {len(diff)} differ; "
              f"{len(missing)} in the old fingerprint not run")
        if diff or missing:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
