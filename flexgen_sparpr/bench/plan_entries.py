"""The entries of the results plan (bench/plan.py): speed, serving and modelled figures here,
retrieval and perplexity grids in plan_fidelity.py, and the cited results no script regenerates
(EXCEPTIONS, each with its reason)."""
from __future__ import annotations

from .plan import Entry
from .plan_fidelity import FIDELITY

_THROTTLED = "root and a cgroup v1 blkio read throttle (bench/throttle.py); an hour or more per grid"


def _pair(folder: str, stem: str) -> tuple[str, str]:
    return (f"{folder}/{stem}.json", f"{folder}/{stem}.md")


def _sparpr(name: str, folder: str, *flags: str) -> Entry:
    return Entry(name, "scripts/bench_sparpr.py", (*flags, "--quiet", "--out", folder), _pair(folder, "bench"),
                 ("--contexts", "256", "--gen-len", "4", "--quiet", "--offload-dir", "{out}/offload", "--out", "{out}")
                 if not flags else None)


def _throttled(stem: str, *flags: str) -> Entry:
    return Entry(f"throttled-{stem}", "scripts/bench_throttled.py",
                 (*flags, "--quiet", "--out", "results/sparpr/throttled", "--stem", stem),
                 _pair("results/sparpr/throttled", stem), needs=_THROTTLED)


def _dkv(name: str, *flags: str, quick: bool = False) -> Entry:
    folder = f"results/dkv/{name}"
    return Entry(f"dkv-{name}", "scripts/bench_dkv.py", (*flags, "--out", folder), _pair(folder, "bench"),
                 ("--lengths", "512", "--trials", "1", "--configs", "dense,dkv", "--gen-len", "4", "--out", "{out}")
                 if quick else None)


