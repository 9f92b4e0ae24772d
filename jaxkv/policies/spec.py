"""Policies from text: `from_spec("snapkv:0.25:window=32")`, and the parsing that the command
line (`--budget`, `--policy-arg KEY=VALUE`) and the benchmarks share, so there is one grammar.

    NAME[:VALUE][:KEY=VALUE...][+NAME[:VALUE][:KEY=VALUE...]...]

Several specs joined by "+" are composed (`policies.compose`): "wgkv:0.3+quest:64" admits with
WG-KV's gates at tau 0.3 and reads 64 tokens' worth of global pages per step as Quest picks.
VALUE sets the policy's primary knob (`Policy.primary_knob`): its budget for most ("0.3", "1e-1"
and "30%" are ratios of the prompt, "256" a token count), WG-KV's `tau`, local attention's
`window`, Conf-KV's `tight` budget. KEY is any field of the policy; its value parses as the
field's type ("none" for a field that may be None). Every error names the part and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxkv.policies import base
from jaxkv.policies.compose import compose

BUDGET_FORMS = "a ratio of the prompt in (0, 1] (0.3, 1e-1, 30%) or a token count >= 1 (256)"
_SCALAR_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_UNPARSED = object()


def parse_budget(text: str, *, option: str = "budget") -> float | int:
    """ "0.3", "1e-1" and "30%" are ratios of the prompt, "256" a token count."""
    stripped = text.strip()
    bad = ValueError(f"{option} {text!r}: give {BUDGET_FORMS}")
    try:
        if stripped.endswith("%"):
            ratio = float(stripped[:-1]) / 100
        elif stripped.isdigit():
            if int(stripped) < 1:
                raise bad
            return int(stripped)
        else:
            ratio = float(stripped)
    except ValueError:
        raise bad from None
    if not 0.0 < ratio <= 1.0:  # also rejects nan and inf
        raise bad
    return ratio


def policy_fields(name: str) -> dict[str, dataclasses.Field]:
    """The fields a registered policy is built with, by name."""
    if name not in base.registered():
        raise ValueError(f"policy {name!r}: registered policies are {', '.join(base.registered())}")
    return {f.name: f for f in dataclasses.fields(base.policy_class(name)) if f.init}


def takes_budget(name: str) -> bool:
    """Whether policy `name` has a budget (a `budget` or a `ratio` field)."""
    return bool({"budget", "ratio"} & set(policy_fields(name)))


def takes_ratio_only(name: str) -> bool:
    """Whether policy `name`'s budget is a ratio of the prompt, never a token count."""
    fields = policy_fields(name)
    return "ratio" in fields and "budget" not in fields


def _field_types(field: dataclasses.Field) -> list:
    """The types a text value may parse to (None for "none"), from the field's default, or its
    annotation where the default is None; [] for fields that text cannot set."""
    annotated = [part.strip() for part in str(field.type).split("|")]
    optional = [None] if "None" in annotated else []
    default = field.default
    if isinstance(default, enum.Enum | base.Policy):  # a policy as text: its name
        return [str]
    if isinstance(default, tuple):
        return [tuple]
    if default is not None and type(default) in _SCALAR_TYPES.values():
        return [type(default), *optional]
    if default is None:
        return optional + [_SCALAR_TYPES[t] for t in annotated if t in _SCALAR_TYPES]
    return []


def _parse_scalar(kind, text: str):
    """`text` as `kind` (None: the word "none"), or _UNPARSED."""
    lowered = text.strip().lower()
    if kind is None:
        return None if lowered == "none" else _UNPARSED
    if kind is bool:
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
            lowered, _UNPARSED
        )
    if kind is str:
        return text
    if kind is tuple:  # comma-separated numbers: "0.7,0.3" or "1,2,3"
        items = [_parse_scalar(int, item) for item in lowered.split(",")]
        if _UNPARSED in items:
            items = [_parse_scalar(float, item) for item in lowered.split(",")]
        return _UNPARSED if _UNPARSED in items else tuple(items)
    try:
        value = kind(lowered)
    except ValueError:
        return _UNPARSED
    return value if math.isfinite(value) else _UNPARSED


