"""`flexgen-sparpr batch`: generate for every prompt of a JSONL file through the Python API.

Input lines are {"id": ..., "prompt": "text"} or {"id": ..., "prompt_ids": [...]}, with an
optional "max_new_tokens" (default --gen-len); every line is checked before any weight loads.
The prompts are sorted by (max_new_tokens, length) and cut into batches of --gpu-batch-size x
--num-gpu-batches over the whole input, so a batch's prompts pad to similar lengths and every
batch is the same on every run. Each finished batch appends one line per prompt, {"id",
"token_ids", "text", "finish_reason"} (output order: by completion), flushed and synced to disk.
Killed at any point (SIGINT, SIGTERM, SIGKILL) and started again with the same command, the job
skips the ids already written and finishes the rest: every id once, the same greedy tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ..api.llm import LLM
from ..engine.sampling import STOP_DEFAULT
from ..errors import ConfigError
from ..utils.progress import bars_wanted, progress
from ..weights.resolve import DUMMY, resolve_source
from ..config import preflight
from .batch_files import Appender, read_done, read_input, same_file
from .parser import build_parser
from ..config.options import apply_auto_policy, resolve
from .outputs import writable_file
from ..config.prompts import load_tokenizer

# run flags that a batch job replaces (its prompts and its output are files of its own)
_NOT_HERE = ("prompt", "prompt_file", "prompt_ids_file", "output_json", "cut_gen_len", "debug_mode", "stream")


def build_batch_parser():
    p = build_parser("flexgen-sparpr batch")
    p.description = (__doc__ or "").split("\n\n")[1].replace("\n", " ")
    for a in p._actions:  # run's flags that a batch job refuses stay out of its --help
        if a.dest in _NOT_HERE:
            a.help = argparse.SUPPRESS
    g = p.add_argument_group("batch job")
    g.add_argument("--input", required=True, help="JSONL prompts (see above)")
    g.add_argument("--output", required=True, help="JSONL outputs, appended to; an existing one is resumed "
                   "when every line in it is this job's output (else it is refused and left as it is); "
                   "never the --input file")
    g.add_argument("--skip-bad", action="store_true", help="leave out bad input lines (a note names each) "
                   "instead of stopping at the first")
    return p


def batches(jobs: list, batch_size: int) -> list[list]:
    """The whole input's batches: by (max_new_tokens, length, line), cut into batch_size (a batch's
    prompts share max_new_tokens)."""
    order = sorted(jobs, key=lambda j: (j.max_new, len(j.ids), j.line))
    out: list[list] = []
    for j in order:
        if out and len(out[-1]) < batch_size and out[-1][0].max_new == j.max_new:
            out[-1].append(j)
        else:
            out.append([j])
    return out


def batch(argv=None) -> int:
    args = vars(build_batch_parser().parse_args(argv))
    inp, outp, skip_bad = args.pop("input"), args.pop("output"), args.pop("skip_bad")
    for key in _NOT_HERE:
        if args.get(key) is not None:
            raise ConfigError(f"--{key.replace('_', '-')} is a `run` flag: a batch job reads --input and writes --output")
    if same_file(inp, outp):
        raise ConfigError(f"--output {outp} is the same file as --input {inp}: give the outputs a file of their own")
    if args.get("stop") is None:
        args["stop"] = STOP_DEFAULT  # every line is a user's prompt: it ends at the end token
    opts, pol, ecfg = resolve(args)
    out_path = writable_file(outp, "--output")
    dummy = DUMMY in opts.path
    src = resolve_source(opts.model, opts.path, opts.max_seq_len, opts.seed)
    tok = load_tokenizer(src.tokenizer_dir) if not dummy else None
    jobs = read_input(inp, tok, src.spec, opts.chat, opts.gen_len, skip_bad, dummy)
    done = read_done(out_path, {j.id for j in jobs})
    todo = [b for b in batches(jobs, pol.batch_size) if any(j.id not in done for j in b)]
    say = print if opts.verbose >= 1 else (lambda *a, **k: None)
    if not todo:
        say(f"batch: all {len(jobs)} prompts are in {out_path} already")
        return 0
    longest = dataclasses.replace(opts, prompt_len=max(len(j.ids) for j in jobs),
                                  gen_len=max(j.max_new for j in jobs))
    cap = None
    if opts.policy == "auto":  # for the longest prompt and generation (the batch size is kept)
        pol, ecfg, _, _, cap = apply_auto_policy(longest, pol, ecfg, src.spec)
    preflight.ready_to_load(longest, pol, ecfg, src.spec, longest.prompt_len, cap)
    bars = bars_wanted(opts.quiet)
    t0, new_tokens = time.perf_counter(), 0
    with LLM.loaded(opts, pol, ecfg, src, tok, progress=bars) as llm, Appender(out_path) as out, \
            progress(total=len(jobs), initial=len(done), desc="batch", unit="prompt", enabled=bars) as bar:
        try:
            for b in todo:
                outs = llm.generate([j.ids for j in b], b[0].max_new, do_sample=opts.do_sample,
                                    temperature=opts.temperature, top_p=opts.top_p, stop=opts.stop, seed=opts.seed,
                                    progress=bars)
                recs = [{"id": j.id, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason}
                        for j, o in zip(b, outs) if j.id not in done]
                out.write(recs)
                new_tokens += sum(len(r["token_ids"]) for r in recs)
                bar.update(len(recs))
                bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.1f} tok/s")
        except KeyboardInterrupt:  # a stop signal (utils/guard.py): say what is kept, then unwind
            print(f"note: {len(done) + out.written} of {len(jobs)} prompts are in {out_path}; the same command "
                  "finishes the rest", file=sys.stderr, flush=True)
            raise
    secs = time.perf_counter() - t0
    say(f"batch: {out.written} prompts in {secs:.1f} s ({new_tokens} tokens, {new_tokens / secs:.1f} tokens/s); "
        f"all {len(jobs)} in {out_path}")
    return 0
