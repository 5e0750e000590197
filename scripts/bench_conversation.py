"""A 10-turn conversation over a ~4k-token document against a real `flexgen-sparpr serve`, with
prefix reuse (--prefix-cache-gb 4, the default) and without (0): per turn the prompt tokens, the
tokens the kept cache held, time to first token and total time, and whether the two runs' greedy
answers are equal (flexgen_sparpr/bench/conversation.py).

The document is the start of the GNU GPL v3 as Debian ships it (/usr/share/common-licenses/GPL-3),
cut to --doc-tokens with the model's tokenizer. Writes <out>/conversation.{json,md} with the
server flags, the engine commit, the machine and its load average before and after.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, load_average, machine_info, md_table, write_results  # noqa: E402

from flexgen_sparpr.bench.conversation import as_rows, converse  # noqa: E402
from flexgen_sparpr.bench.serve_load import server_config, start_server  # noqa: E402

DOC = Path("/usr/share/common-licenses/GPL-3")


def document(model: str, tokens: int) -> str:
    from flexgen_sparpr.config.prompts import load_tokenizer
    from flexgen_sparpr.weights.resolve import resolve_source
    tok = load_tokenizer(resolve_source(model, "~/opt_weights", None, 0).tokenizer_dir)
    ids = tok(DOC.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        die(f"{DOC} has only {len(ids)} tokens")
    return tok.decode(ids[:tokens])


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--doc-tokens", type=int, default=4000)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    ap.add_argument("--server-flag", action="append", default=[], help="one more serve flag (repeatable)")
    ap.add_argument("--out", default=str(REPO / "results" / "serve"))
    args = ap.parse_args(argv)
    if not DOC.exists():
        die(f"{DOC} is missing (Debian's base-files ships it)")
    doc = document(args.model, args.doc_tokens)
    base = ["--model", args.model, *[f for flag in args.server_flag for f in flag.split()]]
    load_before, commit, runs = load_average(), engine_commit(), {}
    for label, gib in (("reuse", "4"), ("no reuse", "0")):
        flags = [*base, "--prefix-cache-gb", gib]
        try:
            proc, port = start_server(flags, REPO, timeout=300)
        except RuntimeError as e:
            die(str(e))
        try:
            runs[label] = {"server_flags": flags, "resolved": server_config(port),
                           "turns": as_rows(converse(port, doc, args.turns, args.max_tokens))}
        finally:
            proc.send_signal(signal.SIGTERM)
            runs[label]["server_exit_code"] = proc.wait(600)
        t = runs[label]["turns"]
        print(f"{label}: total {sum(x['latency_s'] for x in t):.1f} s, later turns' TTFT "
              f"{[round(x['ttft_s'], 2) for x in t[1:]]}", flush=True)
    a, b = runs["reuse"]["turns"], runs["no reuse"]["turns"]
    same = [x["answer"] == y["answer"] for x, y in zip(a, b)]
    payload = {"config": {"model": args.model, "document": f"{DOC}, first {args.doc_tokens} tokens",
                          "turns": args.turns, "max_tokens": args.max_tokens, "temperature": 0,
                          "server_flags_common": base, "engine_commit": commit,
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
               "machine": machine_info(), "load_average_before": load_before, "load_average_after": load_average(),
               "runs": runs, "answers_equal": same}
    rows = [[x["turn"], x["prompt_tokens"], x["reused_tokens"], f"{x['ttft_s']:.2f}", f"{y['ttft_s']:.2f}",
             f"{y['ttft_s'] / x['ttft_s']:.1f}x", f"{x['latency_s']:.2f}", f"{y['latency_s']:.2f}", "yes" if s else "no"]
            for x, y, s in zip(a, b, same)]
    total = [sum(x["latency_s"] for x in r) for r in (a, b)]
    md = (f"# A {args.turns}-turn conversation over a {args.doc_tokens}-token document, with and without prefix "
          f"reuse\n\n`serve {' '.join(base)}` with `--prefix-cache-gb 4` (the default) and `0`; "
          f"{args.max_tokens}-token greedy answers; the whole conversation sent every turn, streamed. Engine "
          f"{commit}; load average before {load_before}, after {payload['load_average_after']} on "
          f"{payload['machine']['cpu_count']} cores, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS') or 'unset'}. Written by `scripts/bench_conversation.py`.\n\n"
          + md_table(["turn", "prompt tokens", "reused", "TTFT reuse s", "TTFT none s", "TTFT ratio",
                      "total reuse s", "total none s", "same answer"], rows)
          + f"\nWhole conversation: {total[0]:.1f} s with reuse, {total[1]:.1f} s without "
            f"({total[1] / total[0]:.1f}x).\n")
    for p in write_results(Path(args.out), "conversation", payload, md):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
