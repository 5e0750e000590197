"""Command-line flags: every upstream FlexGen flag (same defaults, same meaning) plus ours.

Defaults live in DEFAULTS, not in argparse, so a flag the user did not give can be told
apart from one that merely equals its default (YAML config values sit between the two). The KV
policies' flags are made from their knobs (kv/knobs.py); a knob not given keeps the policy's default.
"""
from __future__ import annotations

import argparse
import sys

from ..kv import policies
from ..models.packed import FORMATS as WEIGHT_FORMATS
from ..utils.args import OneLineParser
from ..weights.resolve import KNOWN_NAMES, SMOLLM2

DEFAULTS = {
    "model": "facebook/opt-6.7b", "path": "~/opt_weights", "offload_dir": "~/flexgen_offload_dir",
    "prompt_len": 512, "gen_len": 32, "cut_gen_len": None, "debug_mode": None,
    "gpu_batch_size": 4, "num_gpu_batches": 1, "percent": [100, 0, 100, 0, 100, 0],
    "sep_layer": True, "pin_weight": True, "cpu_cache_compute": False, "attn_sparsity": 1.0,
    "compress_weight": False, "compress_cache": False, "log_file": "auto", "no_log": False,
    "verbose": 2, "overlap": True,
    "device": "auto", "dtype": "auto", "kv_dtype": "auto", "weight_format": "auto", "gpu_mem": None, "block_size": 16, "max_seq_len": None, "prompt": None,
    "prompt_file": None, "prompt_ids_file": None, "chat": False, "output_json": None, "config": None,
    "kv_policy": policies.DEFAULT, "cold_codec": "raw", "direct_io": False, "io_threads": 2, "seed": 0,
    "speculative_prefetch": False,
    "do_sample": False, "temperature": 1.0, "top_p": 1.0, "stop": None, "warmup": None,
    "stream": False, "quiet": False,
    # hardware files and --policy auto (runtime/hardware.py, runtime/placement.py)
    "hardware": None, "policy": None,
}


