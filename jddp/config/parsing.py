"""``parse``: a schema instance from its defaults, a YAML file and ``key=value`` overrides, each source checked, and
the values inside typed containers checked after OmegaConf's own checks."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf import errors as oc_errors

from jddp import validate
from jddp.config import errors, files, merging
from jddp.config import schema as schema_lib

T = TypeVar("T")


FILE_KEY = "config"  # `config=FILE` on the command line names the YAML file


def parse(schema: type[T], argv: Sequence[str] = (), *, path: str | os.PathLike | None = None) -> T:
    """A validated ``schema`` instance from its defaults, a YAML file and ``key=value`` overrides.

    Args:
      schema: a dataclass type (possibly with nested dataclass fields); every
        field needs a default.
      argv: command-line arguments, each ``key=value``; ``config=FILE`` replaces
        ``path``.
      path: a YAML file with a mapping of (some of) the schema's keys.

    Returns:
      An instance of ``schema`` (its ``__post_init__`` has run).

    Raises:
      TypeError: if ``schema`` is not a dataclass type, ``argv`` not a list of str, or ``path`` not a path.
      ConfigError: for an unknown key, a value of the wrong type, a missing
        value, a missing or malformed file, or an argument that is not
        ``key=value``.

    Example:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     epochs: int = 30
      ...     lr: float = 1e-3
      >>> parse(Config, ["epochs=5"])
      Config(epochs=5, lr=0.001)
    """
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"`schema` must be a dataclass type, got {schema!r}.")
    _check_argv(argv)
    path = validate.check_path("path", path, optional=True)
    path_name = "path"
    overrides = []
    for arg in argv:
        key, sep, value = str(arg).partition("=")
        if not sep or not key.strip() or key != key.strip() or "" in key.split("."):
            raise errors.ConfigError(
                f"Malformed argument {arg!r} on the {errors.COMMAND_LINE}: expected `key=value` (e.g. `epochs=10`, "
                f"`model.hidden=128`, or `{FILE_KEY}=path/to/file.yaml`)."
            )
        if key == FILE_KEY:
            path, path_name = value, FILE_KEY
        else:
            _check_readable(schema, key, value)
            overrides.append(arg)
    keys = [str(arg).partition("=")[0] for arg in overrides]
    for outer in keys:
        inner = next((k for k in keys if k.startswith(outer + ".")), None)
        if inner is not None:
            raise errors.ConfigError(
                f"Config keys `{outer}` and `{inner}` both given on the {errors.COMMAND_LINE}: `{inner}` is inside "
                f"`{outer}`, which the other argument replaces whole. Give one of the two."
            )
    merged = merging.structured(schema)
    if path is not None:
        merged = merging.merge(schema, merged, files.load(path, path_name), source=str(path))
    if overrides:
        try:
            dotlist = OmegaConf.from_dotlist(overrides)
        except (oc_errors.OmegaConfBaseException, ValueError, TypeError) as error:
            key = getattr(error, "full_key", None) or keys[0]
            raise errors.ConfigError(
                f"Config key `{key}` on the {errors.COMMAND_LINE} cannot be read ({_sources(path, overrides)}): "
                f"{errors.first_line(error)}."
            ) from None
        merged = merging.merge(schema, merged, dotlist, source=errors.COMMAND_LINE)
    try:
        instance = schema_lib.convert(OmegaConf.to_object(merged), schema_lib.ORIGINALS)
    except oc_errors.MissingMandatoryValue as error:
        key = error.full_key
        assert key is not None  # OmegaConf raises it through format_and_raise, which always sets full_key
        raise errors.ConfigError(
            f"Config key `{key}` has no value (expected {schema_lib.expected(schema, key)}); set it in the YAML file "
            f"or on the {errors.COMMAND_LINE} as `{key}=...`."
        ) from None
    except oc_errors.OmegaConfBaseException as error:  # an interpolation (`${...}`) that cannot be resolved
        cause = error.__cause__
        if not isinstance(cause, oc_errors.OmegaConfBaseException) and isinstance(cause, ValueError | TypeError):
            raise errors.ConfigError(  # the schema's __post_init__, called by OmegaConf
                f"{schema.__name__} rejected the config ({_sources(path, overrides)}): {cause}"
            ) from None
        key = error.full_key or "?"
        raise errors.ConfigError(
            f"Config key `{key}` ({_sources(path, overrides)}) cannot be resolved: {errors.first_line(error)}. "
            f"Give `{key}` a plain value (interpolations `${{...}}` must name an existing key)."
        ) from None
    except (ValueError, TypeError) as error:  # raised by the schema's own __post_init__
        raise errors.ConfigError(
            f"{schema.__name__} rejected the config ({_sources(path, overrides)}): {error}"
        ) from None
    assert isinstance(instance, schema)  # to_object instantiates the structured config's dataclass
    _check_containers(schema, instance, "", path, overrides)
    return instance


_SCALARS = (int, float, str, bool)


def _check_argv(argv: Any) -> None:
    """``argv`` is a list (or tuple) of str: ``sys.argv[1:]``, not one string (which would be read character by
    character)."""
    if isinstance(argv, str | bytes) or not isinstance(argv, Sequence):
        hint = f" Pass a list: argv=[{argv!r}]." if isinstance(argv, str) else ""
        raise TypeError(
            f"`argv` must be a list of `key=value` strings (e.g. sys.argv[1:]), got argv={argv!r:.80} "
            f"({type(argv).__name__}).{hint}"
        )
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise TypeError(
                f"`argv` must hold only `key=value` strings, got argv[{i}]={arg!r:.80} ({type(arg).__name__})."
            )


def _check_containers(schema: type, instance: Any, prefix: str, path, overrides: list[str]) -> None:
    """The values inside ``dict[K, V]``, ``list[V]`` and ``tuple[V, ...]`` fields have the type ``V`` says.

    OmegaConf checks a typed container's values when they are scalars, but takes a mapping or a list for a scalar
    ``V`` (``counts.a.b=1`` under ``counts: dict[str, int]`` gives ``{"a": {"b": 1}}``).
    """
    hints = schema_lib.type_hints(schema)
    for field in dataclasses.fields(schema):
        value, kind = getattr(instance, field.name), hints.get(field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_containers(type(value), value, f"{key}.", path, overrides)
            continue
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin in (dict, Mapping) and len(args) == 2:
            items = [(f"{key}.{k}", v) for k, v in value.items()] if isinstance(value, Mapping) else []
        elif origin in (list, Sequence, tuple) and args:
            items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list | tuple) else []
        else:
            continue
        element = args[-1]
        if element not in _SCALARS:
            continue
        for item_key, item in items:
            if isinstance(item, Mapping | list | tuple):
                raise errors.ConfigError(
                    f"Config key `{item_key}` ({_sources(path, overrides)}) has a value of the wrong type: "
                    f"{item_key}={item!r} ({errors.type_name(item)}), expected {element.__name__}."
                )


def _check_readable(schema: type, key: str, value: str) -> None:
    """A ConfigError naming ``key`` when the value of ``key=value`` is not readable as YAML or as OmegaConf's
    interpolation grammar (``[1``, ``${``, ``*x``)."""
    try:
        OmegaConf.from_dotlist([f"{key}={value}"])
    except (yaml.YAMLError, oc_errors.OmegaConfBaseException) as error:
        raise errors.ConfigError(
            f"Config key `{key}` on the {errors.COMMAND_LINE} has a value that cannot be read: {key}={value!r} "
            f"({errors.first_line(error)}). Expected {schema_lib.expected(schema, key)}; quote a string that YAML "
            f'would read otherwise (`{key}="..."`).'
        ) from None


def _sources(path, overrides: list[str]) -> str:
    parts = [f"file {str(path)!r}"] if path is not None else ["defaults"]
    if overrides:
        parts.append(f"{errors.COMMAND_LINE} {' '.join(overrides)}")
    return ", ".join(parts)
