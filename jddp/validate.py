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


def goes_to_device(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` can go to a device: bools and numbers, with the ml_dtypes numbers JAX knows
    (bfloat16, the float8 types, int4), which NumPy files under raw records (kind ``V``) with the things that
    cannot.

    >>> import ml_dtypes
    >>> goes_to_device(ml_dtypes.bfloat16), goes_to_device("V8"), goes_to_device(np.float32), goes_to_device("U3")
    (True, False, True, False)
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in NOT_NUMERIC_KINDS:
        return True
    return dtype.kind == "V" and dtype.type.__module__ == "ml_dtypes" and bits(dtype) is not None


def bits(dtype: Any) -> int | None:
    """The bits of one value of ``dtype`` as JAX counts them (4 for int4, whose NumPy items take a byte each), or
    None for a type JAX does not know."""
    import jax

    try:
        return int(jax.dtypes.itemsize_bits(np.dtype(dtype)))
    except (ValueError, TypeError):
        return None


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is True or False (or None if ``optional``): the strings "False" and
    "no", 0 and 1 are refused, not read as truth values.

    Example:
      >>> check_bool("shuffle", "False")
      Traceback (most recent call last):
      ...
      TypeError: `shuffle` must be True or False, got shuffle='False' (str). Pass the bool itself: shuffle=False.
    """
    if (optional and value is None) or isinstance(value, bool | np.bool_):
        return
    word = str(value).strip().lower()
    falsy, truthy = ("false", "no", "off", "0", "0.0"), ("true", "yes", "on", "1", "1.0")
    guess = "False" if word in falsy else "True" if word in truthy else ""
    what = "True or False" + (" or None" if optional else "")
    fix = f" Pass the bool itself: {name}={guess}." if guess else ""
    raise TypeError(f"`{name}` must be {what}, got {name}={value!r} ({type(value).__name__}).{fix}")


def check_number(
    name: str, value: Any, *, minimum: float = 0.0, strict: bool = True, optional: bool = False, unit: str = ""
) -> None:
    """Raises ``ValueError`` unless ``value`` is a finite real number (an int or a float, not a bool or a string)
    above ``minimum`` (or at least it, unless ``strict``), or None if ``optional``.

    Example:
      >>> check_number("timeout_s", float("inf"), unit="seconds")
      Traceback (most recent call last):
      ...
      ValueError: `timeout_s` must be a finite number > 0.0 (seconds), got timeout_s=inf.
    """
    if optional and value is None:
        return
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)
    if not ok or not np.isfinite(value) or (value <= minimum if strict else value < minimum):
        what = f"a finite number {'>' if strict else '>='} {minimum}" + (f" ({unit})" if unit else "")
        what += " or None" if optional else ""
        raise ValueError(f"`{name}` must be {what}, got {name}={value!r}.")


def check_str(name: str, value: Any, *, empty: bool = False, optional: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is a str (non-empty unless ``empty``), or None if ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, str) or (not empty and not value.strip()):
        what = "a non-empty str" if not empty else "a str"
        raise TypeError(f"`{name}` must be {what}{' or None' if optional else ''}, got {name}={value!r}.")


def check_path(name: str, value: Any, *, optional: bool = False) -> str | None:
    """The path ``value`` names, ``~`` expanded; ``TypeError`` unless it is a non-empty str or os.PathLike (an
    empty path would write to the working directory), ``ValueError`` for a ``~user`` that does not exist."""
    import os

    if optional and value is None:
        return None
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike) or not os.fspath(value).strip():
        what = "a non-empty path (str or os.PathLike)" + (" or None" if optional else "")
        raise TypeError(f"`{name}` must be {what}, got {name}={value!r}.")
    text = os.fspath(value)
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        raise ValueError(
            f"`{name}` starts with a home directory that does not exist, got {name}={text!r}. Use an absolute path "
            "or ~/ for your own home."
        )
    return expanded