ENGINE = [
    Entry("decode-vs-hf", "scripts/bench_decode.py", ("--threads", "2", "--out", "results"),
          _pair("results", "decode_vs_hf"),
          ("--lengths", "128", "--batches", "1", "--gen-len", "4", "--threads", "1", "--out", "{out}")),
    Entry("step", "scripts/bench_step.py", ("--out", "results/step"), _pair("results/step", "step"),
          ("--lengths", "256", "--batches", "1", "--placements", "resident", "--keeps", "0.25", "--steps", "2",
           "--offload-dir", "{out}/offload", "--out", "{out}")),
    # the KV's storage dtype on the disk tier (--kv-dtype q8 / q4 against float16): bytes and step
    Entry("step-kv-dtype", "scripts/bench_step.py",
          ("--lengths", "4096", "8000", "--placements", "resident", "disk", "--kv-dtypes", "auto", "q8", "q4",
           "--keeps", "0.1", "--out", "results/step-kv-dtype"), _pair("results/step-kv-dtype", "step"),
          ("--lengths", "256", "--batches", "1", "--placements", "disk", "--kv-dtypes", "q8", "--keeps", "0.25",
           "--steps", "2", "--offload-dir", "{out}/offload", "--out", "{out}")),
    # the decode step per weight format and compute dtype (--compress-weight, --dtype bfloat16)
    Entry("weights", "scripts/bench_weights.py", ("--out", "results/weights"), _pair("results/weights", "weights"),
          ("--lengths", "256", "--batches", "1", "--placements", "resident", "--steps", "2", "--rounds", "1",
           "--offload-dir", "{out}/offload", "--out", "{out}")),
    Entry("attention", "scripts/bench_attention.py", ("--out", "results/attention"),
          _pair("results/attention", "attention"),
          ("--lengths", "256", "--batches", "1", "--repeats", "2", "--out", "{out}")),
    Entry("llamacpp", "scripts/bench_llamacpp.py", ("--out", "results/llamacpp"), _pair("results/llamacpp", "llamacpp"),
          ("--lengths", "128", "--gen-len", "4", "--threads", "1", "--weight-formats", "auto", "--out", "{out}"),
          extra="llama_cpp"),
    # the same on a CPU with AVX2 and no AVX-512 (the kernels' 8-lane build): run it on such a machine
    Entry("llamacpp-avx2", "scripts/bench_llamacpp.py", ("--weight-formats", "auto", "--out", "results/llamacpp-avx2"),
          _pair("results/llamacpp-avx2", "llamacpp"), extra="llama_cpp",
          needs="a CPU with AVX2 and no AVX-512 (this file's kind of machine; results/llamacpp is the other kind)"),
    Entry("api", "scripts/bench_api.py", ("--out", "results/api"), _pair("results/api", "api_overhead"),
          ("--prompts", "4", "--max-len", "64", "--gen-len", "4", "--batch", "2", "--serial", "2", "--repeats", "1",
           "--offload-dir", "{out}/offload", "--out", "{out}")),
    Entry("serve-load", "scripts/bench_serve.py", ("--seconds", "15", "--out", "results/serve"),
          _pair("results/serve", "serve_load"),
          ("--clients", "1,2", "--seconds", "2", "--lengths", "80", "--max-tokens", "2", "--out", "{out}")),
    Entry("serve-conversation", "scripts/bench_conversation.py", ("--out", "results/serve"),
          _pair("results/serve", "conversation"),
          ("--doc-tokens", "256", "--turns", "2", "--max-tokens", "4", "--out", "{out}")),
    Entry("refusal", "scripts/bench_refusal.py", ("--out", "results/refusal"), _pair("results/refusal", "refusal_time"),
          ("--runs", "1", "--offload-dir", "{out}/offload", "--out", "{out}")),
    Entry("distributed-measured", "scripts/bench_dist.py", ("--out", "results/distributed"),
          _pair("results/distributed", "bench"), ("--quick", "--out", "{out}")),
    Entry("distributed-modeled", "scripts/model_dist.py", ("--out", "results/distributed"),
          _pair("results/distributed", "modeled"), ("--out", "{out}")),
    Entry("latency", "scripts/reproduce_latency.py", ("--quiet", "--out", "results"),
          (*_pair("results", "latency_measured"), "results/latency_modeled_rtx3070ti.md",
           "results/latency_modeled_t4.md", "results/latency_hardware_this_machine.yaml"),
          ("--quick", "--quiet", "--offload-dir", "{out}/offload", "--out", "{out}")),
    # SparPR against dense offload (docs/sparpr_measured.md); the variants name their flag
    _sparpr("sparpr", "results/sparpr"),
    _sparpr("sparpr-gen128", "results/sparpr/gen128", "--contexts", "1024,2048,4096", "--gen-len", "128"),
    _sparpr("sparpr-gen128-keep0.1", "results/sparpr/gen128-keep0.1", "--contexts", "1024,2048,4096",
            "--gen-len", "128", "--keep-ratio", "0.1"),
    _sparpr("sparpr-gpu-batches-2", "results/sparpr/gpu-batches-2", "--contexts", "1024,2048,4096",
            "--gpu-batches", "2"),
    _sparpr("sparpr-speculative", "results/sparpr/speculative", "--speculative-prefetch"),
    # the I/O-bound regime: the disk tier's reads capped by the kernel
    Entry("sparpr-ablations", "scripts/bench_ablations.py",
          ("--quiet", "--trials", "30", "--out", "results/sparpr", "--stem", "ablations"),
          _pair("results/sparpr", "ablations"), needs=_THROTTLED),
    Entry("upstream-sparpr", "scripts/bench_upstream_sparpr.py",
          ("--read-mbps", "162.4", "--out", "results", "--stem", "upstream_sparpr"),
          _pair("results", "upstream_sparpr"), needs=_THROTTLED),
    Entry("upstream-sparpr-gen128", "scripts/bench_upstream_sparpr.py",
          ("--read-mbps", "162.4", "--gen-len", "128", "--out", "results", "--stem", "upstream_sparpr_gen128"),
          _pair("results", "upstream_sparpr_gen128"), needs=_THROTTLED),
    _throttled("arena-2k-gen32-keep0.1-block16", "--contexts", "2048", "--keep-ratio", "0.1", "--block-size", "16",
               "--no-upstream"),
    _throttled("quiet-1k-gen32-keep0.95", "--contexts", "1024", "--keep-ratio", "0.95", "--no-upstream"),
    _throttled("quiet-1k2k4k-gen128", "--contexts", "1024,2048,4096", "--gen-lens", "128", "--no-upstream"),
    _throttled("quiet-4k-gen32-keep0.1", "--contexts", "4096", "--keep-ratio", "0.1"),
    _throttled("quiet-8k-gen128-keep0.1", "--contexts", "8192", "--gen-lens", "128", "--keep-ratio", "0.1",
               "--no-upstream"),
    _throttled("quiet-8k-gen32-keep0.1", "--contexts", "8192", "--keep-ratio", "0.1", "--no-upstream"),
    # the grid at the engine's defaults (block 16, SparPR's keep ceiling 0.5 and floor 0.1), this engine alone
    _throttled("defaults-gen32", "--contexts", "1024,2048,4096,8192", "--gen-lens", "32", "--no-upstream"),
    _throttled("sweep-1k-gen32", "--contexts", "1024", "--read-mbps", "40,80", "--no-upstream"),
    # DKV on SmolLM2 (docs/dkv.md)
    _dkv("speed", "--trials", "2", "--configs", "dense,dkv,dkv-sparse-prefill", "--rank", "32", "--residuals", "16",
         quick=True),
    _dkv("sparpr", "--trials", "2", "--configs", "sparpr,sparpr+dkv", "--rank", "32", "--residuals", "16"),
    _dkv("needle-prompts", "--configs", "dense,dkv,sparpr+dkv", "--keep", "0.5", "--lengths", "2048,4096,8192",
         "--trials", "6", "--depths", "0.25,0.75"),
    _dkv("needle-prompts-exact-rows", "--configs", "dkv,sparpr+dkv", "--keep", "0.5", "--lengths", "2048,4096,8192",
         "--trials", "6", "--depths", "0.25,0.75"),
    _dkv("pick-attention", "--configs", "dkv,dense", "--lengths", "2048,4096,8192", "--trials", "4",
         "--residual-pick", "attention"),
    _dkv("pick-attention-sparpr", "--configs", "sparpr+dkv,sparpr", "--keep", "0.5", "--lengths", "2048,4096,8192",
         "--trials", "4", "--residual-pick", "attention"),
    Entry("dkv-speed-fixed-rows", "scripts/dkv_speed.py",
          ("--lengths", "4096,7936", "--batch", "2", "--rounds", "5", "--gen-len", "16",
           "--out", "results/dkv/speed-fixed-rows"), _pair("results/dkv/speed-fixed-rows", "speed"),
          ("--lengths", "512", "--batch", "1", "--rounds", "1", "--gen-len", "4", "--out", "{out}")),
]

