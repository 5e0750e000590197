"""The options of every face, as a table: one record per option (its name, the kind of value it
takes, its choices, its help text, its group). Every upstream FlexGen flag (same defaults, same
meaning) plus ours.

No argparse here: the command line builds its parser from this table (cli/parser.py), and the
API's keyword arguments and --config YAML values are typed by it (validate.py), so the faces
cannot drift apart. Defaults live in DEFAULTS, not in the parser, so an option the user did not
give can be told apart from one that merely equals its default (YAML config values sit between
the two). The KV policies' options are made from their knobs (kv/knobs.py); a knob not given keeps
the policy's default.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from ..kv import policies
from ..models.packed import FORMATS as WEIGHT_FORMATS
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

# what an option's value is: a text, a number, a switch (given or not), a boolean whose value may
# be left out (`--overlap` is `--overlap true`), or a list of integers
KINDS = ("str", "int", "float", "switch", "bool", "ints")


@dataclass(frozen=True)
class Option:
    """One option: a flag (--dest with dashes), a YAML key and an API keyword argument (dest)."""

    dest: str
    kind: str
    help: str
    choices: tuple | None = None
    metavar: str | None = None
    group: str = ""  # the title of its group in --help

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.flag}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _group(title: str, *opts: Option) -> tuple[Option, ...]:
    return tuple(dataclasses.replace(o, group=title) for o in opts)


def parse_bool(v: str) -> bool:
    """A `bool` option's text (yes/no, true/false, 1/0, ...); ValueError otherwise."""
    if v.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if v.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError(f"expected a boolean, got {v!r}")


FLEXGEN = _group(
    "FlexGen flags (upstream names, defaults and meaning)",
    Option("model", "str", f"model: a known name ({', '.join(KNOWN_NAMES)}; OPT also as "
           f"facebook/opt-...), a local HF checkpoint directory, or a .gguf file (default {DEFAULTS['model']}, "
           f"FlexGen's; `run --prompt` or --prompt-file without --model, --path or --config: {SMOLLM2}; "
           "`flexgen-sparpr models` says what each needs and which are ready)"),
    Option("path", "str", f"weights folder: FlexGen's <path>/<model>-np layout or a HF checkpoint; "
           f"'_DUMMY_' for deterministic random weights (default {DEFAULTS['path']})"),
    Option("offload_dir", "str", f"folder for the disk tier (default {DEFAULTS['offload_dir']})"),
    Option("prompt_len", "int", f"prompt tokens when no prompt is given (default {DEFAULTS['prompt_len']})"),
    Option("gen_len", "int", f"tokens to generate (default {DEFAULTS['gen_len']})"),
    Option("cut_gen_len", "int", "generate only this many tokens and project the "
           "decode latency to --gen-len (fast debugging)"),
    Option("debug_mode", "str", "breakdown: print every step's time; fewer_batch: as breakdown, with "
           "--cut-gen-len defaulting to 5", choices=("fewer_batch", "breakdown")),
    Option("gpu_batch_size", "int", f"sequences per GPU batch (default {DEFAULTS['gpu_batch_size']})"),
    Option("num_gpu_batches", "int", f"GPU batches per block (default {DEFAULTS['num_gpu_batches']})"),
    Option("percent", "ints", "six numbers: weight on GPU, weight on CPU, "
           "cache on GPU, cache on CPU, activations on GPU, activations on CPU (percent; disk "
           "gets the rest; on a CPU-only machine 'GPU' is the compute tier) (default 100 0 100 0 100 0)"),
    Option("sep_layer", "bool", "attention and MLP as separate layers of the schedule (default true)"),
    Option("pin_weight", "bool", "pin CPU-tier weights (default true)"),
    Option("cpu_cache_compute", "switch", "attend CPU-tier KV blocks on the CPU (only the query crosses the link)"),
    Option("attn_sparsity", "float", "FlexGen's top-k attention: fraction of positions "
           "kept per head, renormalised; runs as --kv-policy flexgen-topk --keep-ratio S "
           "(default 1.0 = dense)"),
    Option("compress_weight", "switch", "4-bit group-wise weights (group 64, decoded as they load; on the CPU "
           "--weight-format int4's packed groups of 32, multiplied as they are)"),
    Option("compress_cache", "switch", "4-bit group-wise KV cache (group 64)"),
    Option("log_file", "str", "FlexGen benchmark log file; 'auto' names it fo-<size>-gbs...log (default auto)"),
    Option("no_log", "switch", "write no log file"),
    Option("verbose", "int", "0: quiet, 1: summary, 2: summary and outputs (default 2)"),
    Option("overlap", "bool", "overlap I/O with compute (default true)"),
)

