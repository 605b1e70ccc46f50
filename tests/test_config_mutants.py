"""jddp.config: the expected type named for every kind of annotation, the key blamed for a bad file, the sources of a
rejected config, run fields and their fingerprint, and saving into new, existing or failing places."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import textwrap
from typing import Any, List, Optional  # noqa: UP035  the typing forms are what these tests read

import pytest
from omegaconf import OmegaConf

from jddp import config
from jddp.config import ConfigError, merging


@dataclasses.dataclass(frozen=True)
class Model:
    hidden: int = 64
    dims: tuple[int, ...] = (8, 8)


@dataclasses.dataclass(frozen=True)
class Head:
    size: int | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    epochs: int = 3
    name: str = "run"
    seed: Optional[int] = None  # noqa: UP045  typing.Optional is typing.Union, not types.UnionType
    devices: int | None = None
    sizes: List[int] = dataclasses.field(default_factory=lambda: [1, 2])  # noqa: UP006  str() says "typing.List"
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    layers: dict[str, Model] = dataclasses.field(default_factory=dict)
    heads: dict[str, Head] = dataclasses.field(default_factory=dict)
    extra: Any = dataclasses.field(default_factory=Model)
    model: Model = dataclasses.field(default_factory=Model)

    def __post_init__(self):
        if self.epochs < 0:
            raise ValueError(f"`epochs` must be >= 0, got epochs={self.epochs}.")


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def message(argv=(), path=None) -> str:
    with pytest.raises(ConfigError) as error:
        config.parse(Config, list(argv), path=path)
    return str(error.value)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["seed=x"], "seed='x' (str), expected int | None."),
        (["devices=x"], "devices='x' (str), expected int | None."),
        (["sizes=3"], "expected List[int]."),
        (["counts.a=x"], "counts.a='x' (str), expected int."),
        (["layers.a.hidden=x"], "layers.a.hidden='x' (str), expected int."),
        (
            ["sizes=[1,x]"],
            "`sizes[1]` on the command line has a value of the wrong type: sizes[1]='x' (str), expected a "
            "field of the schema.",
        ),
    ],
    ids=["typing-optional", "pep604-optional", "typing-list", "mapping-value", "field-of-mapping-value", "list-item"],
)
def test_a_wrong_type_names_the_annotated_type(argv, expected):
    """Optional[int] and int | None both read `int | None`; typing's prefix is dropped; a mapping's value type is
    followed into a dataclass; a list element, which has no field, falls back to "a field of the schema"."""
    assert message(argv).endswith(expected)


@pytest.mark.parametrize(
    "text",
    ["epochs: 5\nmodel: 3\n", "seed: '???'\nmodel: 3\n", "model: 3\nname: '???'\n"],
    ids=["good-key-first", "missing-optional-first", "missing-after"],
)
def test_a_bad_file_blames_the_key_that_is_wrong(tmp_path, text):
    """OmegaConf does not name the key for a scalar given to a dataclass field: the key found is the wrong one, not
    a good key before it, and a `???` (missing) value elsewhere in the file does not stop the search."""
    assert message(path=write(tmp_path, text)).endswith(
        "Config key `model` in " + str(tmp_path / "c.yaml") + " has a value of the wrong type: model=3 (int), "
        "expected Model."
    )


def test_the_key_search_names_the_first_leaf_that_fails_alone_else_a_question_mark():
    base = OmegaConf.structured(Config)
    bad = OmegaConf.create({"epochs": 5, "name": "x", "model": 3, "extra": {"hidden": 2}})
    assert merging._first_bad_key(base, bad) == "model"
    assert merging._first_bad_key(base, OmegaConf.create({"epochs": 5, "model": {"hidden": 2}})) == "?"


def test_the_value_quoted_is_the_one_given_under_a_key_with_a_dot(tmp_path):
    """A mapping key may contain a dot (a file name): the value quoted is OmegaConf's, not a lookup of the dotted
    path (which finds nothing)."""
    assert "counts.a.b='x' (str)" in message(path=write(tmp_path, "counts: {'a.b': x}\n"))


def test_an_empty_key_is_named_as_empty(tmp_path):
    assert message(path=write(tmp_path, "'': 1\n")).startswith("Unknown config key `` in ")


def test_an_unknown_key_under_a_field_typed_any_is_a_config_error():
    assert message(["extra.zzz=1"]).startswith("Unknown config key `extra.zzz` on the command line. ")


def test_a_file_that_is_not_a_mapping_names_what_it_holds(tmp_path):
    assert message(path=write(tmp_path, "- 1\n- 2\n")).endswith(
        "must hold a mapping of keys to values, got a ListConfig."
    )


def test_a_rejected_config_names_the_file_and_every_override(tmp_path):
    path = write(tmp_path, "name: y\n")
    assert message(["epochs=-1", "name=x"], path=path) == (
        f"Config rejected the config (file {path!r}, command line epochs=-1 name=x): `epochs` must be >= 0, got "
        "epochs=-1."
    )


def test_a_config_file_whose_path_holds_an_equals_sign(tmp_path):
    """`config=FILE` splits at the first `=`: the rest is the path."""
    path = write(tmp_path, "epochs: 7\n", "lr=0.1.yaml")
    assert config.parse(Config, [f"config={path}"]).epochs == 7


def test_run_fields_keep_their_default_and_are_left_out_of_the_fingerprint():
    from jddp.checkpoint import digest

    @dataclasses.dataclass(frozen=True)
    class Inner:
        width: int = 3
        log_dir: str = config.run_field("logs")

    @dataclasses.dataclass(frozen=True)
    class Run:
        lr: float = 0.1
        devices: int = config.run_field(8)
        inner: Inner = dataclasses.field(default_factory=Inner)

    assert Run() == Run(0.1, 8, Inner(3, "logs"))
    plain = {"inner": {"width": 3}, "lr": 0.1}
    want = hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]
    assert digest.config_fingerprint(Run()) == (want, plain)
    assert digest.config_fingerprint(Run(devices=1, inner=Inner(log_dir="elsewhere")))[0] == want


def test_save_makes_missing_parents_and_overwrites(tmp_path):
    target = tmp_path / "a" / "b" / "config.yaml"
    config.save(Config(epochs=1), target)
    config.save(Config(epochs=2), target)
    assert config.parse(Config, path=target).epochs == 2
    assert [p.name for p in target.parent.iterdir()] == ["config.yaml"]


def test_a_failed_save_raises_its_own_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails before the temporary file exists (a full disk at open): its error, not the cleanup's."""

    def fail(self, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", fail)
    with pytest.raises(OSError, match="No space left on device"):
        config.save(Config(), tmp_path / "config.yaml")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make", [dict, OmegaConf.create], ids=["mapping", "omegaconf"])
def test_to_yaml_resolves_interpolations(make):
    assert config.to_yaml(make({"a": 1, "b": "${a}"})) == "a: 1\nb: 1\n"


def test_to_yaml_names_the_type_it_refuses():
    with pytest.raises(TypeError, match=r"or a mapping, got <class 'int'>\.$"):
        config.to_yaml(3)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["epochs={a: 1}"], "epochs={'a': 1} (dict), expected int."),
        (["name=[1,2]"], "name=[1, 2] (list), expected str."),
        (["model.hidden=[1]"], "model.hidden=[1] (list), expected int."),
    ],
    ids=["mapping-for-int", "list-for-str", "list-for-nested-int"],
)
def test_a_mapping_or_list_where_a_value_belongs_is_named_dict_or_list(argv, expected):
    """OmegaConf hands over its own containers (DictConfig, ListConfig) as the bad value; the message names the
    Python types a user wrote."""
    assert message(argv).endswith(expected)


def test_a_mapping_given_to_a_top_level_list_field_blames_that_field():
    """`sizes.a=1` for a `List[int]` field: the field `sizes` is wrong, not a key `sizes.a` it cannot have."""
    assert message(["sizes.a=1"]).endswith("`sizes` on the command line has a value of the wrong type: "
                                           "sizes={'a': 1} (dict), expected List[int].")  # fmt: skip


def test_a_mapping_given_to_a_tuple_inside_a_mapping_value_blames_the_tuple():
    """Under `layers: dict[str, Model]` the entry's field `layers.a.dims` is wrong, not the whole mapping."""
    assert message(["layers.a.dims.b=1"]).endswith(
        "`layers.a.dims` on the command line has a value of the wrong type: layers.a.dims={'b': 1} (dict), "
        "expected tuple[int, ...]."
    )


def test_a_file_that_is_no_config_is_named(tmp_path):
    """Valid YAML that OmegaConf cannot hold (a `null:` key): the message starts with the file's path."""
    path = write(tmp_path, "null: 1\n")
    assert message(path=path).startswith(f"Config file {path!r} cannot be read as a config: ")
