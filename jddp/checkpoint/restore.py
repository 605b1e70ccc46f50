"""Reading one checkpoint step back: its metadata, whether it fits the state, the arrays and their digests."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import shutil
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

from jddp.checkpoint import digest, identity
from jddp.checkpoint.errors import CheckpointWarning
from jddp.runtime.state import TrainState

STATE, LOADER, META, EXTRA = "state", "loader", "meta", "extra"
META_FORMAT = 1  # the meta item's "format" (absent: written before it had one, read as 1)
DAMAGED_SUFFIX = ".damaged"
ORBAX_STRUCTURE_MISMATCH = "tree structures do not match"  # Orbax's words when the saved tree is another one
MSG_POSITION_NOT_RESTORED = (
    "Checkpoint step {step} in {directory} holds a data loader position, but `restore_or_init` was called without "
    "the loader: the model, optimizer state and RNG are restored, the data position is not, so a loader used now "
    "starts from its beginning and trains again on the batches before step {step}. Pass the loader to restore it: "
    "`state, loader = checkpointer.restore_or_init(state, loader)`."
)


def as_dict(state: TrainState) -> dict[str, Any]:
    """The state's arrays by field (``opt_layout``, which describes them, is not an array)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "opt_layout"}


def read_meta(directory, step: int) -> tuple[dict | None, str | None]:
    """The step's ``meta`` item and None, or None and why it cannot be used (damage: the step is set aside).

    Raises:
      ValueError: for a ``meta`` of a newer format (written by a newer jddp: not damage), naming the file.
    """
    path = directory / str(step) / META / "metadata"
    name = f"{step}/{META}/metadata"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"its metadata file {name} is missing"
    except (OSError, ValueError) as error:  # cut short, garbage, a directory in its place, not UTF-8
        return None, f"its metadata cannot be read ({name}: {type(error).__name__}: {error})"
    why = _meta_problem(meta, step)
    if why is not None:
        return None, f"its metadata file {name} {why}"
    if meta.get("format", META_FORMAT) != META_FORMAT:
        raise ValueError(
            f"Checkpoint step {step} in {directory} was written in format {meta['format']} of its metadata file "
            f"{name}, and this jddp reads format {META_FORMAT}: it was saved by a newer jddp. Restore it with that "
            "version, or use another directory."
        )
    return meta, None


def _meta_problem(meta, step: int) -> str | None:
    """What makes a ``meta`` item unusable (the fields a restore reads, by type), or None."""
    if not isinstance(meta, dict):
        return f"holds a JSON {type(meta).__name__}, not an object"
    leaves = meta.get("leaves")
    checks = {
        "step": meta.get("step") == step and type(meta.get("step")) is int,
        "format": type(meta.get("format", META_FORMAT)) is int,
        "run": meta.get("run") is None or isinstance(meta.get("run"), str),
        "config_fingerprint": meta.get("config_fingerprint") is None or isinstance(meta["config_fingerprint"], str),
        "config": meta.get("config") is None or isinstance(meta.get("config"), dict),
        "leaves": isinstance(leaves, list)
        and all(
            isinstance(leaf, list)
            and len(leaf) >= 3
            and isinstance(leaf[0], str)
            and isinstance(leaf[1], list)
            and all(type(n) is int and n >= 0 for n in leaf[1])
            and isinstance(leaf[2], str)
            for leaf in leaves
        ),
        "digests": isinstance(meta.get("digests"), list)
        and isinstance(leaves, list)
        and len(meta["digests"]) == len(leaves)
        and all(isinstance(d, str) for d in meta["digests"]),
        "empty_nodes": isinstance(meta.get("empty_nodes", []), list)
        and all(isinstance(p, str) for p in meta.get("empty_nodes", [])),
        "padded": isinstance(meta.get("padded", False), bool),
    }
    bad = next((field for field, ok in checks.items() if not ok), None)
    if bad is None:
        return None
    return f"has {bad}={str(meta.get(bad, '(missing)'))[:80]}, not what jddp writes there (damaged)"


