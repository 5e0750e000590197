"""Drop-in for upstream `python -m flexgen.dist_flex_opt`: pipeline parallelism over torch.distributed
(cli/dist.py), launched by torchrun or with upstream's --head-ip/--port/--world-size/--rank flags."""
import os
import sys


def main(argv=None) -> int:
    # torch's C++ side logs a lost peer or an unreachable store with a stack dump before raising;
    # this rank's one error line says it instead (read when torch loads: set before the import)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from .cli.dist import run_dist
    from .utils.guard import guarded
    from .cli.launch import label
    argv = sys.argv[1:] if argv is None else argv
    return guarded(run_dist, argv, label=label(argv))


if __name__ == "__main__":
    sys.exit(main())
