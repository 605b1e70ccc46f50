"""A config schema's fields as OmegaConf checks them: their types (a None default made Optional), the class OmegaConf
gets for the schema and the conversion back, and the type of a dotted key, named for messages."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


def allows_none(t: Any) -> bool:
    if t is Any or t is type(None):
        return True
    is_union = isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union
    return is_union and type(None) in typing.get_args(t)


def type_hints(schema: type) -> dict[str, Any]:
    """The fields' types, with a None default making a type Optional (``n: int = None`` is ``n: int | None``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.default is None and f.name in hints and not allows_none(hints[f.name]):
            hints[f.name] = typing.Optional[hints[f.name]]  # noqa: UP045  the type is a value here, not syntax
    return hints


# A schema whose fields (or nested dataclasses' fields) have a non-Optional type and a None default goes to
# OmegaConf as a copy with those types made Optional (OmegaConf refuses the None default otherwise); the copy's
# instances are turned back into the schema's, whose __post_init__ then runs. Other schemas go as they are.
COPIES: dict[type, type] = {}  # schema -> the copy OmegaConf gets (the schema itself when none is needed)
ORIGINALS: dict[type, type] = {}  # copy -> schema


def _with_copies(t: Any) -> Any:
    """``t`` with every dataclass in it replaced by its copy (``t`` itself when nothing changes)."""
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return omegaconf_class(t)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is None or not args or origin is Literal:
        return t
    new = tuple(a if a is Ellipsis else _with_copies(a) for a in args)
    if all(a is b for a, b in zip(new, args, strict=True)):
        return t
    if origin is typing.Union or origin is types.UnionType:
        return typing.Union[new]  # noqa: UP007  built from a tuple of types
    return origin[new]  # list, dict, tuple and their typing/collections.abc forms


def omegaconf_class(schema: type) -> type:
    if schema in COPIES:
        return COPIES[schema]
    COPIES[schema] = schema  # a schema that refers to itself is left as it is there
    hints, plain = type_hints(schema), typing.get_type_hints(schema)
    specs, changed = [], False
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        t = _with_copies(hints[f.name])
        changed = changed or t is not plain[f.name]
        if f.default is not dataclasses.MISSING:
            is_instance = dataclasses.is_dataclass(f.default) and not isinstance(f.default, type)
            field = (
                dataclasses.field(
                    default_factory=lambda d=f.default: convert(d, COPIES)  # the copy's default, never shared
                )
                if is_instance
                else dataclasses.field(default=f.default)
            )
        elif f.default_factory is not dataclasses.MISSING:
            field = dataclasses.field(default_factory=lambda make=f.default_factory: convert(make(), COPIES))
        else:
            field = dataclasses.field()
        specs.append((f.name, t, field))
    if changed:
        copy = dataclasses.make_dataclass(schema.__name__, specs)
        copy.__module__, copy.__qualname__ = schema.__module__, schema.__qualname__
        COPIES[schema], ORIGINALS[copy] = copy, schema
    return COPIES[schema]


def convert(value: Any, classes: dict[type, type]) -> Any:
    """``value`` with each dataclass instance of a class in ``classes`` rebuilt as the class it maps to."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        target = classes.get(type(value), type(value))
        items = {f.name: convert(getattr(value, f.name), classes) for f in dataclasses.fields(value) if f.init}
        return value if target is type(value) and all(items[k] is getattr(value, k) for k in items) else target(**items)
    if isinstance(value, list):
        return [convert(v, classes) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:  # not a NamedTuple
        return tuple(convert(v, classes) for v in value)
    if isinstance(value, dict):
        return {k: convert(v, classes) for k, v in value.items()}
    return value


def field_type(schema: type, key: str) -> Any:
    """The annotated type of the dotted ``key`` in ``schema``, or None if there is no such field."""
    current: Any = schema
    for part in key.split("."):
        if typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
            continue
        if not dataclasses.is_dataclass(current):
            return None
        hints = type_hints(typing.cast(type, current))
        if part not in hints:
            return None
        current = hints[part]
    return current


def expected(schema: type, key: str) -> str:
    t = field_type(schema, key)
    if t is None:
        return "a field of the schema"
    if isinstance(t, type) and not typing.get_args(t):
        return t.__name__
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        return " | ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in typing.get_args(t))
    return str(t).replace("typing.", "")
