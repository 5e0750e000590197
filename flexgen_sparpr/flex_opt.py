"""Drop-in for upstream `python -m flexgen.flex_opt`: same flags, summary lines and log file."""
import sys

from .utils.guard import guarded
from .cli.run import run


def main(argv=None) -> int:
    return guarded(run, argv, "python -m flexgen_sparpr.flex_opt")


if __name__ == "__main__":
    sys.exit(main())
