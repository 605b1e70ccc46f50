"""Griffe extension for the API reference (mkdocs.yml loads it; mkdocs does not copy it into the site).

jddp's docstrings title their doctests ``Example:``; Griffe's Google parser
knows only ``Examples:`` as the section whose ``>>>`` lines become code, and
would render ``Example:`` as an admonition of Markdown text instead.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Reads an ``Example:`` section of a docstring as ``Examples:``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
