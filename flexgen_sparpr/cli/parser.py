"""The command line's parser, built from the option table (config/flags.py): each option a flag
of its group, with argparse's one-line errors (utils/args.py). Defaults stay out of argparse
(config/flags.py DEFAULTS), so a flag not given parses as None."""
from __future__ import annotations

import argparse

from ..config import flags
from ..utils.args import OneLineParser

GLOSSARY = "Terms (sealed block, keep, rho, gamma, cold codec, ...): docs/glossary.md."


def str2bool(v: str) -> bool:
    try:
        return flags.parse_bool(v)
    except ValueError as e:  # argparse prints an ArgumentTypeError's own text
        raise argparse.ArgumentTypeError(str(e)) from None


# an option's kind (config/flags.py KINDS) as argparse arguments
_ARGS = {
    "str": {}, "int": {"type": int}, "float": {"type": float},
    "switch": {"action": "store_true", "default": None},
    "bool": {"type": str2bool, "nargs": "?", "const": True},
    "ints": {"type": int, "nargs": "+"},
}


def add_options(p: argparse.ArgumentParser) -> None:
    """Every option of the table as a flag, in its group."""
    groups = {}
    for o in flags.options().values():
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        extra = {k: v for k, v in (("choices", o.choices), ("metavar", o.metavar)) if v is not None}
        groups[o.group].add_argument(o.flag, help=o.help.replace("%", "%%"), **_ARGS[o.kind], **extra)


def build_parser(prog: str = "flexgen-sparpr run") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Run offloaded generation with FlexGen's flags.", epilog=(
        "Before any weight loads, the placement's bytes per tier are checked against the free GPU memory, "
        "host memory and offload disk (FLEXGEN_SPARPR_NO_MEMORY_CHECK=1 skips it). A failure is one "
        "'error:' line, exit 2 (a stop signal: 128 + its number; FLEXGEN_SPARPR_TRACEBACK=1 shows a bug's "
        "traceback); offload files are removed however the run ends. " + GLOSSARY))
    add_options(p)
    return p