def check_compatible(ckpt, step: int, meta: dict, state: TrainState) -> None:
    """Raises if the checkpoint holds another model or (unless allowed) another config: an error, not damage."""
    tree = as_dict(state)
    why = structure_difference(meta.get("leaves", []), digest.describe_leaves(tree, digest.leaf_layouts(state)))
    if why is None and "empty_nodes" in meta:  # saved by jddp 0.x before the field: Orbax's own check remains
        why = _empty_difference(meta["empty_nodes"], digest.empty_nodes(tree))
    if why is not None:
        raise ValueError(f"Checkpoint step {step} in {ckpt.directory} holds {why}")
    saved_run, run = meta.get("run"), ckpt.run_id
    if saved_run and run and saved_run != run:  # a step without one: saved by an older jddp, in this directory
        message = (
            f"Checkpoint step {step} in {ckpt.directory} (its {step}/{META}/metadata) was written by "
            f"{identity.describe(saved_run, meta.get('config_fingerprint'))}, and the directory belongs to "
            f"{identity.describe(run, ckpt.fingerprint)} (its {identity.FILENAME}): another run's state, copied "
            "in or left behind. Pass allow_other_run=True to start from it anyway, or use another directory."
        )
        if not ckpt.allow_other_run:
            raise ValueError(message)
        warnings.warn(message, CheckpointWarning, stacklevel=7)
    if ckpt.fingerprint and meta.get("config_fingerprint") and meta["config_fingerprint"] != ckpt.fingerprint:
        saved = meta.get("config", {})
        keys = sorted(k for k in set(saved) | set(ckpt.config) if saved.get(k) != ckpt.config.get(k))
        changes = ", ".join(f"{k}: {saved.get(k)!r} -> {ckpt.config.get(k)!r}" for k in keys) or "(details unknown)"
        message = (
            f"Checkpoint step {step} in {ckpt.directory} was saved with another config ({changes}). "
            "Pass allow_config_change=True to resume with the new config anyway, or use another directory."
        )
        if not ckpt.allow_config_change:
            raise ValueError(message)
        warnings.warn(message, CheckpointWarning, stacklevel=7)  # restore_or_init._restore_from_disk: its caller


def structure_difference(theirs: list[list], mine: list[list]) -> str | None:
    """What differs first between the saved leaves and this state's (``[path, shape, dtype]`` each, compared by
    path, a parameter named first), with the fix; None when they agree."""
    saved, here = {a[0]: a for a in theirs}, {b[0]: b for b in mine}
    differ = [path for path in here if path in saved and saved[path] != here[path]]
    only_saved = [path for path in saved if path not in here]
    only_here = [path for path in here if path not in saved]
    first = lambda paths: sorted(paths, key=lambda path: not path.startswith("['params']"))[0]
    if differ:
        path = first(differ)
        (_, a_shape, a_dtype), (_, b_shape, b_dtype) = saved[path][:3], here[path][:3]
        what = f"its leaf {path} has shape {tuple(a_shape)} and dtype {a_dtype}, here shape {tuple(b_shape)} and "
        what += f"dtype {b_dtype}"
    elif only_saved or only_here:
        what = f"it holds {len(saved)} leaves and the state here {len(mine)}: " + (
            f"{first(only_saved)} is saved but not here" if only_saved else f"{first(only_here)} is not saved"
        )
        path = first(only_saved or only_here)
    else:
        return None
    return _with_fix(path, what)


def _empty_difference(theirs: list[str], mine: list[str]) -> str | None:
    if theirs == mine:
        return None
    path = next((p for p in [*theirs, *mine] if (p in theirs) != (p in mine)), (theirs or mine)[0])
    side = "saved" if path in theirs else "here"
    what = (
        f"the same arrays, but its tree differs where no array is: the empty node {path} (an optax EmptyState, an "
        f"empty dict) is only {side} ({len(theirs)} such nodes saved, {len(mine)} here)"
    )
    return _with_fix(path, what)


def _with_fix(path: str, what: str) -> str:
    """``what`` differs at ``path``: what the checkpoint holds, and the fix."""
    if path.startswith("['opt_state']"):
        return (
            f"another optimizer state: {what}. The optimizer differs from the one saved (another optax "
            "transformation or chain, e.g. adam -> adamw or clipping added). Restore with the optimizer it was "
            "saved with; to go on with another one, start a new state from the restored parameters "
            "(DataParallel.init(jddp.models.to_host(restored.params))) and save it in another directory."
        )
    return f"another model: {what}. Restore into the model that was saved, or use another directory."


def loader_state_problem(saved: Any, current: Any) -> str | None:
    """What makes a saved loader position unusable by a loader whose own position is ``current`` (its
    ``get_state()``): another JSON shape (not an object, other keys, a field of another type: NaN where a count
    was, a string where a number was); None when it has the shape of ``current``. Its values are the loader's to
    judge (``set_state``: another data setup)."""
    if not isinstance(current, dict):
        return None if type(saved) is type(current) else f"a JSON {type(saved).__name__}, expected an object"
    if not isinstance(saved, dict):
        return f"a JSON {type(saved).__name__}, expected an object"
    if set(saved) != set(current):
        return f"the fields {sorted(saved)}, expected {sorted(current)}"
    for key, now in current.items():
        value = saved[key]
        kinds = (int, float) if type(now) is float else (type(now),)
        if type(value) not in kinds or (isinstance(value, float) and not math.isfinite(value)):
            return f"{key}={str(value)[:40]!r}, expected a {type(now).__name__}"
    return None


