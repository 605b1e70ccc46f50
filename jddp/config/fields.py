"""Config fields that say where or how a run happens (``run_field``): the field metadata that leaves them out of the
config fingerprint."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

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
