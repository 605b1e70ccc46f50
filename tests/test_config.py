"""jddp.config: precedence of defaults, file and overrides; every error names the key, the value and the source."""

from __future__ import annotations

import dataclasses
import enum
import re
import subprocess
import sys
import textwrap

import pytest

from jddp import config
from jddp.config import ConfigError
from tests import multiprocess


@dataclasses.dataclass(frozen=True)
class Model:
    hidden: int = 64  # width
    dims: tuple[int, ...] = (8, 8)  # layer sizes


@dataclasses.dataclass(frozen=True)
class Config:
    epochs: int = 3
    learning_rate: float = 1e-3
    name: str = "run"
    devices: int | None = None
    model: Model = dataclasses.field(default_factory=Model)

    def __post_init__(self):
        if self.epochs < 0:
            raise ValueError(f"`epochs` must be >= 0, got epochs={self.epochs}.")


@dataclasses.dataclass(frozen=True)
class Required:
    data_dir: str = "???"  # OmegaConf's marker for a value that must be given


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_then_file_then_command_line(tmp_path):
    path = write(tmp_path, "epochs: 5\nlearning_rate: 0.01\nmodel:\n  hidden: 32\n")
    assert config.parse(Config) == Config()
    assert config.parse(Config, path=path) == Config(epochs=5, learning_rate=0.01, model=Model(hidden=32))
    got = config.parse(Config, ["epochs=7", "model.dims=[1,2,3]", "devices=4", "learning_rate=2e-4"], path=path)
    assert got == Config(epochs=7, learning_rate=2e-4, devices=4, model=Model(hidden=32, dims=(1, 2, 3)))
    assert isinstance(got.model.dims, tuple) and isinstance(got.learning_rate, float)


def test_config_key_on_the_command_line_replaces_the_path(tmp_path):
    default = write(tmp_path, "epochs: 5\n", "default.yaml")
    other = write(tmp_path, "epochs: 9\nname: other\n", "other.yaml")
    assert config.parse(Config, [f"config={other}"], path=default) == Config(epochs=9, name="other")
    assert config.parse(Config, [f"config={other}", "epochs=1"], path=default).epochs == 1


def test_strings_that_are_numbers_are_converted(tmp_path):
    path = write(tmp_path, "epochs: '12'\nlearning_rate: 1\n")
    got = config.parse(Config, path=path)
    assert got.epochs == 12 and got.learning_rate == 1.0 and isinstance(got.learning_rate, float)


@pytest.mark.parametrize(
    ("text", "argv", "match"),
    [
        ("learning_rte: 0.1\n", [], r"Unknown config key `learning_rte` in .*c\.yaml\. Did you mean `learning_rate`\?"),
        (
            "model:\n  hiden: 3\n",
            [],
            r"key `model\.hiden` in .*c\.yaml\. Did you mean `model\.hidden`\?",
        ),
        (None, ["epoch=3"], r"Unknown config key `epoch` on the command line\. Did you mean `epochs`\?"),
        (
            None,
            ["model.zzz=3"],
            r"key `model\.zzz` on the command line\. Model has the keys hidden, dims",
        ),
    ],
    ids=["file", "file-nested", "command-line", "command-line-nested"],
)
def test_unknown_keys_are_errors_naming_key_and_source(tmp_path, text, argv, match):
    path = write(tmp_path, text) if text else None
    with pytest.raises(ConfigError, match=match):
        config.parse(Config, argv, path=path)


@pytest.mark.parametrize(
    ("text", "argv", "match"),
    [
        (
            "epochs: five\n",
            [],
            r"`epochs` in .*c\.yaml has a value of the wrong type: epochs='five' \(str\), expected int",
        ),
        ("model: 3\n", [], r"`model` in .*c\.yaml has a value of the wrong type: model=3 \(int\), expected Model"),
        (None, ["epochs=2.5"], r"`epochs` on the command line .*: epochs=2\.5 \(float\), expected int\."),
        (None, ["devices=all"], r"`devices` on the command line .*: devices='all' \(str\), expected int \| None"),
        (None, ["model.hidden=true"], r"`model\.hidden` on the command line .*=True \(bool\), expected int"),
        (
            None,
            ["model.dims=[1,x]"],
            r"`model\.dims` on the command line .*\[1, 'x'\] \(list\), expected tuple\[int, \.\.\.\]",
        ),
    ],
    ids=["file", "file-nested-dataclass", "float-for-int", "optional", "bool-for-int", "list-element"],
)
def test_wrong_types_are_errors_naming_key_value_type_and_source(tmp_path, text, argv, match):
    path = write(tmp_path, text) if text else None
    with pytest.raises(ConfigError, match=match):
        config.parse(Config, argv, path=path)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"Config file '.*nope\.yaml' does not exist \(resolved: /"):
        config.parse(Config, path=tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"Config file '.*nope\.yaml' does not exist"):
        config.parse(Config, [f"config={tmp_path / 'nope.yaml'}"])
    with pytest.raises(ConfigError, match=r"Config file '.*' is a directory"):
        config.parse(Config, path=tmp_path)
    with pytest.raises(ConfigError, match=r"(?s)Config file '.*c\.yaml' is not valid YAML: .*line 1"):
        config.parse(Config, path=write(tmp_path, "epochs: [1\n"))
    with pytest.raises(ConfigError, match=r"Config file '.*c\.yaml' must hold a mapping of keys to values, got a"):
        config.parse(Config, path=write(tmp_path, "- 1\n- 2\n"))


