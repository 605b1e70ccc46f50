"""Typed run configs: a dataclass schema, a YAML file and ``key=value`` overrides, checked before any JAX work.

    @dataclasses.dataclass(frozen=True)
    class Config:
        epochs: int = 30          # passes over the training set
        learning_rate: float = 3e-3

    config = jddp.config.parse(Config, sys.argv[1:], path="configs/mnist1d.yaml")

Sources, later wins: the dataclass defaults, the YAML file (``path``, or
``config=FILE`` on the command line), then ``key=value`` overrides (dotted
keys reach nested dataclasses: ``model.hidden=128``). OmegaConf structured
configs check every value against the field's type (``"3"`` becomes ``3`` for
an ``int`` field, ``3.5`` does not). Unknown keys, wrong types, a missing or
unreadable file and a malformed override raise ``ConfigError`` naming the key,
the value, the expected type and where it came from (the file, or "command
line"). This module imports no JAX, so a bad config fails in a fraction of a
second, before devices, processes or compilation.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors
from omegaconf import nodes as oc_nodes

T = TypeVar("T")
COMMAND_LINE = "command line"
FILE_KEY = "config"  # `config=FILE` on the command line names the YAML file


FINGERPRINT = (
    "fingerprint"  # field metadata key that jddp.checkpoint reads (digest.FINGERPRINT); False: not fingerprinted
)


def run_field(default: Any) -> Any:
    """A config field that says where or how a run happens, not what it computes.

    ``jddp.Checkpointer`` leaves such fields out of the config fingerprint, so a
    run resumed with another value (other devices, log directory, progress
    bar) is not a config change.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     learning_rate: float = 1e-3
      ...     devices: int = run_field(0)
      >>> [f.metadata.get(FINGERPRINT, True) for f in dataclasses.fields(Config)]
      [True, False]
    """
    return dataclasses.field(default=default, metadata={FINGERPRINT: False})


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names the key, the source and what was expected."""


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
      TypeError: if ``schema`` is not a dataclass type.
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
    overrides = []
    for arg in argv:
        key, sep, value = str(arg).partition("=")
        if not sep or not key.strip() or key != key.strip():
            raise ConfigError(
                f"Malformed argument {arg!r} on the {COMMAND_LINE}: expected `key=value` (e.g. `epochs=10`, "
                f"`model.hidden=128`, or `{FILE_KEY}=path/to/file.yaml`)."
            )
        if key == FILE_KEY:
            path = value
        else:
            overrides.append(arg)
    merged = OmegaConf.structured(schema)
    if path is not None:
        merged = _merge(schema, merged, _load(path), source=str(path))
    if overrides:
        merged = _merge(schema, merged, OmegaConf.from_dotlist(overrides), source=COMMAND_LINE)
    try:
        instance = OmegaConf.to_object(merged)
    except oc_errors.MissingMandatoryValue as error:
        key = error.full_key
        assert key is not None  # OmegaConf raises it through format_and_raise, which always sets full_key
        raise ConfigError(
            f"Config key `{key}` has no value (expected {_expected(schema, key)}); set it in the YAML file "
            f"or on the {COMMAND_LINE} as `{key}=...`."
        ) from None
    except (ValueError, TypeError) as error:  # raised by the schema's own __post_init__
        raise ConfigError(f"{schema.__name__} rejected the config ({_sources(path, overrides)}): {error}") from None
    assert isinstance(instance, schema)  # to_object instantiates the structured config's dataclass
    _check_containers(schema, instance, "", path, overrides)
    return instance


_SCALARS = (int, float, str, bool)


def _check_containers(schema: type, instance: Any, prefix: str, path, overrides: list[str]) -> None:
    """The values inside ``dict[K, V]``, ``list[V]`` and ``tuple[V, ...]`` fields have the type ``V`` says.

    OmegaConf checks a typed container's values when they are scalars, but takes a mapping or a list for a scalar
    ``V`` (``counts.a.b=1`` under ``counts: dict[str, int]`` gives ``{"a": {"b": 1}}``).
    """
    hints = typing.get_type_hints(schema)
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
                raise ConfigError(
                    f"Config key `{item_key}` ({_sources(path, overrides)}) has a value of the wrong type: "
                    f"{item_key}={item!r} ({_type_name(item)}), expected {element.__name__}."
                )


def to_yaml(config: Any) -> str:
    """The resolved config (a dataclass instance, an OmegaConf config or a mapping) as YAML."""
    return OmegaConf.to_yaml(_as_omegaconf(config), resolve=True)


