"""A schema's OmegaConf config (``structured``) and the merge of a source into it (``merge``), with the key, the value
and the expected type that a failed merge blames."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors
from omegaconf import nodes as oc_nodes

from jddp.config import errors
from jddp.config import schema as schema_lib


def structured(schema: type) -> DictConfig:
    """``OmegaConf.structured(schema)``; a field OmegaConf cannot hold is a ConfigError naming it."""
    try:
        return OmegaConf.structured(schema_lib.omegaconf_class(schema))
    except oc_errors.OmegaConfBaseException as error:
        key = error.full_key or "?"
        raise errors.ConfigError(
            f"The field `{key}` of {schema.__name__} cannot be a config field: {errors.first_line(error)}. Give it a "
            "type jddp.config checks (int, float, bool, str, an Enum, a Literal, a dataclass, a list, tuple or dict "
            "of those, or any of them | None) and a default of that type, or the type Any (not checked)."
        ) from None


def merge(schema: type, base: DictConfig, other: DictConfig, *, source: str) -> DictConfig:
    where = "on the command line" if source == errors.COMMAND_LINE else f"in {source}"
    try:
        merged = OmegaConf.merge(base, other)
    except oc_errors.ConfigKeyError as error:
        key = error.full_key or str(error.key)
        raise errors.ConfigError(f"Unknown config key `{key}` {where}. {_suggest(schema, key)}") from None
    except (oc_errors.ValidationError, oc_errors.OmegaConfBaseException, TypeError) as error:
        # A wrong type (ValidationError), or a mapping where a list belongs and the like (OmegaConf's TypeError).
        full_key = getattr(error, "full_key", None)
        if full_key:  # OmegaConf's own key (a mapping's keys may hold dots): its value, unwrapped from its node
            key, value = full_key, getattr(error, "value", None)
            value = value._value() if isinstance(value, oc_nodes.ValueNode) else value
        else:
            key = _leaf_field(schema, _first_bad_key(base, other))
            value = _get(other, key)
        raise errors.ConfigError(
            f"Config key `{key}` {where} has a value of the wrong type: {key}={value!r} "
            f"({errors.type_name(value)}), expected {schema_lib.expected(schema, key)}.{_none_hint(schema, key, value)}"
        ) from None
    assert isinstance(merged, DictConfig)  # a mapping merged into a DictConfig stays a DictConfig
    return merged


def _none_hint(schema: type, key: str, value: Any) -> str:
    """What to write for None: ``null`` (not ``None``), and only in an Optional field."""
    if isinstance(value, str) and value.strip() in ("None", "none"):
        return f" None is spelled `{key}=null` (YAML's spelling; `None` is a string)."
    t = schema_lib.field_type(schema, key)
    if value is None and t is not None and not schema_lib.allows_none(t):
        empty = f" (an empty `{key}=` is None; `{key}=''` is the empty string)" if t is str else ""
        return (
            f" `{key}` is not Optional: give it a value, or declare it "
            f"`{schema_lib.expected(schema, key)} | None` in {schema.__name__}{empty}."
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
        t = schema_lib.field_type(schema, ".".join(parts[:i]))
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


def _suggest(schema: type, key: str) -> str:
    parent, _, name = key.rpartition(".")
    owner = schema_lib.field_type(schema, parent) if parent else schema
    if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):  # a field's type, never an instance
        return f"`{parent}` has no keys."
    fields = [f.name for f in dataclasses.fields(owner)]
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"Did you mean `{parent + '.' if parent else ''}{close[0]}`? " if close else ""
    return f"{hint}{owner.__name__} has the keys {', '.join(fields)}."