@pytest.mark.parametrize("arg", ["epochs", "--epochs", "=3", " epochs=3"])
def test_malformed_arguments(arg):
    with pytest.raises(ConfigError, match=r"Malformed argument .* on the command line: expected `key=value`"):
        config.parse(Config, [arg])


def test_schema_checks_and_missing_values():
    with pytest.raises(ConfigError, match=r"Config rejected the config \(defaults, command line epochs=-1\): "):
        config.parse(Config, ["epochs=-1"])
    with pytest.raises(ConfigError, match=r"Config key `data_dir` has no value \(expected str\); set it"):
        config.parse(Required)
    assert config.parse(Required, ["data_dir=/x"]).data_dir == "/x"
    with pytest.raises(TypeError, match=r"`schema` must be a dataclass type, got"):
        config.parse(Config(), [])


def test_yaml_round_trip_and_atomic_save(tmp_path):
    cfg = config.parse(Config, ["epochs=4", "devices=2", "model.dims=[3]"])
    text = config.to_yaml(cfg)
    assert "epochs: 4\n" in text and "model:\n  hidden: 64\n" in text
    config.save(cfg, tmp_path / "sub" / "config.yaml")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["config.yaml"]  # no temporary file left
    assert config.parse(Config, path=tmp_path / "sub" / "config.yaml") == cfg
    assert config.to_yaml({"a": 1}) == "a: 1\n"
    with pytest.raises(TypeError, match=r"`config` must be a dataclass instance, an OmegaConf config or a mapping"):
        config.to_yaml(3)