def str2bool(v: str) -> bool:
    if v.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if v.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def add_flexgen_flags(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("FlexGen flags (upstream names, defaults and meaning)")
    g.add_argument("--model", help=f"model: a known name ({', '.join(KNOWN_NAMES)}; OPT also as "
                   f"facebook/opt-...), a local HF checkpoint directory, or a .gguf file (default {d['model']}, "
                   f"FlexGen's; `run --prompt` or --prompt-file without --model, --path or --config: {SMOLLM2}; "
                   "`flexgen-sparpr models` says what each needs and which are ready)")
    g.add_argument("--path", help=f"weights folder: FlexGen's <path>/<model>-np layout or a HF checkpoint; "
                   f"'_DUMMY_' for deterministic random weights (default {d['path']})")
    g.add_argument("--offload-dir", help=f"folder for the disk tier (default {d['offload_dir']})")
    g.add_argument("--prompt-len", type=int, help=f"prompt tokens when no prompt is given (default {d['prompt_len']})")
    g.add_argument("--gen-len", type=int, help=f"tokens to generate (default {d['gen_len']})")
    g.add_argument("--cut-gen-len", type=int, help="generate only this many tokens and project the "
                   "decode latency to --gen-len (fast debugging)")
    g.add_argument("--debug-mode", choices=["fewer_batch", "breakdown"],
                   help="breakdown: print every step's time; fewer_batch: as breakdown, with "
                   "--cut-gen-len defaulting to 5")
    g.add_argument("--gpu-batch-size", type=int, help=f"sequences per GPU batch (default {d['gpu_batch_size']})")
    g.add_argument("--num-gpu-batches", type=int, help=f"GPU batches per block (default {d['num_gpu_batches']})")
    g.add_argument("--percent", nargs="+", type=int, help="six numbers: weight on GPU, weight on CPU, "
                   "cache on GPU, cache on CPU, activations on GPU, activations on CPU (percent; disk "
                   "gets the rest; on a CPU-only machine 'GPU' is the compute tier) (default 100 0 100 0 100 0)")
    g.add_argument("--sep-layer", type=str2bool, nargs="?", const=True, help="attention and MLP as separate "
                   "layers of the schedule (default true)")
    g.add_argument("--pin-weight", type=str2bool, nargs="?", const=True, help="pin CPU-tier weights (default true)")
    g.add_argument("--cpu-cache-compute", action="store_true", default=None,
                   help="attend CPU-tier KV blocks on the CPU (only the query crosses the link)")
    g.add_argument("--attn-sparsity", type=float, help="FlexGen's top-k attention: fraction of positions "
                   "kept per head, renormalised; runs as --kv-policy flexgen-topk --keep-ratio S "
                   "(default 1.0 = dense)")
    g.add_argument("--compress-weight", action="store_true", default=None, help="4-bit group-wise weights (group 64, decoded as they load; on the CPU "
                   "--weight-format int4's packed groups of 32, multiplied as they are)")
    g.add_argument("--compress-cache", action="store_true", default=None, help="4-bit group-wise KV cache (group 64)")
    g.add_argument("--log-file", help="FlexGen benchmark log file; 'auto' names it fo-<size>-gbs...log (default auto)")
    g.add_argument("--no-log", action="store_true", default=None, help="write no log file")
    g.add_argument("--verbose", type=int, help="0: quiet, 1: summary, 2: summary and outputs (default 2)")
    g.add_argument("--overlap", type=str2bool, nargs="?", const=True, help="overlap I/O with compute (default true)")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("flexgen-sparpr flags")
    g.add_argument("--config", help="YAML file with 'policy:', 'engine:' and 'run:' sections; flags override it")
    g.add_argument("--device", help="compute device: auto (CUDA if present, else CPU), cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"],
                   help="compute dtype (auto: float16 on CUDA, float32 on CPU)")
    g.add_argument("--kv-dtype", choices=["auto", "float16", "bfloat16", "float32", "q8", "q4"],
                   help="how KV blocks on the CPU and disk tiers are stored, converted to the compute dtype "
                        "on read (auto: float16, bfloat16 under --dtype bfloat16; float32 keeps them exact; "
                        "q8 / q4: 8- / 4-bit codes with a min and scale per 64 values, as --compress-cache's q4, "
                        "which also quantizes the compute tier's)")
    g.add_argument("--weight-format", choices=list(WEIGHT_FORMATS),
                   help="how projection weights are stored and multiplied: raw (the compute dtype), bfloat16, "
                        "int8 (a scale per row), int4 (a scale and minimum per 32 inputs, GGUF's Q4_1; the LM head "
                        "as 8-bit groups); int8 and int4 on the CPU only. auto (default): the fastest format on this "
                        "machine (a cached probe) that holds the checkpoint's values exactly, as the prepared "
                        "SmolLM2's Q4_1 weights in int4; others stay raw (docs/weights.md); on the CPU under float32 or "
                        "bfloat16")
    g.add_argument("--gpu-mem", type=float, help="cap the CUDA device at this many GiB, its context included, "
                   "so a bigger GPU runs like a card that size (placement and --policy auto plan for it too)"),
    g.add_argument("--block-size", type=int, help="tokens per KV block (default 16: the block selecting policies pick from)")
    g.add_argument("--max-seq-len", type=int, help="dummy weights: size the position table (OPT's real one stops at 2048)")
    g.add_argument("--prompt", help="prompt text (needs a model with a tokenizer); one of --prompt, "
                   "--prompt-file, --prompt-ids-file")
    g.add_argument("--prompt-file", help="file holding the prompt text")
    g.add_argument("--prompt-ids-file", help="JSON list of token-id lists (for models without a tokenizer)")
    g.add_argument("--chat", action="store_true", default=None, help="wrap the prompt in the model's chat template")
    g.add_argument("--output-json", help="write ids, texts, timings, peak memory and bytes moved here")
    g.add_argument("--direct-io", action="store_true", default=None, help="disk tier bypasses the page cache (O_DIRECT)")
    g.add_argument("--speculative-prefetch", action="store_true", default=None,
                   help="with one GPU batch, gather a query-aware policy's next-layer blocks from a query guessed "
                        "from this layer's input while it computes; the exact selection reads what the guess missed "
                        "(same output, more bytes)")
    g.add_argument("--io-threads", type=int, help="I/O threads of the overlapped schedule (default 2)")
    g.add_argument("--seed", type=int, help="seed for sampling and dummy weights, 0 to 2^63-1 (default 0)")
    g.add_argument("--do-sample", action="store_true", default=None, help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, help="sampling temperature with --do-sample, at least 1e-4 "
                   "(lower is greedy decoding: leave out --do-sample) (default 1.0)")
    g.add_argument("--top-p", type=float, help="nucleus sampling threshold with --do-sample (default 1.0)")
    g.add_argument("--stop", help="stop token id, 'eos' (the model's end token) or 'none' (default: eos for your "
                   "prompts, as batch, chat, serve and the API; none for FlexGen's benchmark prompt, which generates "
                   "--gen-len tokens)")
    g.add_argument("--warmup", type=str2bool, nargs="?", const=True, help="one short warm-up generation "
                   "before the timed one (default: true for FlexGen's benchmark prompt, as FlexGen does; false "
                   "with --prompt, --prompt-file or --prompt-ids-file)")
    g.add_argument("--stream", action="store_true", default=None, help="print the tokens as they are decoded "
                   "(one sequence: its text; a batch: each sequence's lines as they complete, as `[i] line`)")
    g.add_argument("--quiet", action="store_true", default=None, help="no progress bars (they go to stderr, "
                   "and only when it is a terminal)")


