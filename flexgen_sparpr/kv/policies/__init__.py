"""The KV policies, by name. Every module in this folder that defines a KVPolicy subclass with
its own `name` registers it: --kv-policy NAME, its knobs as flags and YAML keys, --policy auto
and the test matrix find it here, with no other edit (docs/design.md, "Add a policy")."""
from __future__ import annotations

import importlib
import math
import pkgutil
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

from ...errors import ConfigError
from ..knobs import Knob, KnobError, knobs
from ..policy import KVPolicy

DEFAULT = "dense"  # what runs when no --kv-policy is given
POLICIES: dict[str, type[KVPolicy]] = {}


def register(cls: type[KVPolicy], name: str | None = None) -> type[KVPolicy]:
    """Register a policy defined outside this folder (tests); `name` overrides its own."""
    if name is not None:
        cls.name = name
    POLICIES[cls.name] = cls
    return cls


def _discover() -> None:
    """Import every module of this folder; register the policies each defines."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, KVPolicy) and obj.__module__ == module.__name__
                    and "name" in vars(obj)):
                register(obj)


_discover()


def policy_class(name: str) -> type[KVPolicy]:
    if name not in POLICIES:
        raise ConfigError(f"unknown --kv-policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name]


def make_policy(name: str, **knob_values) -> KVPolicy:
    """The policy `name` with these knobs (field names); the rest keep their defaults."""
    return policy_class(name)(**knob_values)


def resolve(policy: str | KVPolicy, knob_values: dict | None = None) -> KVPolicy:
    """A policy given as an instance, or by name with its knobs (field names)."""
    if isinstance(policy, KVPolicy):
        if knob_values:
            raise ConfigError("knobs are given to a policy by name; this one is already made")
        return policy
    return make_policy(policy, **(knob_values or {}))


def codec_names() -> list[str]:
    """Policies whose codec can store another policy's CPU and disk blocks (--cold-codec)."""
    return sorted(n for n, cls in POLICIES.items() if cls.codec is not KVPolicy.codec)


@dataclass
class Flag:
    """One flag / YAML key and the knobs (of one or more policies) it sets."""

    knob: Knob  # the first policy's (type, help)
    policies: dict[str, Knob]  # policy name -> its knob of this dest


def flags() -> dict[str, Flag]:
    """dest -> Flag over every registered policy's knobs (one flag for a dest several share)."""
    out: dict[str, Flag] = {}
    for name in sorted(POLICIES):
        for k in knobs(POLICIES[name]):
            f = out.setdefault(k.dest, Flag(k, {}))
            if (k.type, k.negated) != (f.knob.type, f.knob.negated):
                raise TypeError(f"{k.flag}: {name} and {', '.join(f.policies)} give it different types")
            f.policies[name] = k
    return out


def build(name: str, given: dict, fields: dict | None = None, block_size: int | None = None) -> KVPolicy:
    """Policy `name` from the flags / YAML keys given (dest -> value; other policies' are ignored)
    and raw field values (`fields`, e.g. the YAML's policy_args), checked against the KV block
    size when given. A refused knob is reported under its flag's name."""
    cls = policy_class(name)
    own = {k.name: k for k in knobs(cls)}
    values = {k.name: k.value(given[k.dest]) for k in own.values() if k.dest in given}
    known = {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else set()
    for field_name, v in (fields or {}).items():
        if field_name not in known:
            raise ConfigError(f"{name}: policy_args.{field_name} is not one of its fields "
                              f"({', '.join(sorted(known)) or 'it has none'})")
        if field_name in own:
            _check_type(name, field_name, own[field_name], v)
    with _as_flags(cls):
        try:
            policy = cls(**(values | (fields or {})))
        except TypeError as e:
            raise ConfigError(f"{name}: {e}") from None
        if block_size is not None:
            policy.check_block_size(block_size)
        return policy


def _check_type(name: str, field_name: str, k: Knob, v) -> None:
    """A knob's raw field value (the YAML's policy_args) of the knob's type, finite."""
    if k.type is bool:
        ok = isinstance(v, bool)
    elif k.type is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif k.type is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    else:
        ok = isinstance(v, k.type)
    if not ok or (k.choices and v not in k.choices):
        what = f"one of {', '.join(map(str, k.choices))}" if k.choices else \
            {bool: "true or false", int: "an integer", float: "a finite number"}.get(k.type, "a text")
        raise ConfigError(f"{name}: policy_args.{field_name} must be {what} (got {v!r})")


def check_width(policy: KVPolicy, width: int) -> None:
    """Refuse a policy's knobs that do not fit the model's K|V row of `width` values (its
    check_width), reported under the knob's flag."""
    with _as_flags(type(policy)):
        policy.check_width(width)


@contextmanager
def _as_flags(cls: type[KVPolicy]):
    """A KnobError raised inside, as a ConfigError naming the knob's flag."""
    own = {k.name: k for k in knobs(cls)}
    try:
        yield
    except KnobError as e:
        raise ConfigError(f"{own[e.knob].flag} {e.rule}" if e.knob in own else str(e)) from None


def check_given(given: dict) -> None:
    """Refuse a bad value of any knob given (dest -> value), whichever policy runs: each policy
    that has one is built with all of its own that were given, so a rule across knobs sees them
    together (sparpr: --min-keep at most --keep-ratio). An error about a knob that was not given
    comes from that policy's defaults, not from the user (--kv-policy quest --keep-ratio 0.05
    under sparpr's default --min-keep 0.1): the policy that runs is built in full anyway."""
    for name, cls in sorted(POLICIES.items()):
        own = {k.name: k for k in knobs(cls)}
        values = {k.name: k.value(given[k.dest]) for k in own.values() if k.dest in given}
        if not values:
            continue
        try:
            cls(**values)
        except KnobError as e:
            if e.knob in values:
                raise ConfigError(f"{own[e.knob].flag} {e.rule}" if e.knob in own else str(e)) from None
        except TypeError as e:
            raise ConfigError(f"{name}: {e}") from None


def check_read(given, names: list[str]) -> None:
    """Refuse a knob given (dests) that none of the policies `names` (the KV policy, the cold
    codec's) reads: ConfigError naming the knob's flag, the policies that have it and the ones
    that would ignore it."""
    table = flags()
    for dest in sorted(d for d in given if d in table):
        owners = sorted(table[dest].policies)
        if not set(owners) & set(names):
            raise ConfigError(f"{table[dest].knob.flag} is a knob of {', '.join(owners)}; --kv-policy {names[0]}"
                              + (f" with --cold-codec {names[1]}" if len(names) > 1 else "")
                              + " ignores it: drop it, or choose a policy that reads it")


def reads(name: str, dest: str) -> bool:
    """Whether policy `name` has the knob whose flag / YAML key is `dest`."""
    return any(k.dest == dest for k in knobs(policy_class(name)))


def block_size_knob(name: str) -> Knob | None:
    """The knob of policy `name` that is the KV block size it asks for, if any."""
    return next((k for k in knobs(policy_class(name)) if k.block_size), None)


def implied_by(flag: str) -> tuple[type[KVPolicy], str] | None:
    """(policy, field) for a FlexGen flag that selects a policy with that field set to its value."""
    for cls in POLICIES.values():
        if getattr(cls, "flexgen_flag", None) and cls.flexgen_flag[0] == flag:
            return cls, cls.flexgen_flag[1]
    return None
