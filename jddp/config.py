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
line"); no OmegaConf exception (``ValidationError``, ``ConfigKeyError``, ...) and
no YAML error reaches the caller. This module imports no JAX, so a bad config
fails in a fraction of a second, before devices, processes or compilation.

Field types: ``int``, ``float``, ``bool``, ``str``, an ``Enum`` (a member's
name, or its value), ``Literal[...]``, a nested dataclass, ``list``/``tuple``/
``dict`` of those, and ``X | None`` / ``Optional[X]`` of any of them. A field
with a non-Optional type and a ``None`` default (minGPT's ``block_size: int =
None``) is read as ``int | None``: the dataclass itself holds None there, so the
config does too.

None is spelled as in YAML: ``key=null`` (or ``~``, or an empty ``key=``) on the
command line, ``key: null`` in a file. The Python spelling ``None`` is the string
``"None"``: the value of a ``str`` field, and a ``ConfigError`` (that says to
write ``null``) for any other type. ``nan``, ``inf`` are floats.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors
from omegaconf import nodes as oc_nodes

from jddp import validate

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

    Raises:
      TypeError: ``default`` is not a value a config field holds (None, a bool, int, float, str, an Enum member, a
        frozen dataclass instance, or a tuple of those).
    """
    if not _is_default(default):
        raise TypeError(
            f"`default` must be a value a config field holds (None, a bool, int, float, str, an Enum member, a frozen "
            f"dataclass instance, or a tuple of those), got default={default!r:.80} ({type(default).__name__}). A "
            "list or dict default goes in a tuple, or in a field of its own with default_factory."
        )
    return dataclasses.field(default=default, metadata={FINGERPRINT: False})


def _is_default(value: Any) -> bool:
    """A value a config field can default to: immutable (dataclasses refuses a list, dict or set default) and one
    OmegaConf holds."""
    if value is None or isinstance(value, bool | int | float | str | enum.Enum):
        return True
    if isinstance(value, tuple):
        return all(_is_default(v) for v in value)
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


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
            raise ConfigError(
                f"Malformed argument {arg!r} on the {COMMAND_LINE}: expected `key=value` (e.g. `epochs=10`, "
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
            raise ConfigError(
                f"Config keys `{outer}` and `{inner}` both given on the {COMMAND_LINE}: `{inner}` is inside `{outer}`, "
                f"which the other argument replaces whole. Give one of the two."
            )
    merged = _structured(schema)
    if path is not None:
        merged = _merge(schema, merged, _load(path, path_name), source=str(path))
    if overrides:
        try:
            dotlist = OmegaConf.from_dotlist(overrides)
        except (oc_errors.OmegaConfBaseException, ValueError, TypeError) as error:
            key = getattr(error, "full_key", None) or keys[0]
            raise ConfigError(
                f"Config key `{key}` on the {COMMAND_LINE} cannot be read ({_sources(path, overrides)}): "
                f"{_first_line(error)}."
            ) from None
        merged = _merge(schema, merged, dotlist, source=COMMAND_LINE)
    try:
        instance = _convert(OmegaConf.to_object(merged), _ORIGINALS)
    except oc_errors.MissingMandatoryValue as error:
        key = error.full_key
        assert key is not None  # OmegaConf raises it through format_and_raise, which always sets full_key
        raise ConfigError(
            f"Config key `{key}` has no value (expected {_expected(schema, key)}); set it in the YAML file "
            f"or on the {COMMAND_LINE} as `{key}=...`."
        ) from None
    except oc_errors.OmegaConfBaseException as error:  # an interpolation (`${...}`) that cannot be resolved
        cause = error.__cause__
        if not isinstance(cause, oc_errors.OmegaConfBaseException) and isinstance(cause, ValueError | TypeError):
            raise ConfigError(  # the schema's __post_init__, called by OmegaConf
                f"{schema.__name__} rejected the config ({_sources(path, overrides)}): {cause}"
            ) from None
        key = error.full_key or "?"
        raise ConfigError(
            f"Config key `{key}` ({_sources(path, overrides)}) cannot be resolved: {_first_line(error)}. "
            f"Give `{key}` a plain value (interpolations `${{...}}` must name an existing key)."
        ) from None
    except (ValueError, TypeError) as error:  # raised by the schema's own __post_init__
        raise ConfigError(f"{schema.__name__} rejected the config ({_sources(path, overrides)}): {error}") from None
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
    hints = _hints(schema)
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
    """Writes ``to_yaml(config)`` to ``path`` atomically (a temporary file, then a rename), creating its directory;
    an existing file there is replaced.

    Raises:
      TypeError: ``config`` is not a config (see ``to_yaml``), or ``path`` not a path; checked before anything is
        written.
      IsADirectoryError: ``path`` is a directory.
    """
    text = to_yaml(config)
    path = Path(typing.cast(str, validate.check_path("path", path)))
    if path.is_dir():
        raise IsADirectoryError(f"`path` must be a file to write the config to, got the directory path={str(path)!r}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # plain open: the file gets the umask's mode
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------- helpers


def _allows_none(t: Any) -> bool:
    if t is Any or t is type(None):
        return True
    is_union = isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union
    return is_union and type(None) in typing.get_args(t)


def _hints(schema: type) -> dict[str, Any]:
    """The fields' types, with a None default making a type Optional (``n: int = None`` is ``n: int | None``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.default is None and f.name in hints and not _allows_none(hints[f.name]):
            hints[f.name] = typing.Optional[hints[f.name]]  # noqa: UP045  the type is a value here, not syntax
    return hints