PLAN: list[Entry] = ENGINE + FIDELITY

_PAST_CODE = "an A/B timing of the code at a past commit (before/after one change): a rerun times today's code"
_NOTES = "hand-written notes on the runs beside them, not a benchmark's output"
_EXPLORE = "an exploration's output; its code was removed (the doc names the commit that holds it)"

EXCEPTIONS: dict[str, str] = {
    "results/quick": "the quick run's own outputs (scripts/results.py --quick), git-ignored, never cited numbers",
    "results/gpu": "written by the GPU check (scripts/device_check.sh) on a machine with CUDA",
    "results/fingerprint": "a refactor's before/after behaviour record (scripts/fingerprint.py), not a figure",
    "results/dkv/README.md": _NOTES, "results/needle/NOTES.md": _NOTES, "results/ppl/NOTES.md": _NOTES,
    "results/sparpr/summaries": "summary-kind explorations (notes, probes, needle runs under summary kinds no "
                                "flag selects any more)",
    "results/dkv/pick-explore": _NOTES, "results/dkv/pick-oos": _NOTES, "results/dkv/sparpr-miss": _NOTES,
    "results/fidelity/explore": _EXPLORE, "results/ppl/explore": _EXPLORE, "results/needle/sparpr": _EXPLORE,
    **{f"results/dkv/{d}": _PAST_CODE for d in (
        "speed-ab-decode-ops", "speed-ab-fused-blocks", "speed-exact2-inplace", "speed-fused", "speed-index-select",
        "speed-interleaved", "speed-quiet", "speed-threads")},
}
