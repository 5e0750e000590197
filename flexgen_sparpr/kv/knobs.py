"""A KV policy's knobs: the fields of its dataclass made with `knob(...)`.

Each knob is a CLI flag and a YAML key (its `dest`: the field name, with the policy's
`knob_prefix` when it has one, `no_` before a switch that is on by default, or the name given),
with the field's default and help text. A policy checks its knobs once, in `__post_init__`, with
the helpers below; their KnobError names the field, and the CLI repeats it with the flag's name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def knob(default: Any, help: str, *, dest: str | None = None, choices: tuple | None = None,
         metavar: str | None = None, block_size: bool = False):
    """A dataclass field that is a knob. dest: the flag / YAML key when not the generated one;
    choices: refused by the flag parser when not among them; block_size: the knob is the KV block
    size the policy asks for (the CLI's --block-size follows it unless that is given)."""
    meta = {"help": help, "dest": dest, "choices": choices, "metavar": metavar, "block_size": block_size}
    return field(default=default, metadata={"knob": meta})


@dataclass(frozen=True)
class Knob:
    name: str  # the dataclass field
    dest: str  # the flag (--dest with dashes) and the YAML key
    type: type
    default: Any
    help: str
    choices: tuple | None = None
    metavar: str | None = None
    negated: bool = False  # a switch on by default: the flag --no-<name> turns it off
    block_size: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def value(self, given: Any) -> Any:
        """The field's value for what the flag or YAML key gave."""
        return not given if self.negated else given


def knobs(cls) -> list[Knob]:
    """The knobs of a policy class, in field order."""
    if not dataclasses.is_dataclass(cls):
        return []
    out = []
    prefix = getattr(cls, "knob_prefix", "")
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("knob")
        if meta is None:
            continue
        kind = TYPES[f.type] if isinstance(f.type, str) else f.type
        negated = kind is bool and f.default is True
        dest = meta["dest"] or ("no_" if negated else "") + (f"{prefix}_" if prefix else "") + f.name
        out.append(Knob(f.name, dest, kind, f.default, meta["help"], meta["choices"], meta["metavar"], negated,
                        meta["block_size"]))
    return out


class KnobError(ConfigError):
    """A knob's value is refused: `knob` names the field, `rule` says what it must be."""

    def __init__(self, knob: str, rule: str):
        super().__init__(f"{knob} {rule}")
        self.knob, self.rule = knob, rule


def at_least(obj, name: str, least: float) -> None:
    if getattr(obj, name) < least:
        raise KnobError(name, f"must be >= {least} (got {getattr(obj, name)})")


def in_unit(obj, name: str, zero: bool = False) -> None:
    """The knob is in (0, 1], or [0, 1] with zero."""
    v = getattr(obj, name)
    if not ((0 <= v if zero else 0 < v) and v <= 1):
        raise KnobError(name, f"must be in {'[' if zero else '('}0, 1] (got {v})")


def one_of(obj, name: str, allowed) -> None:
    if getattr(obj, name) not in allowed:
        raise KnobError(name, f"must be one of {', '.join(allowed)} (got {getattr(obj, name)!r})")
