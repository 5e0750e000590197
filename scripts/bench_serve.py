"""Load on a real `flexgen-sparpr serve` process: 1, 4, 16 and 64 concurrent clients (--clients),
each sending streamed completions of mixed prompt lengths (slices of Alice in Wonderland) back to
back for --seconds per level (flexgen_sparpr/bench/serve_load.py). Per level: requests/s,
tokens/s, p50/p99 time to first token and latency, outcomes by status (0 errors expected below the
queue limit, clean 429s above it) and the lost / duplicated check against the server's /metrics.

Writes <out>/serve_load.{json,md} with the full config (server flags included), the engine commit
and the machine's load (the machine may be shared: its load average is recorded before and after).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, int_list, OneLineParser  # noqa: E402
from flexgen_sparpr.bench.results import engine_commit, load_average, machine_info, md_table, write_results  # noqa: E402

from flexgen_sparpr.bench.serve_load import mixed_prompts, run_level, server_config, start_server  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int_list, default=[1, 4, 16, 64], help="concurrency levels (1,4,16,64)")
    ap.add_argument("--seconds", type=float, default=20.0, help="sending time per level (default 20)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    ap.add_argument("--lengths", type=int_list, default=[80, 400, 1200], help="prompt lengths in characters")
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=24)
    ap.add_argument("--server-flag", action="append", default=[], help="one more serve flag (repeatable)")
    ap.add_argument("--out", default=str(REPO / "results" / "serve"))
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.max_tokens < 1:
        die("--seconds must be > 0 and --max-tokens >= 1")
    flags = ["--model", args.model, "--gpu-batch-size", str(args.gpu_batch_size), "--max-queue",
             str(args.max_queue), *[f for flag in args.server_flag for f in flag.split()]]
    prompts = mixed_prompts(args.lengths, 64, seed=0)
    load_before, commit = load_average(), engine_commit()  # the commit the server runs
    try:
        proc, port = start_server(flags, REPO, timeout=300)
    except RuntimeError as e:
        die(str(e))
    config = server_config(port)  # the server's engine, as it resolved the flags (its /health)
    levels = []
    try:
        for n in args.clients:
            lv = run_level(port, n, args.seconds, prompts, args.max_tokens)
            levels.append(lv.summary())
            s = levels[-1]
            print(f"{n:3d} clients: {s['req_per_s']:.2f} req/s, {s['tokens_per_s']:.1f} tok/s, "
                  f"ttft p50 {s['ttft_p50_s']} s, by status {s['by_status']}, lost {s['lost']}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(600)
    payload = {"config": {"server_flags": flags, "resolved": config, "clients": args.clients, "seconds_per_level": args.seconds,
                          "max_tokens": args.max_tokens, "prompt_lengths_chars": args.lengths,
                          "prompts": "slices of tests/data/alice29.txt, seed 0", "temperature": 0,
                          "engine_commit": commit},
               "machine": machine_info(), "load_average_before": load_before, "load_average_after": load_average(),
               "server_exit_code": rc, "levels": levels}
    rows = [[s["clients"], s["requests"], s["answered"], f"{s['req_per_s']:.2f}", f"{s['tokens_per_s']:.1f}",
             _s(s["ttft_p50_s"]), _s(s["ttft_p99_s"]), _s(s["latency_p50_s"]), _s(s["latency_p99_s"]),
             s["by_status"].get("429", 0), s["errors_other_than_429"], s["lost"], s["duplicate_answers"]]
            for s in levels]
    md = (f"# flexgen-sparpr serve under load\n\n`{' '.join(flags)}`; {args.seconds:.0f} s per level, "
          f"{args.max_tokens} tokens per answer, prompts of {args.lengths} characters; engine "
          f"{payload['config']['engine_commit']}; load average before {load_before}, after "
          f"{payload['load_average_after']} on {payload['machine']['cpu_count']} cores (a shared machine).\n\n"
          + md_table(["clients", "requests", "answered", "req/s", "tok/s", "TTFT p50 s", "TTFT p99 s",
                      "latency p50 s", "latency p99 s", "429", "other errors", "lost", "answered twice"], rows))
    for p in write_results(Path(args.out), "serve_load", payload, md):
        print(f"wrote {p}")


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    main()