def add_hardware_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware files and automatic placement")
    g.add_argument("--hardware", help="hardware YAML file (`flexgen-sparpr profile --out FILE`, or "
                   "configs/hardware/*.yaml): sparpr's cost model reads it instead of probing, and "
                   "--policy auto plans with it (default: the config's hardware: section, else a probe)")
    g.add_argument("--policy", choices=["auto"], help="auto: choose --percent and the batch split "
                   "(--gpu-batch-size x --num-gpu-batches stays the total) from the hardware and the "
                   "model with a cost model of the schedule, within the memory and disk free now "
                   "(what the check before loading allows; docs/hardware.md); not with --percent")


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    """--kv-policy, --cold-codec and every registered policy's knobs: the knobs several policies
    share in the first group, each policy's own in its group."""
    g = p.add_argument_group("KV policies (kv/policies/; each knob applies to the policies named, and is "
                              "refused on the command line under a policy that does not read it)")
    g.add_argument("--kv-policy", metavar="NAME", help="which KV blocks attention reads at decode: "
                   f"{', '.join(sorted(policies.POLICIES))} (default {policies.DEFAULT})")
    g.add_argument("--cold-codec", choices=["raw", *policies.codec_names()], help="how KV blocks on the CPU and "
                   "disk tiers are stored: raw, or a policy's codec (dkv: fewer bytes per copy, with --kv-policy "
                   "sparpr) (default raw)")
    groups = {}
    for flag in policies.flags().values():
        owners = sorted(flag.policies)
        if len(owners) > 1:
            _add_knob(g, flag)
            continue
        if owners[0] not in groups:
            groups[owners[0]] = p.add_argument_group(_group_title(owners[0]))
        _add_knob(groups[owners[0]], flag)


def _group_title(name: str) -> str:
    cls = policies.POLICIES[name]
    doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()
    use = f"--kv-policy {name}" + (f" or --cold-codec {name}" if name in policies.codec_names() else "")
    return f"{use}: {doc[0].rstrip('.')}" if doc else use


def _add_knob(g, flag: "policies.Flag") -> None:
    """One knob's flag: a switch (given or not), or a value with its default (per policy where
    the policies sharing it differ); the policies that read it when several do."""
    k = flag.knob
    owners = sorted(flag.policies)
    shared = ", ".join(owners) if len(owners) > 1 else ""
    if k.type is bool:
        text = f"{k.help} ({shared})" if shared else k.help
        g.add_argument(k.flag, action="store_true", default=None, help=text.replace("%", "%%"))
        return
    defaults = {n: str(kn.default) for n, kn in flag.policies.items()}
    default = next(iter(defaults.values())) if len(set(defaults.values())) == 1 else \
        ", ".join(f"{n} {v}" for n, v in sorted(defaults.items()))
    text = f"{k.help} ({shared + '; ' if shared else ''}default {default})"
    metavar = k.metavar or (None if k.choices else {int: "N", float: "X"}.get(k.type, "S"))
    g.add_argument(k.flag, type=k.type, choices=k.choices, metavar=metavar, help=text.replace("%", "%%"))


GLOSSARY = "Terms (sealed block, keep, rho, gamma, cold codec, ...): docs/glossary.md."


def build_parser(prog: str = "flexgen-sparpr run") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Run offloaded generation with FlexGen's flags.", epilog=(
        "Before any weight loads, the placement's bytes per tier are checked against the free GPU memory, "
        "host memory and offload disk (FLEXGEN_SPARPR_NO_MEMORY_CHECK=1 skips it). A failure is one "
        "'error:' line, exit 2 (a stop signal: 128 + its number; FLEXGEN_SPARPR_TRACEBACK=1 shows a bug's "
        "traceback); offload files are removed however the run ends. " + GLOSSARY))
    add_flexgen_flags(p)
    add_engine_flags(p)
    add_hardware_flags(p)
    add_policy_flags(p)
    return p
