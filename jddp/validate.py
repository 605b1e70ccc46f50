"""Argument checks shared by every layer, with one wording. Imports no JAX."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False, fix: str = "") -> None:
    """Raises ``ValueError`` unless ``value`` is an int (not a bool) of at least ``minimum`` (or None if ``optional``).

    Example:
      >>> check_int("steps", 3)
      >>> check_int("steps", True)
      Traceback (most recent call last):
      ...
      ValueError: `steps` must be an int >= 1, got steps=True.
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        what = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"`{name}` must be {what}, got {name}={value!r}." + (f" {fix}" if fix else ""))


# NumPy dtype kinds that cannot go to a device: objects, strings, bytes, raw records, datetimes, timedeltas.
NOT_NUMERIC_KINDS = "OUSVMm"
