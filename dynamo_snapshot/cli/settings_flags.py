"""`dynamo-snapshot agent`'s flags, made from the agent's settings model (agent.config): one flag per
setting, named as it (``drop_zero_pages``: ``--drop-zero-pages``), typed as it, its help the setting's
description and default."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import ByteSize
from pydantic.fields import FieldInfo

from dynamo_snapshot.agent.config import settings_fields

__all__ = ["add_setting_flags", "flag_name", "setting_default", "setting_help", "setting_names"]


def setting_names() -> tuple[str, ...]:
    """Every setting's name (its flag's dest), in the model's order."""
    return tuple(name for _, name, _ in settings_fields())


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field(name: str) -> FieldInfo:
    for _, setting, model in settings_fields():
        if setting == name:
            return model.model_fields[name]
    raise KeyError(name)


def setting_default(name: str) -> str | None:
    """A setting's default as its flag would give it; None where it has none of its own."""
    info = _field(name)
    default = info.get_default(call_default_factory=True)
    if info.default_factory is not None and not isinstance(default, list):
        return None  # from the environment (its description says which)
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, ByteSize):
        return default.human_readable()
    if isinstance(default, list):
        return " ".join(default) if default else "none"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def setting_help(name: str) -> str:
    """A setting's description and, where it has one, its default."""
    text = _field(name).description or name
    default = setting_default(name)
    return f"{text} (default {default})" if default is not None else text


def _plain(annotation: Any) -> Any:
    """``X | None`` as ``X``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (plain,) = (a for a in typing.get_args(annotation) if a is not type(None))
        return plain
    return annotation


def _add(p: argparse.ArgumentParser, name: str) -> None:
    annotation = _plain(_field(name).annotation)
    flag, helps = flag_name(name), setting_help(name)
    if annotation is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps)
    elif typing.get_origin(annotation) is Literal:
        p.add_argument(flag, choices=list(typing.get_args(annotation)), help=helps)
    elif typing.get_origin(annotation) is list:
        p.add_argument(flag, nargs="*", metavar="PATH", help=helps)
    elif annotation in (Path, int, float):
        p.add_argument(flag, type=annotation, help=helps)
    else:  # str, sizes: as written, the model reads them
        p.add_argument(flag, help=helps)


def add_setting_flags(p: argparse.ArgumentParser) -> None:
    """A flag for every setting; one not given is None (the file's or the model's value stands)."""
    for name in setting_names():
        _add(p, name)
