"""jddp.config over generated schemas: every field type a user's dataclass may have, every bad value a command line
or a YAML file may hold, and the outcome is always the documented value or a ``ConfigError`` naming the key.

The schemas are built programmatically (``dataclasses.make_dataclass``) from a family of field kinds: int, float,
bool, str; ``Optional[X]``, ``X | None`` and minGPT's ``X = None`` (a non-Optional type with a None default, read
as ``X | None``) of each; ``Literal``, an ``Enum``, ``list[int]`` and a nested dataclass. The values: the right
type, a wrong type, ``None``, ``null``, an empty value, ``nan``, a list and a mapping for a scalar, interpolations
(``${nope}``, ``${``), malformed YAML (``[1``); the keys: the field, a key path into it, an unknown key. A grid
tries every (kind, value, key) on the command line and in a file; hypothesis combines several fields, overrides and
a file at once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import textwrap
import typing
from typing import Any, Literal, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jddp import config
from jddp.config import ConfigError


class Color(enum.Enum):
    red = 1
    blue = 2


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = 1
    b: float | None = None


@dataclasses.dataclass(frozen=True)
class Kind:
    """A field type: its annotation, default, the Python type of its values and whether it takes None."""

    name: str
    annotation: Any
    default: Any
    base: Any  # int, float, bool, str, Literal, Color, list, Inner
    optional: bool


def _kinds() -> list[Kind]:
    scalars: list[tuple[str, Any, Any]] = [("int", int, 3), ("float", float, 1.5), ("bool", bool, True)]
    scalars += [("str", str, "run"), ("literal", Literal["a", "b"], "a"), ("enum", Color, Color.red)]
    kinds = [Kind(name, t, default, t, False) for name, t, default in scalars]
    for name, t, _ in scalars:
        kinds.append(Kind(f"optional_{name}", Optional[t], None, t, True))  # noqa: UP045  typing.Union, on purpose
        kinds.append(Kind(f"{name}_or_none", t | None, None, t, True))
        kinds.append(Kind(f"{name}_eq_none", t, None, t, True))  # minGPT: `block_size: int = None`
    kinds.append(Kind("list", list[int], [1, 2], list, False))
    kinds.append(Kind("list_or_none", list[int] | None, None, list, True))
    kinds.append(Kind("nested", Inner, Inner(), Inner, False))
    kinds.append(Kind("nested_eq_none", Inner, None, Inner, True))
    return kinds


KINDS = _kinds()
VALUES = ["7", "1.5", "x", "None", "null", "", "nan", "true", "a", "blue", "[1,2]", "{a: 2}", "${nope}", "${", "[1"]


def schema_of(kinds: list[Kind], name: str = "Generated") -> type:
    fields = []
    for i, kind in enumerate(kinds):
        if isinstance(kind.default, list | Inner):
            field = dataclasses.field(default_factory=lambda d=kind.default: type(d)(d) if isinstance(d, list) else d)
        else:
            field = dataclasses.field(default=kind.default)
        fields.append((f"f{i}", kind.annotation, field))
    return dataclasses.make_dataclass(name, fields, frozen=True)


def _is(value: Any, kind: Kind) -> bool:
    """``value`` is one a field of ``kind`` may hold."""
    if value is None:
        return kind.optional
    base = kind.base
    if base is float:
        return type(value) is float
    if base in (int, bool, str):
        return type(value) is base
    if typing.get_origin(base) is Literal:
        return value in typing.get_args(base)
    if base is list:
        return isinstance(value, list) and all(type(v) is int for v in value)
    return isinstance(value, base)


def documented(kind: Kind, text: str) -> tuple[str, Any]:
    """``("ok", value)``, ``("error", None)`` or ``("any", None)`` (either, checked by type only) for ``f=text``."""
    if text in ("${nope}", "${", "[1"):  # an unknown interpolation, a broken one, malformed YAML
        return "error", None
    if text in ("null", ""):  # YAML's None, and an empty value
        return ("ok", None) if kind.optional else ("error", None)
    if text == "{a: 2}":
        return ("ok", Inner(a=2)) if kind.base is Inner else ("error", None)
    if text == "[1,2]":
        return ("ok", [1, 2]) if kind.base is list else ("error", None)
    if kind.base in (list, Inner):
        return "error", None
    base = kind.base
    if base is str:
        return "ok", {"nan": "nan", "true": "True", "1.5": "1.5"}.get(text, text)
    if text == "None":  # the string "None": not None (write `null`), so a wrong value for every type but str
        return "error", None
    if base is int:
        return ("ok", 7) if text == "7" else ("error", None)
    if base is float:
        return {"7": ("ok", 7.0), "1.5": ("ok", 1.5), "nan": ("ok", math.nan)}.get(text, ("error", None))
    if base is bool:
        return ("ok", True) if text == "true" else ("any", None)
    if base is Color:
        return ("ok", Color.blue) if text == "blue" else ("any", None) if text == "7" else ("error", None)
    return ("ok", text) if text in ("a", "b") else ("error", None)  # Literal["a", "b"]


def _same(a: Any, b: Any) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
        a == b and type(a) is type(b)
    )


def yaml_of(key: str, text: str) -> str:
    parts = key.split(".")
    lines = [f"{'  ' * i}{p}:" for i, p in enumerate(parts[:-1])]
    lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {text}")
    return "\n".join(lines) + "\n"


def outcome(schema: type, argv: list[str], path=None) -> tuple[str, Any]:
    """``("ok", instance)`` or ``("error", message)``; any other exception fails the test, naming the case."""
    try:
        return "ok", config.parse(schema, argv, path=path)
    except ConfigError as error:
        return "error", str(error)
    except Exception as error:  # the point: no other exception type
        pytest.fail(f"{schema.__name__} {argv} path={path}: {type(error).__module__}.{type(error).__name__}: {error}")


def names_a_key(message: str, keys: list[str]) -> bool:
    """The message names (in backticks) one of ``keys`` or a field above it (``f0`` for ``f0.x``); or, for a file
    that is not YAML (no key can be known), the file and the line."""
    if re.search(r"Config file '.*' is not valid YAML: .*line \d+", message, re.S):
        return True
    prefixes = {".".join(k.split(".")[: i + 1]) for k in keys for i in range(len(k.split(".")))}
    return any(re.search(rf"`{re.escape(p)}(\[\d+\])?`", message) for p in prefixes)


def test_every_kind_loads_its_default():
    schema = schema_of(KINDS)
    kind, got = outcome(schema, [])
    assert kind == "ok", got
    for i, k in enumerate(KINDS):
        assert _same(getattr(got, f"f{i}"), k.default), (k.name, getattr(got, f"f{i}"))


@pytest.mark.parametrize("source", ["command line", "file"])
def test_every_kind_and_value_gives_the_documented_value_or_a_config_error_naming_the_key(tmp_path, source):
    wrong = []
    for kind in KINDS:
        schema = schema_of([kind], f"Schema_{kind.name}")
        for text in VALUES:
            if source == "command line":
                got = outcome(schema, [f"f0={text}"])
            else:
                path = tmp_path / f"{kind.name}.yaml"
                path.write_text(yaml_of("f0", text))
                got = outcome(schema, [], path=path)
            expected, value = documented(kind, text)
            case = f"{kind.name} f0={text!r} ({source})"
            if got[0] == "error":
                if expected == "ok":
                    wrong.append(f"{case}: expected {value!r}, got ConfigError: {got[1]}")
                elif not names_a_key(got[1], ["f0"]):
                    wrong.append(f"{case}: the ConfigError does not name `f0`: {got[1]}")
            elif expected == "error":
                wrong.append(f"{case}: expected a ConfigError, got {got[1].f0!r}")
            elif expected == "ok" and not _same(got[1].f0, value):
                wrong.append(f"{case}: expected {value!r}, got {got[1].f0!r}")
            elif not _is(got[1].f0, kind):
                wrong.append(f"{case}: {got[1].f0!r} is not a value of {kind.annotation}")
    assert not wrong, f"{len(wrong)} cases:\n" + "\n".join(wrong)


@pytest.mark.parametrize("source", ["command line", "file"])
def test_unknown_keys_and_key_paths_into_values_are_config_errors_naming_the_key(tmp_path, source):
    wrong = []
    for kind in KINDS:
        schema = schema_of([kind], f"Schema_{kind.name}")
        keys = ["f0.x", "nope", "f0.x.y"] + (["f0.nope", "f0.a.b"] if kind.base is Inner else [])
        for key in keys:
            if source == "command line":
                got = outcome(schema, [f"{key}=1"])
            else:
                path = tmp_path / f"{kind.name}.yaml"
                path.write_text(yaml_of(key, "1"))
                got = outcome(schema, [], path=path)
            if got[0] == "ok" and not (kind.base is Inner and kind.optional and key == "f0.x"):
                wrong.append(f"{kind.name} {key}=1 ({source}): accepted, gave {got[1]!r}")
            elif got[0] == "error" and not names_a_key(got[1], [key]):
                wrong.append(f"{kind.name} {key}=1 ({source}): the ConfigError does not name the key: {got[1]}")
    assert not wrong, f"{len(wrong)} cases:\n" + "\n".join(wrong)


def test_none_is_spelled_null_and_the_error_says_so():
    schema = schema_of([KINDS[[k.name for k in KINDS].index("int_eq_none")]], "MinGPT")
    assert outcome(schema, ["f0=null"]) == ("ok", schema(f0=None))
    assert outcome(schema, ["f0=4"]) == ("ok", schema(f0=4))
    kind, message = outcome(schema, ["f0=None"])
    assert kind == "error" and "f0='None' (str), expected int | None" in message and "`f0=null`" in message


def test_a_non_optional_field_given_null_says_how_to_make_it_optional():
    kind, message = outcome(schema_of([KINDS[0]], "Plain"), ["f0=null"])
    assert kind == "error" and "f0=None (NoneType), expected int" in message and "int | None" in message


@st.composite
def cases(draw):
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    keys = [f"f{i}" for i in range(len(kinds))] + ["nope"]
    keys += [f"f{i}.{sub}" for i, k in enumerate(kinds) for sub in ("a", "x", "a.b") if k.base in (Inner, int)]
    pairs = st.tuples(st.sampled_from(keys), st.sampled_from(VALUES))
    argv = draw(st.lists(pairs, max_size=3))
    file = draw(st.lists(pairs, max_size=2, unique_by=lambda p: p[0].split(".")[0]))
    return kinds, argv, file


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_generated_schemas_overrides_and_files(tmp_path, case):
    """Several fields, overrides and file entries at once: the documented values, or a ConfigError naming a key
    that was given."""
    kinds, argv, file = case
    schema = schema_of(kinds, "Combined")
    path = None
    if file:
        path = tmp_path / "c.yaml"
        path.write_text("".join(yaml_of(k, v) for k, v in file))
    got = outcome(schema, [f"{k}={v}" for k, v in argv], path=path)
    if got[0] == "error":
        assert names_a_key(got[1], [k for k, _ in argv + file]), got[1]
        return
    last = {k: v for k, v in file + argv}  # later wins: the file, then the command line
    for i, kind in enumerate(kinds):
        value = getattr(got[1], f"f{i}")
        assert _is(value, kind), (kind.name, value)
        if f"f{i}" in last and not any(k.startswith(f"f{i}.") for k in last):
            expected, documented_value = documented(kind, last[f"f{i}"])
            assert expected != "error", (kind.name, last[f"f{i}"], value)
            if expected == "ok":
                assert _same(value, documented_value), (kind.name, last[f"f{i}"], value)


def test_a_schema_field_of_a_type_omegaconf_cannot_check_is_a_config_error_naming_it():
    @dataclasses.dataclass
    class Odd:
        sizes: set[int] = dataclasses.field(default_factory=set)

    kind, message = outcome(Odd, [])
    assert kind == "error" and "`sizes`" in message, message


def test_a_config_error_names_the_key_for_an_unreadable_value_on_the_command_line():
    kind, message = outcome(schema_of([KINDS[3]], "Text"), ["f0=[1"])
    assert kind == "error" and "`f0`" in message and "'[1'" in message, message


def test_the_documented_example_of_the_module():
    @dataclasses.dataclass
    class GPTConfig:  # minGPT-ddp's
        model_type: str = "gpt"
        n_layer: int = None  # type: ignore[assignment]
        n_head: int = None  # type: ignore[assignment]
        vocab_size: int = 50257
        block_size: int = None  # type: ignore[assignment]
        embd_pdrop: float = 0.1

    got = config.parse(GPTConfig, ["n_layer=4", "block_size=128"])
    assert got == GPTConfig(n_layer=4, block_size=128) and got.n_head is None
    assert "n_head: null" in textwrap.dedent(config.to_yaml(got))