# A schema whose fields (or nested dataclasses' fields) have a non-Optional type and a None default goes to
# OmegaConf as a copy with those types made Optional (OmegaConf refuses the None default otherwise); the copy's
# instances are turned back into the schema's, whose __post_init__ then runs. Other schemas go as they are.
_COPIES: dict[type, type] = {}  # schema -> the copy OmegaConf gets (the schema itself when none is needed)
_ORIGINALS: dict[type, type] = {}  # copy -> schema


def _with_copies(t: Any) -> Any:
    """``t`` with every dataclass in it replaced by its copy (``t`` itself when nothing changes)."""
    if isinstance(t, type) and dataclasses.is_dataclass(t):
        return _copy(t)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is None or not args or origin is Literal:
        return t
    new = tuple(a if a is Ellipsis else _with_copies(a) for a in args)
    if all(a is b for a, b in zip(new, args, strict=True)):
        return t
    if origin is typing.Union or origin is types.UnionType:
        return typing.Union[new]  # noqa: UP007  built from a tuple of types
    return origin[new]  # list, dict, tuple and their typing/collections.abc forms


def _copy(schema: type) -> type:
    if schema in _COPIES:
        return _COPIES[schema]
    _COPIES[schema] = schema  # a schema that refers to itself is left as it is there
    hints, plain = _hints(schema), typing.get_type_hints(schema)
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
                    default_factory=lambda d=f.default: _convert(d, _COPIES)  # the copy's default, never shared
                )
                if is_instance
                else dataclasses.field(default=f.default)
            )
        elif f.default_factory is not dataclasses.MISSING:
            field = dataclasses.field(default_factory=lambda make=f.default_factory: _convert(make(), _COPIES))
        else:
            field = dataclasses.field()
        specs.append((f.name, t, field))
    if changed:
        copy = dataclasses.make_dataclass(schema.__name__, specs)
        copy.__module__, copy.__qualname__ = schema.__module__, schema.__qualname__
        _COPIES[schema], _ORIGINALS[copy] = copy, schema
    return _COPIES[schema]


