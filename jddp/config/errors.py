"""``ConfigError`` and what its messages share: the name of the command line as a source, an error's first line, a
value's type as a user names it."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message names the key, the source and what was expected."""


COMMAND_LINE = "command line"


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0].rstrip(".") if str(error) else type(error).__name__


def type_name(value: Any) -> str:
    """The Python type a user would name: OmegaConf's containers as ``dict`` and ``list``."""
    if isinstance(value, DictConfig):
        return "dict"
    if OmegaConf.is_list(value):
        return "list"
    return type(value).__name__
