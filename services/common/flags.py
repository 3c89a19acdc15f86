"""Command-line flags declared once, as fields of a frozen settings dataclass.

Each field becomes `--field-name`, also read from the environment as
`EPD_FIELD_NAME` (the flag wins). Values are parsed and checked at start; any
problem exits with status 2 and a message that says what to fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

S = TypeVar("S")
# A field check returns None when the value is fine, else what is wrong and how to fix it.
Check = Callable[[Any], "str | None"]
ENV_PREFIX = "EPD_"
_SIZE = re.compile(r"(\d+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class SettingsError(ValueError):
    """A flag value that cannot be used; the message names the flag and the fix."""


def flag(default: Any = dataclasses.MISSING, help: str = "", check: Check | None = None, parse=None) -> Any:
    """A settings field. No default means the flag is required."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "parse": parse})


def parse_size(text: str) -> int:
    """Bytes, with an optional binary unit: 1048576, 1024K, 8GiB, 8G."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a size; use a number of bytes, optionally with K/M/G/T (e.g. 8GiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def load_settings(
    cls: type[S], prog: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> S:
    """Parse argv + env into `cls`; exits with status 2 and a clear message on any problem."""
    parser = _parser(cls, prog)
    given = vars(parser.parse_args(argv))
    try:
        return build_settings(cls, given, os.environ if env is None else env)
    except SettingsError as exc:
        print(f"{prog}: error: {exc}\n(run {prog} --help for every flag)", file=sys.stderr)
        raise SystemExit(2) from None


def build_settings(cls: type[S], given: Mapping[str, str], env: Mapping[str, str]) -> S:
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        raw = given.get(field.name)
        if raw is None and env.get(env_name(field.name)):
            raw = env[env_name(field.name)]
        if raw is None:
            if field.default is dataclasses.MISSING:
                raise SettingsError(f"{option_name(field.name)} is required (or set {env_name(field.name)})")
            continue
        values[field.name] = _convert(field, hints[field.name], raw)
    settings = cls(**values)
    for problem in _cross_problems(settings):
        raise SettingsError(problem)
    return settings


def _parser(cls: type, prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    for field in dataclasses.fields(cls):
        default = "required" if field.default is dataclasses.MISSING else f"default {field.default}"
        text = f"{field.metadata.get('help', '')} [{default}; env {env_name(field.name)}]"
        parser.add_argument(option_name(field.name), dest=field.name, default=None, help=text)
    return parser


def _convert(field: dataclasses.Field, hint: Any, raw: str) -> Any:
    name = option_name(field.name)
    parse = field.metadata.get("parse") or _scalar_type(hint)
    try:
        value = parse(raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name} {raw}: {_describe_parse_error(parse, exc)}") from None
    check = field.metadata.get("check")
    problem = check(value) if check is not None else None
    if problem:
        raise SettingsError(f"{name} {raw}: {problem}")
    return value


def _scalar_type(hint: Any) -> Callable[[str], Any]:
    """int | None -> int; Path, str, float, int as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in (int, float, str, Path):
        raise TypeError(f"unsupported settings field type {hint!r}")
    return hint


def _describe_parse_error(parse: Callable, exc: Exception) -> str:
    if parse is int:
        return "not an integer"
    if parse is float:
        return "not a number"
    return str(exc)


def _cross_problems(settings: Any) -> list[str]:
    """Checks that involve several fields: `cross_checks` class attributes along the MRO."""
    problems = []
    for klass in reversed(type(settings).__mro__):
        for check in vars(klass).get("cross_checks", ()):
            problem = check(settings)
            if problem:
                problems.append(problem)
    return problems
