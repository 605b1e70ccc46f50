"""Config files: the YAML file read as a mapping (``load``), and a config written as YAML (``to_yaml``, ``save``)."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from jddp import validate
from jddp.config import errors
from jddp.config import schema as schema_lib


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


def _as_omegaconf(config: Any) -> DictConfig:
    if isinstance(config, DictConfig):
        return config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        schema_lib.omegaconf_class(type(config))  # a field `n: int = None` holds None as `n: int | None` does
        return OmegaConf.structured(schema_lib.convert(config, schema_lib.COPIES))
    if isinstance(config, Mapping):
        return OmegaConf.create(dict(config))
    raise TypeError(f"`config` must be a dataclass instance, an OmegaConf config or a mapping, got {type(config)!r}.")


def load(path: str | os.PathLike, name: str) -> DictConfig:
    """The mapping in the YAML file ``path``, given as ``name`` (the argument ``path``, or ``config=`` on the command
    line)."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise errors.ConfigError(
            f"Config file {str(path)!r} {what} (resolved: {file.absolute()}); give `{name}` an existing YAML file."
        )
    try:
        # OmegaConf reads a file holding one word (`x`) as the mapping {x: None}, and fails with an OSError on one
        # number: a file that holds a single value is said to be one here.
        raw = yaml.load(file.read_text(), Loader=yaml.BaseLoader)  # strings, lists and dicts only: no tags run
        if raw is not None and not isinstance(raw, dict | list):
            raise errors.ConfigError(
                f"Config file {str(path)!r} (given as `{name}`) must hold a mapping of keys to values (`key: value` "
                f"lines), got the single value {raw!r:.80}."
            )
        loaded = OmegaConf.load(file)
    except yaml.YAMLError as error:
        raise errors.ConfigError(f"Config file {str(path)!r} is not valid YAML: {error}") from None
    except oc_errors.OmegaConfBaseException as error:  # valid YAML that is no config, e.g. a `null:` key
        if error.full_key:  # a value OmegaConf cannot read, e.g. a broken interpolation `${`
            raise errors.ConfigError(
                f"Config key `{error.full_key}` in {str(path)!r} has a value that cannot be read: "
                f"{errors.first_line(error)}. Quote a string that holds `${{`, or fix the interpolation."
            ) from None
        raise errors.ConfigError(
            f"Config file {str(path)!r} cannot be read as a config: {str(error).splitlines()[0]}. Keys must be "
            "names (strings), as the fields of the config are."
        ) from None
    if not isinstance(loaded, DictConfig):
        raise errors.ConfigError(
            f"Config file {str(path)!r} must hold a mapping of keys to values, got a {type(loaded).__name__}."
        )
    return loaded