def save(config: Any, path: str | os.PathLike) -> None:
    """Writes ``to_yaml(config)`` to ``path`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = to_yaml(config)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # plain open: the file gets the umask's mode
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------- helpers


def _as_omegaconf(config: Any) -> DictConfig:
    if isinstance(config, DictConfig):
        return config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return OmegaConf.structured(config)
    if isinstance(config, Mapping):
        return OmegaConf.create(dict(config))
    raise TypeError(f"`config` must be a dataclass instance, an OmegaConf config or a mapping, got {type(config)!r}.")


def _load(path: str | os.PathLike) -> DictConfig:
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise ConfigError(
            f"Config file {str(path)!r} {what} (resolved: {file.absolute()}); give an existing YAML file."
        )
    try:
        loaded = OmegaConf.load(file)
    except yaml.YAMLError as error:
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {error}") from None
    except oc_errors.OmegaConfBaseException as error:  # valid YAML that is no config, e.g. a `null:` key
        raise ConfigError(
            f"Config file {str(path)!r} cannot be read as a config: {str(error).splitlines()[0]}. Keys must be "
            "names (strings), as the fields of the config are."
        ) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            f"Config file {str(path)!r} must hold a mapping of keys to values, got a {type(loaded).__name__}."
        )
    return loaded


def _merge(schema: type, base: DictConfig, other: DictConfig, *, source: str) -> DictConfig:
    where = "on the command line" if source == COMMAND_LINE else f"in {source}"
    try:
        merged = OmegaConf.merge(base, other)
    except oc_errors.ConfigKeyError as error:
        key = error.full_key or str(error.key)
        raise ConfigError(f"Unknown config key `{key}` {where}. {_suggest(schema, key)}") from None
    except (oc_errors.ValidationError, oc_errors.OmegaConfBaseException, TypeError) as error:
        # A wrong type (ValidationError), or a mapping where a list belongs and the like (OmegaConf's TypeError).
        full_key = getattr(error, "full_key", None)
        if full_key:  # OmegaConf's own key (a mapping's keys may hold dots): its value, unwrapped from its node
            key, value = full_key, getattr(error, "value", None)
            value = value._value() if isinstance(value, oc_nodes.ValueNode) else value
        else:
            key = _leaf_field(schema, _first_bad_key(base, other))
            value = _get(other, key)
        raise ConfigError(
            f"Config key `{key}` {where} has a value of the wrong type: {key}={value!r} "
            f"({_type_name(value)}), expected {_expected(schema, key)}."
        ) from None
    assert isinstance(merged, DictConfig)  # a mapping merged into a DictConfig stays a DictConfig
    return merged


def _first_bad_key(base: DictConfig, cfg: DictConfig) -> str:
    """The first key of ``cfg`` that cannot be merged into ``base`` (OmegaConf omits it for some values)."""
    for key in _keys(cfg):
        if _is_missing(cfg, key):  # `???`: a value still to be given, never the bad one
            continue
        single = OmegaConf.create()
        OmegaConf.update(single, key, _get(cfg, key), force_add=True)
        try:
            OmegaConf.merge(base, single)
        except (oc_errors.OmegaConfBaseException, TypeError):
            return key
    return "?"


def _leaf_field(schema: type, key: str) -> str:
    """``key``, or the field above it that has no keys of its own (``model.dims`` for ``model.dims.a`` when
    ``dims`` is a tuple): the field whose value is wrong."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        t = _field_type(schema, ".".join(parts[:i]))
        if t is not None and not dataclasses.is_dataclass(t) and typing.get_origin(t) is not dict:
            return ".".join(parts[:i])
    return key


def _is_missing(cfg: DictConfig, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else cfg
    try:
        return isinstance(node, DictConfig) and OmegaConf.is_missing(node, name)
    except oc_errors.OmegaConfBaseException:
        return False


def _type_name(value: Any) -> str:
    """The Python type a user would name: OmegaConf's containers as ``dict`` and ``list``."""
    if isinstance(value, DictConfig):
        return "dict"
    if OmegaConf.is_list(value):
        return "list"
    return type(value).__name__


def _keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of the leaves of ``cfg`` (lists and empty mappings count as leaves)."""
    out = []
    for k, v in cfg.items_ex(resolve=False):
        out.extend(_keys(v, f"{prefix}{k}.") if isinstance(v, DictConfig) and len(v) else [f"{prefix}{k}"])
    return out


def _get(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key, throw_on_missing=False)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _field_type(schema: type, key: str) -> Any:
    """The annotated type of the dotted ``key`` in ``schema``, or None if there is no such field."""
    current: Any = schema
    for part in key.split("."):
        if typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
            continue
        if not dataclasses.is_dataclass(current):
            return None
        hints = typing.get_type_hints(current)
        if part not in hints:
            return None
        current = hints[part]
    return current


def _expected(schema: type, key: str) -> str:
    t = _field_type(schema, key)
    if t is None:
        return "a field of the schema"
    if isinstance(t, type) and not typing.get_args(t):
        return t.__name__
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        return " | ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in typing.get_args(t))
    return str(t).replace("typing.", "")


def _suggest(schema: type, key: str) -> str:
    parent, _, name = key.rpartition(".")
    owner = _field_type(schema, parent) if parent else schema
    if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):  # a field's type, never an instance
        return f"`{parent}` has no keys."
    fields = [f.name for f in dataclasses.fields(owner)]
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"Did you mean `{parent + '.' if parent else ''}{close[0]}`? " if close else ""
    return f"{hint}{owner.__name__} has the keys {', '.join(fields)}."


def _sources(path, overrides: list[str]) -> str:
    parts = [f"file {str(path)!r}"] if path is not None else ["defaults"]
    if overrides:
        parts.append(f"{COMMAND_LINE} {' '.join(overrides)}")
    return ", ".join(parts)