ENGINE = _group(
    "flexgen-sparpr flags",
    Option("config", "str", "YAML file with 'policy:', 'engine:' and 'run:' sections; flags override it"),
    Option("device", "str", "compute device: auto (CUDA if present, else CPU), cpu, cuda, cuda:N"),
    Option("dtype", "str", "compute dtype (auto: float16 on CUDA, float32 on CPU)",
           choices=("auto", "float16", "bfloat16", "float32")),
    Option("kv_dtype", "str", "how KV blocks on the CPU and disk tiers are stored, converted to the compute dtype "
           "on read (auto: float16, bfloat16 under --dtype bfloat16; float32 keeps them exact; "
           "q8 / q4: 8- / 4-bit codes with a min and scale per 64 values, as --compress-cache's q4, "
           "which also quantizes the compute tier's); a CPU computing in float32 whose decode-attention "
           "kernel is built keeps its resident blocks in the float16 / bfloat16 chosen too", choices=("auto", "float16", "bfloat16", "float32", "q8", "q4")),
    Option("weight_format", "str", "how projection weights are stored and multiplied: raw (the compute dtype), "
           "bfloat16, int8 (a scale per row), int4 (a scale and minimum per 32 inputs, GGUF's Q4_1; the LM head "
           "as 8-bit groups); int8 and int4 on the CPU only. auto (default): the fastest format on this "
           "machine (a cached probe) that holds the checkpoint's values exactly, as the prepared "
           "SmolLM2's Q4_1 weights in int4; others stay raw (docs/weights.md); on the CPU under float32 or "
           "bfloat16", choices=tuple(WEIGHT_FORMATS)),
    Option("gpu_mem", "float", "cap the CUDA device at this many GiB, its context included, "
           "so a bigger GPU runs like a card that size (placement and --policy auto plan for it too)"),
    Option("block_size", "int", "tokens per KV block (default 16: the block selecting policies pick from)"),
    Option("max_seq_len", "int", "dummy weights: size the position table (OPT's real one stops at 2048)"),
    Option("prompt", "str", "prompt text (needs a model with a tokenizer); one of --prompt, "
           "--prompt-file, --prompt-ids-file"),
    Option("prompt_file", "str", "file holding the prompt text"),
    Option("prompt_ids_file", "str", "JSON list of token-id lists (for models without a tokenizer)"),
    Option("chat", "switch", "wrap the prompt in the model's chat template"),
    Option("output_json", "str", "write ids, texts, timings, peak memory and bytes moved here"),
    Option("direct_io", "switch", "disk tier bypasses the page cache (O_DIRECT)"),
    Option("speculative_prefetch", "switch", "with one GPU batch, gather a query-aware policy's next-layer blocks "
           "from a query guessed from this layer's input while it computes; the exact selection reads what the "
           "guess missed (same output, more bytes)"),
    Option("io_threads", "int", "I/O threads of the overlapped schedule (default 2)"),
    Option("seed", "int", "seed for sampling and dummy weights, 0 to 2^63-1 (default 0)"),
    Option("do_sample", "switch", "sample instead of greedy decoding"),
    Option("temperature", "float", "sampling temperature with --do-sample, at least 1e-4 "
           "(lower is greedy decoding: leave out --do-sample) (default 1.0)"),
    Option("top_p", "float", "nucleus sampling threshold with --do-sample (default 1.0)"),
    Option("stop", "str", "stop token id, 'eos' (the model's end token) or 'none' (default: eos for your "
           "prompts, as batch, chat, serve and the API; none for FlexGen's benchmark prompt, which generates "
           "--gen-len tokens)"),
    Option("warmup", "bool", "one short warm-up generation "
           "before the timed one (default: true for FlexGen's benchmark prompt, as FlexGen does; false "
           "with --prompt, --prompt-file or --prompt-ids-file)"),
    Option("stream", "switch", "print the tokens as they are decoded "
           "(one sequence: its text; a batch: each sequence's lines as they complete, as `[i] line`)"),
    Option("quiet", "switch", "no progress bars (they go to stderr, and only when it is a terminal)"),
)

