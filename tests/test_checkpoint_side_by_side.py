"""Several Checkpointers in one run save side by side without colliding (issue 44), and a save whose barrier between
the processes fails says so, naming the barrier, instead of blaming the directory."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import orbax.checkpoint
import pytest

from jddp.checkpoint import orbax_io, storage
from tests import multiprocess

WORKER = str(multiprocess.WORKERS / "ckpt_side_by_side.py")
ORBAX = Path(orbax.checkpoint.__file__).parent


def orbax_barrier_names() -> list[str]:
    """Every barrier name Orbax's own code passes to ``multihost.unique_barrier_key`` (tests excluded)."""
    names = set()
    for path in ORBAX.rglob("*.py"):
        if path.name.endswith("_test.py") or "test_utils" in path.name:
            continue
        text = path.read_text()
        names.update(re.findall(r"unique_barrier_key\(\s*['\"]([^'\"]+)['\"]", text))
    return sorted(names)


# The coordination service's messages for a barrier that failed (jaxlib's coordination service; strings of
# libjax_common.so in jaxlib 0.10.2): {} is the barrier's id.
SERVICE_MESSAGES = {
    "ongoing": "FAILED_PRECONDITION: Barrier {} is already ongoing. "
    "[type.googleapis.com/tensorflow.CoordinationServiceError='']",
    "timeout": "DEADLINE_EXCEEDED: Barrier timed out. Id: {}. This usually happens because a task triggered the "
    "barrier too early or too slowly.",
}


def barrier_cases():
    for name in orbax_barrier_names():
        for prefix in (None, orbax_io.barrier_prefix("/runs/x/ckpt")):
            for suffix in (None, "12"):
                key = orbax.checkpoint.multihost.unique_barrier_key(name, prefix=prefix, suffix=suffix)
                for kind, template in SERVICE_MESSAGES.items():
                    yield pytest.param(key, template.format(key), id=f"{kind}-{key}")


def test_orbax_still_names_the_barrier_that_collided():
    """The collision's cause is Orbax's barrier naming: if Orbax renames it, the docstring that names it is stale."""
    assert "ThreadSaveMultiHostValueHolder:set_value_start" in orbax_barrier_names()
    assert "async_write_complete" in orbax_barrier_names()


@pytest.mark.parametrize(("key", "message"), list(barrier_cases()))
@pytest.mark.parametrize("chained", [False, True], ids=["raised", "as-cause"])
def test_a_failed_barrier_names_the_barrier_not_the_disk(key, message, chained):
    error: Exception = jax.errors.JaxRuntimeError(message)
    if chained:  # Orbax re-raises in its finalize thread: the service's error is the cause
        try:
            raise RuntimeError("the finalize thread failed") from error
        except RuntimeError as outer:
            error = outer
    text = storage.write_failure(Path("/runs/x/ckpt"), [3], [1, 2], error)
    assert f"key-value barrier `{key}`" in text
    assert "writable" not in text and "has space" not in text
    assert "step 2, is intact" in text


@pytest.mark.parametrize(
    "error",
    [OSError(28, "No space left on device"), PermissionError(13, "Permission denied"), ValueError("bad chunk")],
    ids=["disk-full", "permission", "other"],
)
def test_a_failed_write_that_is_no_barrier_names_no_barrier(error):
    assert storage.failed_barrier(error) is None
    assert "barrier" not in storage.write_failure(Path("/d"), [3], [], error)


def test_each_checkpointer_gets_its_own_barrier_prefix_the_same_on_every_process():
    """Two of one directory (a writer and a reader) and two of two directories all differ; the n-th of a directory
    is a function of the directory and n alone (every process opens them in the same order)."""
    first = [orbax_io.barrier_prefix(d) for d in ("/a/epoch", "/a/best", "/a/epoch")]
    assert len(set(first)) == 3
    assert all(re.fullmatch(r"jddp-[0-9a-f]{12}-\d+", p) for p in first)
    n = int(first[2].rsplit("-", 1)[1])
    assert first[2].rsplit("-", 1)[0] == first[0].rsplit("-", 1)[0] and n == int(first[0].rsplit("-", 1)[1]) + 1


def test_two_open_checkpointers_wait_at_barriers_of_different_names(tmp_path):
    """In this process (where a semantic mutant applies; the 2-process test's workers are processes of their own):
    the barrier that collided, as each open manager's background write names it, differs between two
    Checkpointers, and between two of one directory (a writer and a reader)."""
    import jddp

    opened = [
        jddp.Checkpointer(tmp_path / "epoch"),
        jddp.Checkpointer(tmp_path / "best"),
        jddp.Checkpointer(tmp_path / "epoch", read_only=True),
    ]
    try:
        keys = set()
        for ckpt in opened:
            tracker = ckpt._manager._save_progress_tracker  # Orbax's MultihostSynchronizedValue: its set() collided
            prefix = tracker._multiprocessing_options.barrier_sync_key_prefix
            keys.add(
                orbax.checkpoint.multihost.unique_barrier_key(
                    "ThreadSaveMultiHostValueHolder:set_value_start", prefix=prefix
                )
            )
        assert len(keys) == len(opened), keys
    finally:
        for ckpt in opened:
            ckpt.close()


@pytest.mark.multiprocess  # two worker processes
@pytest.mark.slow  # 20 steps, two saves each: about 20 s on a loaded 2-core machine
def test_two_checkpointers_save_every_step_for_20_steps_in_two_processes(tmp_path):
    """An epoch checkpoint (maybe_save, every step) and a best model (save, every step) in two directories, back to
    back in a 2-process run: each save's background write overlaps the other's. Before each Checkpointer had its
    own barrier prefix, the third step failed with "Barrier ThreadSaveMultiHostValueHolder:set_value_start is
    already ongoing" (with one prefix for both planted: red in each of 3 runs of 20 steps, 29 Nov 2026; 200 steps
    added nothing but time)."""
    codes, outputs = multiprocess.collect(multiprocess.spawn(WORKER, 2, 1, str(tmp_path), "20"), timeout=600)
    assert codes == [0, 0], multiprocess.show(codes, outputs)
    assert "SAVED [19, 20] [20]" in outputs[0], multiprocess.show(codes, outputs)
    assert sorted(p.name for p in (tmp_path / "epoch").iterdir() if p.name.isdigit()) == ["19", "20"]
    assert sorted(p.name for p in (tmp_path / "best").iterdir() if p.name.isdigit()) == ["20"]