def _read_loader(directory, step: int, loader) -> str | None:
    """Why the step's loader position cannot be used by ``loader``, naming its file; None when it can."""
    name = f"{step}/{LOADER}/metadata"
    try:
        saved = json.loads((directory / name).read_text())
    except (OSError, ValueError) as error:  # missing, cut short, garbage, a directory in its place
        return f"its loader position file {name} cannot be read ({type(error).__name__}: {error})"
    why = loader_state_problem(saved, loader.get_state())
    return None if why is None else f"its loader position file {name} holds {why}"


def try_restore(
    manager, directory, step: int, meta: dict, state: TrainState, loader, extra=None, read_only: bool = False
) -> tuple[Any, str | None]:
    """``((state, loader position or None, extra state or None, step), None)``, or ``(None, why the step is
    damaged)``. A reader (``read_only``) is not warned of a data position it does not take: it evaluates, it does
    not train on."""
    target = as_dict(state)
    layouts = digest.leaf_layouts(state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
    # A sharded optimizer state pads leaves to a multiple of its device count (`jddp.runtime.layout`): Orbax then
    # truncates or zero-pads the stored padding to this state's (the logical shapes were compared before).
    padded = bool(meta.get("padded")) or any(lay is not None and lay.padded for lay in layouts)
    items: dict[str, ocp.args.CheckpointArgs] = {STATE: ocp.args.StandardRestore(abstract, strict=not padded)}
    has_loader = (directory / str(step) / LOADER).exists()
    if loader is not None and has_loader:
        why = _read_loader(directory, step, loader)
        if why is not None:
            return None, why
        items[LOADER] = ocp.args.JsonRestore()
    if extra is not None and (directory / str(step) / EXTRA).exists():
        items[EXTRA] = ocp.args.JsonRestore()
    # A restore that fails inside Orbax leaves coroutines never awaited; their RuntimeWarnings (at once or
    # when collected) are noise of Orbax's failure path, so they are collected here, under this filter.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        failure = None
        try:
            result = manager.restore(step, args=ocp.args.Composite(**items))
            leaves = jax.tree.leaves(result[STATE])
            tree = jax.tree.unflatten(jax.tree.structure(target), leaves)
        except Exception as error:  # Orbax raises many types for damaged files
            text = str(error).splitlines()[0] if str(error) else ""
            failure = f"restore failed: {type(error).__name__}: {text[:300]}"
        if failure is not None:
            gc.collect()  # the error and its frames are gone: Orbax's leftovers go now, under the filter
            return None, failure
    digests = digest.state_digests(tree, layouts)
    bad = [d[0] for d, got, want in zip(meta["leaves"], digests, meta["digests"], strict=True) if got != want]
    if bad:
        return None, f"digest mismatch in {len(bad)} leaf(s), first {bad[0]}"
    new_state = TrainState(**tree, opt_layout=state.opt_layout)
    found = {k: result[k] if k in items else None for k in (LOADER, EXTRA)}
    if loader is None and has_loader and not read_only:
        warnings.warn(MSG_POSITION_NOT_RESTORED.format(step=step, directory=directory), CheckpointWarning, stacklevel=7)
    return (new_state, found[LOADER], found[EXTRA], step), None


def remove_step(directory, step: int) -> None:
    """Deletes the step's directory (local, or remote through ``etils.epath``); gone already is fine."""
    path = directory / str(step)
    if not path.exists():
        return
    if hasattr(path, "rmtree"):  # etils.epath.Path (gs://, s3://)
        path.rmtree()
    else:
        shutil.rmtree(path)


def set_aside(directory, step: int) -> None:
    """Renames a damaged step to ``<step>.damaged`` (``.damaged2``, ... if taken); process 0 moves, all wait."""
    if jax.process_index() == 0:
        source = directory / str(step)
        target = directory / f"{step}{DAMAGED_SUFFIX}"
        n = 1
        while target.exists():
            n += 1
            target = directory / f"{step}{DAMAGED_SUFFIX}{n}"
        if source.exists():
            shutil.move(source, target)
    if jax.process_count() > 1:
        from jddp.runtime import distributed

        distributed.barrier(f"checkpoint-set-aside-{step}", timeout_s=120)