HARDWARE = _group(
    "hardware files and automatic placement",
    Option("hardware", "str", "hardware YAML file (`flexgen-sparpr profile --out FILE`, or "
           "configs/hardware/*.yaml): sparpr's cost model reads it instead of probing, and "
           "--policy auto plans with it (default: the config's hardware: section, else a probe)"),
    Option("policy", "str", "auto: choose --percent and the batch split "
           "(--gpu-batch-size x --num-gpu-batches stays the total) from the hardware and the "
           "model with a cost model of the schedule, within the memory and disk free now "
           "(what the check before loading allows; docs/hardware.md); not with --percent", choices=("auto",)),
)


def policy_options() -> list[Option]:
    """--kv-policy, --cold-codec and every registered policy's knobs: the knobs several policies
    share in the first group, each policy's own in its group."""
    shared = ("KV policies (kv/policies/; each knob applies to the policies named, and is refused on the "
              "command line under a policy that does not read it)")
    out = list(_group(
        shared,
        Option("kv_policy", "str", "which KV blocks attention reads at decode: "
               f"{', '.join(sorted(policies.POLICIES))} (default {policies.DEFAULT})", metavar="NAME"),
        Option("cold_codec", "str", "how KV blocks on the CPU and disk tiers are stored: raw, or a policy's codec "
               "(dkv: fewer bytes per copy, with --kv-policy sparpr) (default raw)",
               choices=("raw", *policies.codec_names()))))
    for flag in policies.flags().values():
        owners = sorted(flag.policies)
        title = shared if len(owners) > 1 else _group_title(owners[0])
        out.append(dataclasses.replace(_knob_option(flag), group=title))
    return out


def _group_title(name: str) -> str:
    cls = policies.POLICIES[name]
    doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()
    use = f"--kv-policy {name}" + (f" or --cold-codec {name}" if name in policies.codec_names() else "")
    return f"{use}: {doc[0].rstrip('.')}" if doc else use


def _knob_option(flag: "policies.Flag") -> Option:
    """One knob's option: a switch (given or not), or a value with its default (per policy where
    the policies sharing it differ); the policies that read it when several do."""
    k = flag.knob
    owners = sorted(flag.policies)
    shared = ", ".join(owners) if len(owners) > 1 else ""
    if k.type is bool:
        return Option(k.dest, "switch", f"{k.help} ({shared})" if shared else k.help)
    defaults = {n: str(kn.default) for n, kn in flag.policies.items()}
    default = next(iter(defaults.values())) if len(set(defaults.values())) == 1 else \
        ", ".join(f"{n} {v}" for n, v in sorted(defaults.items()))
    metavar = k.metavar or (None if k.choices else {int: "N", float: "X"}.get(k.type, "S"))
    return Option(k.dest, k.type.__name__, f"{k.help} ({shared + '; ' if shared else ''}default {default})",
                  choices=k.choices, metavar=metavar)


def options() -> dict[str, Option]:
    """dest -> Option, every one, in the order `--help` shows them (made anew: the policies'
    registry decides the knobs)."""
    return {o.dest: o for o in (*FLEXGEN, *ENGINE, *HARDWARE, *policy_options())}