@pytest.mark.multiprocess  # a fresh interpreter
def test_a_config_error_happens_before_any_jax_import(tmp_path):
    """A training script's first line parses its config: a bad one fails without importing JAX."""
    bad = write(tmp_path, "epochs: many\n")
    code = textwrap.dedent(
        f"""
        import dataclasses, sys
        import jddp
        from jddp.config import ConfigError, parse

        @dataclasses.dataclass(frozen=True)
        class Config:
            epochs: int = 3

        for argv in (["epochs=x"], ["nope=1"], ["config={bad}"], ["config=/does/not/exist.yaml"], ["bad"]):
            try:
                parse(Config, argv)
            except ConfigError as error:
                print("ConfigError:", error)
        print("jax imported:", "jax" in sys.modules, "jaxlib" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env=multiprocess.environment(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ConfigError:") == 5, done.stdout
    assert "jax imported: False False" in done.stdout


@pytest.mark.parametrize(
    ("overrides", "text", "expected"),
    [
        # A mapping where a tuple belongs: OmegaConf's raw TypeError before.
        (
            ["model.dims.a=1"],
            None,
            r"`model.dims` on the command line .* model.dims=\{'a': 1\} \(dict\), expected tuple",
        ),
        ([], "model:\n  dims: {a: 1}\n", r"`model.dims` in .* model.dims=\{'a': 1\} \(dict\), expected tuple"),
        # A `???` (still to be given) before the bad value: the bad one is named, not the `???`.
        ([], "name: '???'\nmodel: 3\n", r"`model` in .* model=3 \(int\), expected Model"),
        ([], "model:\n  hidden: '???'\n  dims: {a: 1}\n", r"`model.dims` in .* expected tuple"),
        # The value as written, not OmegaConf's node type (AnyNode).
        (["model.dims=3"], None, r"model.dims=3 \(int\), expected tuple\[int, \.\.\.\]"),
        # A `null:` key: OmegaConf's KeyValidationError before.
        ([], "null: 1\n", r"cannot be read as a config: Incompatible key type 'NoneType'\. Keys must be names"),
    ],
    # Plain ids: mutmut passes test ids on a command line, where a newline or a regex in one breaks the run.
    ids=[
        "mapping-for-tuple-cli",
        "mapping-for-tuple-file",
        "missing-before-bad",
        "nested-missing-before-bad",
        "value-as-written",
        "null-key",
    ],
)
def test_wrong_shapes_of_values_are_config_errors_naming_the_key(tmp_path, overrides, text, expected):
    path = write(tmp_path, text) if text is not None else None
    with pytest.raises(config.ConfigError, match=expected):
        config.parse(Config, overrides, path=path)


@dataclasses.dataclass(frozen=True)
class _Inner:
    sizes: list[int] = dataclasses.field(default_factory=lambda: [1])


@dataclasses.dataclass(frozen=True)
class _Containers:
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    inner: _Inner = dataclasses.field(default_factory=_Inner)


@pytest.mark.parametrize(
    ("arg", "key", "shown"),
    [
        ("counts.a.b=1", "counts.a", "{'b': 1} (dict), expected int"),
        ("counts.a=[1,2]", "counts.a", "[1, 2] (list), expected int"),
        ("inner.sizes=[1,[2]]", "inner.sizes[1]", "[2] (list), expected int"),
    ],
)
def test_a_container_inside_a_typed_container_of_scalars_is_refused(arg, key, shown):
    with pytest.raises(config.ConfigError, match=re.escape(f"Config key `{key}` (defaults, command line {arg})")) as e:
        config.parse(_Containers, [arg])
    assert f"has a value of the wrong type: {key}={shown}." in str(e.value)
    assert config.parse(_Containers, ["counts.a=1", "inner.sizes=[1,2]"]) == _Containers({"a": 1}, _Inner([1, 2]))


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ("epochs=3", r"`argv` must be a list of `key=value` strings .*got argv='epochs=3' \(str\)\. Pass a list"),
        (3, r"`argv` must be a list of `key=value` strings .*got argv=3 \(int\)"),
        (["epochs=3", 4], r"`argv` must hold only `key=value` strings, got argv\[1\]=4 \(int\)"),
    ],
    ids=["one-string", "int", "int-inside"],
)
def test_argv_must_be_a_list_of_strings(argv, match):
    """One string would be read character by character ('e' is no `key=value`), an int is no list."""
    with pytest.raises(TypeError, match=match):
        config.parse(Config, argv)


@pytest.mark.parametrize(("text", "shown"), [("x\n", "'x'"), ("3\n", "'3'")], ids=["word", "number"])
def test_a_file_holding_one_value_is_named_as_such(tmp_path, text, shown):
    """OmegaConf reads a file holding `x` as the mapping {x: None} (an unknown key `x`), and one holding `3` raises
    its OSError: both are a file that holds a single value, named with the argument that gave it."""
    path = write(tmp_path, text)
    expected = rf"Config file '.*c\.yaml' \(given as `path`\) must hold a mapping .*got the single value {shown}\."
    with pytest.raises(ConfigError, match=expected):
        config.parse(Config, path=path)
    with pytest.raises(ConfigError, match=r"\(given as `config`\) must hold a mapping"):
        config.parse(Config, [f"config={path}"])


def test_path_is_checked_before_it_is_read():
    with pytest.raises(TypeError, match=r"`path` must be a non-empty path \(str or os.PathLike\) or None, got path=''"):
        config.parse(Config, path="")
    with pytest.raises(ValueError, match=r"`path` starts with a home directory that does not exist"):
        config.parse(Config, path="~no-such-user-jddp/c.yaml")


def test_save_checks_config_and_path_before_it_creates_anything(tmp_path):
    target = tmp_path / "new" / "config.yaml"
    with pytest.raises(TypeError, match=r"`config` must be a dataclass instance"):
        config.save(object(), target)
    with pytest.raises(TypeError, match=r"`path` must be a non-empty path"):
        config.save(Config(), b"config.yaml")
    assert not (tmp_path / "new").exists()  # the directory of a refused save is not created
    with pytest.raises(IsADirectoryError, match=r"`path` must be a file to write the config to, got the directory"):
        config.save(Config(), tmp_path)
    assert list(tmp_path.iterdir()) == []


class Mode(enum.Enum):
    FAST = "fast"


@pytest.mark.parametrize("default", [None, 0, 1.5, "x", True, Mode.FAST, (1, "a"), Model()], ids=repr)
def test_run_field_takes_a_value_a_config_holds(default):
    assert config.run_field(default).default == default


@pytest.mark.parametrize(
    "default", [object(), [1, 2], {"a": 1}, (i for i in range(2))], ids=["object", "list", "dict", "generator"]
)
def test_run_field_refuses_what_no_config_holds_naming_default(default):
    with pytest.raises(TypeError, match=r"`default` must be a value a config field holds .*got default="):
        config.run_field(default)
