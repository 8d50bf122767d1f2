"""Turning pydantic's validation errors into ConfigError lines: field path, value, fix."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

from halfmoon.cluster.control.autoscaling_policy import TAG_PREFIX


class ConfigError(ValueError):
    """A configuration value is invalid; the message has one line per field: path, value, fix."""


def format_error(error: Any, root: type[BaseModel]) -> str:
    """One line for one pydantic error: the field path, the bad value and what is allowed."""
    loc = [str(part) for part in error["loc"]]
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "cross_field":
        return f"{_path(loc + ctx['field'].split('.'))}: {ctx['reason']}"
    if kind == "extra_forbidden":
        allowed = ", ".join(_fields_at(root, loc[:-1]))
        return f"{_path(loc)}: unknown field; allowed here: {allowed}"
    if kind == "missing":
        return f"{_path(loc)}: required; add it"
    if kind == "policy_kind":
        got = error["input"].get("kind") if isinstance(error["input"], dict) else error["input"]
        return f"{_path(loc + ['kind'])} = {got!r}: {error['msg']}"
    message = error["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
    if kind in ("value_error", "assertion_error") or _is_model_error(error):
        return f"{_path(loc)}: {message}"
    return f"{_path(loc)} = {error['input']!r}: {message}"


def _is_model_error(error: Any) -> bool:
    # A whole-section check raises with the section as input; repeating the mapping is noise.
    return isinstance(error["input"], dict) and error["type"] not in ("dict_type", "model_type")


def _path(loc: list[str]) -> str:
    return ".".join(part for part in loc if not part.startswith(TAG_PREFIX)) or "(top level)"


def _fields_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The field names of the section at `loc`, following tagged unions by their tag."""
    for part in loc:
        if part.startswith(TAG_PREFIX):
            kind = part.removeprefix(TAG_PREFIX)
            model = next(m for m in _models_in(model) if m.model_fields["kind"].default == kind)
            continue
        annotation = model.model_fields[part].annotation
        candidates = _models_in(annotation)
        model = candidates[0] if len(candidates) == 1 else annotation
    return list(model.model_fields)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation (Optional, union, Annotated) can hold."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        args = args[:1]
    elif typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [model for arg in args for model in _models_in(arg)]
