"""The group this process joined (``ProcessGroup``), and the check that a process started as one of a group joined.

``jddp.runtime.distributed.initialize`` records the group here; jddp's entry points (``data_mesh``,
``DataParallel``, ``DataLoader``, ``Checkpointer``) call ``check_joined`` before they use JAX.
"""

from __future__ import annotations

import dataclasses

from jddp import envvars
from jddp.runtime import jax_internals, join_settings


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The group this process joined; ``initialize`` returns it."""

    coordinator: str | None
    num_processes: int
    process_id: int
    peer_timeout_s: float


_group: ProcessGroup | None = None


def group() -> ProcessGroup | None:
    """The group joined by ``initialize``, or ``None``."""
    return _group


def record(joined: ProcessGroup) -> None:
    """Records the group ``initialize`` joined (``group()`` returns it from now on)."""
    global _group
    _group = joined


def check_joined() -> None:
    """Raises if this process was started as one of a group but never joined it.

    ``jddp launch`` sets ``JDDP_NUM_PROCESSES``; a script that never calls ``jddp.initialize()`` would otherwise
    run as N separate single-process jobs, each training on all the data and writing the same files. Called by
    jddp's entry points (``data_mesh``, ``DataParallel``, ``DataLoader``, ``Checkpointer``) before they use JAX.
    """
    if _group is not None:
        return
    raw = envvars.get(join_settings.ENV_NUM_PROCESSES)
    if raw is None or raw <= 1 or _joined_elsewhere():
        return
    me = envvars.get(join_settings.ENV_PROCESS_ID)
    me = "?" if me is None else me
    raise RuntimeError(
        f"This process was started as process {me} of a group of {raw} (JDDP_NUM_PROCESSES={raw}, set by "
        "`jddp launch`), but it has not joined the group: jddp.initialize() was not called, so each process "
        "would train alone on all the data. Call jddp.initialize() at the start of the script, before anything "
        "else uses JAX."
    )


def _joined_elsewhere() -> bool:
    """True if the process joined a group without jddp (``jax.distributed.initialize`` called directly)."""
    return jax_internals.distributed_client() is not None