def _convert(value: Any, classes: dict[type, type]) -> Any:
    """``value`` with each dataclass instance of a class in ``classes`` rebuilt as the class it maps to."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        target = classes.get(type(value), type(value))
        items = {f.name: _convert(getattr(value, f.name), classes) for f in dataclasses.fields(value) if f.init}
        return value if target is type(value) and all(items[k] is getattr(value, k) for k in items) else target(**items)
    if isinstance(value, list):
        return [_convert(v, classes) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:  # not a NamedTuple
        return tuple(_convert(v, classes) for v in value)
    if isinstance(value, dict):
        return {k: _convert(v, classes) for k, v in value.items()}
    return value


def _structured(schema: type) -> DictConfig:
    """``OmegaConf.structured(schema)``; a field OmegaConf cannot hold is a ConfigError naming it."""
    try:
        return OmegaConf.structured(_copy(schema))
    except oc_errors.OmegaConfBaseException as error:
        key = error.full_key or "?"
        raise ConfigError(
            f"The field `{key}` of {schema.__name__} cannot be a config field: {_first_line(error)}. Give it a "
            "type jddp.config checks (int, float, bool, str, an Enum, a Literal, a dataclass, a list, tuple or dict "
            "of those, or any of them | None) and a default of that type, or the type Any (not checked)."
        ) from None


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0].rstrip(".") if str(error) else type(error).__name__


def _check_readable(schema: type, key: str, value: str) -> None:
    """A ConfigError naming ``key`` when the value of ``key=value`` is not readable as YAML or as OmegaConf's
    interpolation grammar (``[1``, ``${``, ``*x``)."""
    try:
        OmegaConf.from_dotlist([f"{key}={value}"])
    except (yaml.YAMLError, oc_errors.OmegaConfBaseException) as error:
        raise ConfigError(
            f"Config key `{key}` on the {COMMAND_LINE} has a value that cannot be read: {key}={value!r} "
            f"({_first_line(error)}). Expected {_expected(schema, key)}; quote a string that YAML would read "
            f'otherwise (`{key}="..."`).'
        ) from None


def _as_omegaconf(config: Any) -> DictConfig:
    if isinstance(config, DictConfig):
        return config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        _copy(type(config))  # a field `n: int = None` holds None as `n: int | None` does
        return OmegaConf.structured(_convert(config, _COPIES))
    if isinstance(config, Mapping):
        return OmegaConf.create(dict(config))
    raise TypeError(f"`config` must be a dataclass instance, an OmegaConf config or a mapping, got {type(config)!r}.")


def _load(path: str | os.PathLike, name: str) -> DictConfig:
    """The mapping in the YAML file ``path``, given as ``name`` (the argument ``path``, or ``config=`` on the command
    line)."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise ConfigError(
            f"Config file {str(path)!r} {what} (resolved: {file.absolute()}); give `{name}` an existing YAML file."
        )
    try:
        # OmegaConf reads a file holding one word (`x`) as the mapping {x: None}, and fails with an OSError on one
        # number: a file that holds a single value is said to be one here.
        raw = yaml.load(file.read_text(), Loader=yaml.BaseLoader)  # strings, lists and dicts only: no tags run
        if raw is not None and not isinstance(raw, dict | list):
            raise ConfigError(
                f"Config file {str(path)!r} (given as `{name}`) must hold a mapping of keys to values (`key: value` "
                f"lines), got the single value {raw!r:.80}."
            )
        loaded = OmegaConf.load(file)
    except yaml.YAMLError as error:
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {error}") from None
    except oc_errors.OmegaConfBaseException as error:  # valid YAML that is no config, e.g. a `null:` key
        if error.full_key:  # a value OmegaConf cannot read, e.g. a broken interpolation `${`
            raise ConfigError(
                f"Config key `{error.full_key}` in {str(path)!r} has a value that cannot be read: "
                f"{_first_line(error)}. Quote a string that holds `${{`, or fix the interpolation."
            ) from None
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
            f"({_type_name(value)}), expected {_expected(schema, key)}.{_none_hint(schema, key, value)}"
        ) from None
    assert isinstance(merged, DictConfig)  # a mapping merged into a DictConfig stays a DictConfig
    return merged


def _none_hint(schema: type, key: str, value: Any) -> str:
    """What to write for None: ``null`` (not ``None``), and only in an Optional field."""
    if isinstance(value, str) and value.strip() in ("None", "none"):
        return f" None is spelled `{key}=null` (YAML's spelling; `None` is a string)."
    t = _field_type(schema, key)
    if value is None and t is not None and not _allows_none(t):
        empty = f" (an empty `{key}=` is None; `{key}=''` is the empty string)" if t is str else ""
        return (
            f" `{key}` is not Optional: give it a value, or declare it "
            f"`{_expected(schema, key)} | None` in {schema.__name__}{empty}."
        )
    return ""


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
    try:
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
    except oc_errors.OmegaConfBaseException:  # an interpolation that does not resolve (`${nope}`): its text
        raw: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        return raw
    return OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value


def _field_type(schema: type, key: str) -> Any:
    """The annotated type of the dotted ``key`` in ``schema``, or None if there is no such field."""
    current: Any = schema
    for part in key.split("."):
        if typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
            continue
        if not dataclasses.is_dataclass(current):
            return None
        hints = _hints(typing.cast(type, current))
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
