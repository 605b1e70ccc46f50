"""The ``Checkpointer``'s arguments checked: its options at construction, and the state, loader and ``extra`` of
each call; each error says what is required, what arrived and the fix."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jddp import validate
from jddp.checkpoint import snapshot
from jddp.runtime.state import TrainState

ON_EXISTING = ("refuse", "overwrite", "keep")  # Checkpointer(on_existing=...): the first is the default


def check_options(
    directory,
    *,
    save_every,
    max_to_keep,
    allow_config_change,
    allow_other_run,
    async_save,
    exit_on_preemption,
    timeout_s,
    preemption_check_s,
    read_only,
    lease_timeout_s,
    snapshots,
    snapshot_budget,
    snapshot_every,
    on_existing,
) -> tuple[str | os.PathLike, Path | None]:
    """Checks ``Checkpointer(...)``'s options, in the order of its signature's groups; returns the directory
    (``~`` expanded) and the snapshots' root (``snapshot.root()``).

    Raises:
      ValueError, TypeError: for bad options (``validate``'s messages).
    """
    validate.check_int("save_every", save_every, optional=True)
    validate.check_int("max_to_keep", max_to_keep, optional=True)
    for name, value, low in (
        ("preemption_check_s", preemption_check_s, 0),
        ("lease_timeout_s", lease_timeout_s, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (low <= value < float("inf")):
            raise ValueError(f"`{name}` must be a finite number >= {low}, got {name}={value!r}.")
    snapshot_root = _check_snapshot_options(snapshots, snapshot_budget, snapshot_every, read_only=read_only)
    for name, value in (
        ("read_only", read_only),
        ("allow_config_change", allow_config_change),
        ("allow_other_run", allow_other_run),
        ("async_save", async_save),
        ("exit_on_preemption", exit_on_preemption),
    ):
        validate.check_bool(name, value)
    validate.check_int("timeout_s", timeout_s, fix="A number of seconds for an async save to finish.")
    validate.check_str("on_existing", on_existing)
    if on_existing not in ON_EXISTING:
        raise ValueError(
            f"`on_existing` says what `save` does with a step the directory already holds: one of "
            f"{', '.join(map(repr, ON_EXISTING))}, got on_existing={on_existing!r}."
        )
    if isinstance(directory, str | os.PathLike) and os.fspath(directory).strip():
        directory = str(validate.check_path("directory", directory))  # "~/x" expanded, "~nobody/x" refused
    if read_only and save_every is not None:
        raise ValueError(
            f"A read-only Checkpointer never saves, got save_every={save_every}. Drop save_every, or open it "
            "for writing."
        )
    return directory, snapshot_root


def _check_snapshot_options(snapshots, snapshot_budget, snapshot_every, *, read_only) -> Path | None:
    """The snapshot options checked; ``snapshot.root()``."""
    validate.check_bool("snapshots", snapshots, optional=True)
    validate.check_int("snapshot_every", snapshot_every, optional=True)
    validate.check_number("snapshot_budget", snapshot_budget, unit="a share of the step time, e.g. 0.01")
    if snapshot_budget > 1:
        raise ValueError(
            f"`snapshot_budget` is a share of the step time, at most 1, got snapshot_budget={snapshot_budget!r}; "
            "e.g. 0.01 lets snapshots take 1% of it."
        )
    snapshot_root = snapshot.root()  # a bad $JDDP_SNAPSHOT_DIR is refused here, naming it
    if snapshots and snapshot_root is None:
        raise ValueError(
            "snapshots=True needs $JDDP_SNAPSHOT_DIR, a directory in memory that outlives the processes (jddp "
            "launch sets one; under another launcher set it to a directory in /dev/shm that the job removes at "
            "its end), or pass snapshots=None to keep them only where it is set."
        )
    if read_only and snapshots:
        raise ValueError("A read-only Checkpointer never saves, so it takes no snapshots: drop snapshots=True.")
    return snapshot_root


def check_state(state, source: str) -> None:
    """``state`` a TrainState whose leaves are live jax.Arrays (not a NumPy copy, not donated)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"`state` must be a jddp.TrainState{source}, got {type(state).__name__}.")
    # The step counter stands for the state (donated with it, on the devices with it): checking it alone does not
    # flatten the parameters at every maybe_save.
    if not isinstance(state.step, jax.Array):
        raise TypeError(
            f"`state` must hold jax.Arrays on the devices, got state.step of type {type(state.step).__name__} (a "
            f"host copy?). Pass the TrainState{source or ' from DataParallel.step'} itself."
        )
    if state.step.is_deleted():
        raise ValueError("`state` was donated to a later step: its arrays are deleted. Pass the state step returned.")


def check_loader(loader, method: str) -> None:
    """``loader`` None or something with ``method`` (``get_state`` to save, ``set_state`` to restore)."""
    if loader is not None and not callable(getattr(loader, method, None)):
        raise TypeError(
            f"`loader` must be a jddp.data.DataLoader (something with {method}), got {type(loader).__name__}."
        )


def check_stateful(name: str, value, method: str) -> None:
    """``value`` None or something with ``method`` (``get_state``, ``set_state``)."""
    if value is not None and not callable(getattr(value, method, None)):
        raise TypeError(
            f"`{name}` must have get_state() and set_state(state) (JSON-able state), got {type(value).__name__}."
        )
