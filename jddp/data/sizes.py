"""How many rows a step takes: the global batch size from either argument, and the micro-batches and padding that
``max_per_device_batch_size`` makes of it on any number of devices."""

from __future__ import annotations

from typing import Any

from jddp import validate


def global_batch(global_batch_size: Any, per_device_batch_size: Any, devices: int) -> int:
    """The global batch size from exactly one of the two arguments."""
    if (global_batch_size is None) == (per_device_batch_size is None):
        which = "both" if global_batch_size is not None else "neither"
        raise ValueError(
            f"DataLoader needs exactly one of `global_batch_size` (examples per step over all devices) and "
            f"`per_device_batch_size` (examples per device, PyTorch DDP's batch_size), got {which}: "
            f"global_batch_size={global_batch_size!r}, per_device_batch_size={per_device_batch_size!r}. Pass one, "
            f"e.g. per_device_batch_size=4 for global_batch_size={4 * devices} on these {devices} devices."
        )
    if per_device_batch_size is None:
        return global_batch_size
    validate.check_int(
        "per_device_batch_size",
        per_device_batch_size,
        fix=f"It is multiplied by the {devices} devices of the mesh into the global batch size.",
    )
    return int(per_device_batch_size) * devices


def split_batch(global_batch_size: int, devices: int, max_per_device: int | None) -> tuple[int, int]:
    """``(accumulate_steps, padded_batch_size)`` for ``global_batch_size`` examples on ``devices`` devices that
    take at most ``max_per_device`` rows per micro-batch (None: no limit, no padding).

    Example:
      >>> split_batch(256, 3, 32), split_batch(256, 4, 32), split_batch(256, 4, None)
      ((3, 261), (2, 256), (1, 256))
    """
    if max_per_device is None:
        return 1, int(global_batch_size)
    global_batch_size, max_per_device = int(global_batch_size), int(max_per_device)
    k = -(-global_batch_size // (devices * max_per_device))
    micro = -(-global_batch_size // (devices * k))
    return k, devices * k * micro
