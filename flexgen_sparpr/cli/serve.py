"""`flexgen-sparpr serve`: the model behind an OpenAI-compatible HTTP API, one engine per process.

The server's command line (serve/ holds the app, its batcher and its requests): `run`'s model,
placement, policy and YAML flags (a request gives what a run's prompt and sampling flags give)
plus the server's. The flags are checked and the port bound before anything
loads (a bad one: one `error:` line, exit 2); the model then loads while the server already
answers (503 until ready). SIGTERM or SIGINT drains: no new connection is taken, the requests in
flight and queued are answered, the offload files are removed, and the exit code is 0.
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from ..api.llm import LLM
from ..config.options import resolve
from ..errors import ConfigError
from ..utils.guard import Interrupted, describe
from .parser import GLOSSARY, build_parser

# run's flags that a request gives instead (its prompt, length and sampling) or that only a run reports
PER_REQUEST = ("prompt", "prompt_file", "prompt_ids_file", "gen_len", "cut_gen_len", "do_sample", "temperature",
               "top_p", "stop", "stream", "output_json", "log_file", "no_log", "verbose", "warmup", "debug_mode",
               "chat")
SERVER = ("host", "port", "api_key", "max_queue", "batch_window", "prefix_cache_gb")


def build_serve_parser() -> argparse.ArgumentParser:
    p = build_parser("flexgen-sparpr serve")
    p.description = ("Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                     "/v1/models, /health, /metrics, and a chat page at /), with run's model, placement, policy and "
                     "--config flags.")
    p.epilog = ("The flags are checked and the port bound before the model loads; the model, and the placement's "
                "bytes per tier against this machine's free memory and disk (FLEXGEN_SPARPR_NO_MEMORY_CHECK=1 skips "
                "it), are checked as it loads. A failure is one 'error:' line, exit 2. SIGTERM or SIGINT drains the "
                "requests in flight, removes the offload files and exits 0. Requests: README.md, 'Serving over HTTP'. " + GLOSSARY)
    for action in p._actions:  # a request gives these (its prompt, max_tokens, temperature, ...)
        if action.dest in PER_REQUEST:
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    g.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a batch; more get "
                   "429 (default 64)")
    g.add_argument("--batch-window", type=float, default=0.01, help="seconds the first waiting request waits "
                   "for others to share its batch (default 0.01)")
    g.add_argument("--prefix-cache-gb", type=float, default=4.0, help="GiB per tier (compute, CPU, disk) of "
                   "finished one-request batches' KV kept for prefix reuse: a request starting as a kept one did "
                   "(a conversation sent again, a shared system prompt) prefills only the rest; least recently "
                   "used out first; 0: off (default 4)")
    return p


def serve(argv=None) -> int:
    args = build_serve_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in SERVER}
    for key in PER_REQUEST:
        if key in given:
            raise ConfigError(f"serve takes no --{key.replace('_', '-')}: each request gives its own")
    if not 0 <= args.port < 65536 or args.max_queue < 1 or args.batch_window < 0 or not args.prefix_cache_gb >= 0:
        raise ConfigError("--port must be in [0, 65535], --max-queue >= 1, --batch-window >= 0 and "
                          "--prefix-cache-gb >= 0")
    opts, _, _ = resolve(given)  # every flag checked before the port is taken or anything loads
    model_args = {k: v for k, v in given.items() if k != "model"}
    sock = _listen(args.host, args.port)
    import uvicorn

    from ..serve.app import ServerState, build_app
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    state = ServerState(lambda: LLM(opts.model, quiet=True, prefix_cache_gb=args.prefix_cache_gb, **model_args),
                        opts.model, args.api_key,
                        args.max_queue, args.batch_window)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="info", access_log=False,
                                           timeout_graceful_shutdown=None))

    def load_failed(e: BaseException) -> None:
        print(f"error: {describe(e)[1]}", file=sys.stderr, flush=True)
        server.should_exit = True
    state.on_load_error = load_failed
    host, port = sock.getsockname()[:2]
    print(f"serving {opts.model} on http://{host}:{port} (OpenAI API at /v1; the model is loading)", flush=True)
    try:
        server.run(sockets=[sock])
    except Interrupted as e:  # uvicorn re-raises the stop signal after its drained shutdown
        if e.signum not in (signal.SIGTERM, signal.SIGINT):
            raise
    if state.load_error is not None:
        return describe(state.load_error)[0]
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a taken port is one line and exit 2, before any loading."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