def field_value(name: str, field: dataclasses.Field, text: str, *, option: str) -> Any:
    """The value of policy `name`'s `field` written as `text` (`option`: how the user gave it,
    for the error)."""
    if field.name == "budget":
        return parse_budget(text, option=option)
    types = _field_types(field)
    if not types:
        raise ValueError(
            f"{option} {field.name}: policy {name!r} takes {field.type} there, which text "
            "cannot give"
        )
    for kind in types:
        value = _parse_scalar(kind, text)
        if value is not _UNPARSED:
            return value
    names = {None: "none", tuple: "comma-separated numbers"}
    wanted = " or ".join(names.get(kind) or kind.__name__ for kind in types)
    raise ValueError(f"{option} {field.name}={text}: expected {wanted}")


def policy_kwargs(
    name: str,
    pairs: Sequence[str],
    budget: str | None,
    *,
    pair_option: str = "policy argument",
    budget_option: str = "budget",
) -> dict:
    """The keyword arguments of `policies.get(name, ...)` from KEY=VALUE `pairs` and a budget
    text; `pair_option` / `budget_option` say how the user gave them (e.g. "--policy-arg")."""
    fields = policy_fields(name)
    kwargs = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key.strip() not in fields:
            raise ValueError(
                f"{pair_option} {pair!r}: give KEY=VALUE with KEY one of the fields of policy "
                f"{name!r}: {', '.join(fields)}"
            )
        kwargs[key.strip()] = field_value(name, fields[key.strip()], text, option=pair_option)
    if budget is None:
        return kwargs
    if "budget" in kwargs:
        raise ValueError(f"give the budget once: {budget_option} or {pair_option} budget=")
    value = parse_budget(budget, option=budget_option)
    if takes_ratio_only(name) and isinstance(value, int):
        raise ValueError(
            f"{budget_option} {budget}: policy {name!r} keeps a ratio of the prompt in (0, 1] "
            "(0.3, 1e-1, 30%), not a token count"
        )
    if not takes_budget(name):
        hint = ""
        if {"tight", "loose"} <= set(fields):
            hint = f": it has two budgets in tokens, {pair_option} tight=N {pair_option} loose=N"
        raise ValueError(f"{budget_option} {budget}: policy {name!r} takes no budget{hint}")
    return {**kwargs, "budget": value}


def from_spec(spec: str) -> base.Policy:
    """The policy of `NAME[:VALUE][:KEY=VALUE...]` (module docstring), e.g. "snapkv:0.25",
    "kvzip:30%", "wgkv:0.2:window=64", "confkv:64:loose=256", "full"; specs joined by "+"
    compose ("wgkv:0.3+quest:64")."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy spec {spec!r}: give NAME[:VALUE][:KEY=VALUE...]")
    if "+" in spec:
        members = spec.split("+")
        if not all(member.strip() for member in members):
            raise ValueError(f"policy spec {spec!r}: give SPEC+SPEC with no empty part")
        return compose(*(from_spec(member) for member in members))
    name, *parts = spec.strip().split(":")
    policy_fields(name)  # names the registered policies when `name` is not one
    values = [part for part in parts if "=" not in part]
    if len(values) > 1 or (values and parts[0] != values[0]):
        raise ValueError(
            f"policy spec {spec!r}: one VALUE may follow the name, then KEY=VALUE parts"
        )
    pairs = parts[1:] if values else parts
    knob = base.policy_class(name).primary_knob
    if values and knob != "budget":
        pairs = [f"{knob}={values[0]}", *pairs]
    budget = values[0] if values and knob == "budget" else None
    options = dict(
        pair_option=f"policy spec {spec!r}, part", budget_option=f"policy spec {spec!r}, value"
    )
    kwargs = policy_kwargs(name, pairs, budget, **options)
    return base.get(name, **kwargs)


def parse_params(pairs: Sequence[str], *, option: str = "--params") -> dict[str, list[Path]]:
    """NAME=PATH pairs: the saved parameters of each learned policy, several per name in the
    order given (the benchmarks' `--params`); errors name the pair and what is allowed."""
    known = base.registered()
    found: dict[str, list[Path]] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or name not in known:
            raise ValueError(f"{option} {pair}: give NAME=PATH with NAME one of {known}")
        if base.get(name).params is None:
            raise ValueError(f"{option} {pair}: policy {name!r} takes no parameters")
        if not Path(path).exists():
            raise ValueError(f"{option} {pair}: no such file or directory")
        found.setdefault(name, []).append(Path(path))
    return found
