"""Identity on everything a Checkpointer restores (issue 42): every checkpoint and in-memory snapshot carries the
run that wrote it (``jddp.run``'s id, the config fingerprint) and its leaves; another run's state is refused, or, when
asked for, restored with a warning naming both runs; a restart of the same run restores as before; a reader of a
directory that holds nothing says so."""

from __future__ import annotations

import shutil
import warnings

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.checkpoint import identity

SOURCE = {"x": np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)}


def loss_fn(params, model_state, batch, key):
    return ((batch["x"] @ params["w"]) ** 2).mean(), (model_state, {})


def make(scale: float):
    """A state whose weights are ``scale``: two runs (two learning rates, the same shapes) told apart by them."""
    mesh = jddp.data_mesh(jax.devices()[:2])
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.01), mesh=mesh)
    return (
        dp,
        dp.init({"w": np.full((4, 1), scale, np.float32)}),
        jddp.data.DataLoader(SOURCE, global_batch_size=8, mesh=mesh),
    )


def weight(state) -> float:
    return float(np.asarray(state.params["w"])[0, 0])


def run_and_fail(directory, scale: float, steps: int = 3) -> tuple[str, float]:
    """A run that saves every step and snapshots every step, then stops with an error (its snapshots stay); its
    run id and last weight."""
    dp, state, loader = make(scale)
    with pytest.raises(RuntimeError, match="the run failed"):
        with jddp.Checkpointer(directory, save_every=1, snapshot_every=1) as ckpt:
            run = ckpt.run_id
            state = ckpt.restore_or_init(state)
            for _, batch in zip(range(steps), loader, strict=False):
                state, _ = dp.step(state, batch)
                ckpt.maybe_save(state)
            assert ckpt._snapshots is not None
            ckpt._snapshots.wait()
            raise RuntimeError("the run failed")
    assert run is not None
    return run, weight(state)


@pytest.fixture
def memory(tmp_path, monkeypatch):
    path = tmp_path / "memory"
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(path))
    return path


def test_a_new_run_at_a_stopped_runs_path_does_not_restore_its_snapshots(tmp_path, memory):
    """The issue's case: run A fails (snapshots kept), the user deletes the checkpoint folder and starts run B
    (another learning rate, same shapes) at the same path. B starts from its own state, told why, naming both runs;
    A's snapshots are removed (never restorable here, and they would outlive B's in the rotation)."""
    directory = tmp_path / "ckpt"
    old_run, _ = run_and_fail(directory, 1.0)
    assert list(memory.rglob("*.snap"))
    shutil.rmtree(directory)
    _, fresh, _ = make(2.0)
    with jddp.Checkpointer(directory) as ckpt:
        assert ckpt.run_id not in (None, old_run)
        with pytest.warns(jddp.CheckpointWarning) as said:
            got = ckpt.restore_or_init(fresh)
        text = " ".join(str(w.message) for w in said)
        assert f"run {old_run}" in text and f"run {ckpt.run_id}" in text, text
        assert (ckpt.restored_from, weight(got), int(got.step)) == (None, 2.0, 0)
    assert not list(memory.rglob("*.snap"))


@pytest.mark.parametrize("deleted", ["nothing", "the checkpoints", "jddp.run"])
def test_a_restart_of_the_same_run_restores_from_memory(tmp_path, memory, deleted):
    """A restart (the directory kept, a new process: jddp launch --max-restarts, an elastic round, a woken standby)
    has the run's id and restores its newest snapshot; a directory whose run file alone is lost takes the id back
    from its newest checkpoint."""
    directory = tmp_path / "ckpt"
    run, last = run_and_fail(directory, 1.0)
    if deleted == "the checkpoints":  # snapshots only: the run file is written when the Checkpointer opens
        for step in directory.iterdir():
            if step.name.isdigit():
                shutil.rmtree(step)
    elif deleted == "jddp.run":
        (directory / identity.FILENAME).unlink()
    _, fresh, _ = make(2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jddp.Checkpointer(directory) as ckpt:
            got = ckpt.restore_or_init(fresh)
            assert (ckpt.run_id, ckpt.restored_from, weight(got), int(got.step)) == (run, "memory", last, 3)


@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_a_checkpoint_of_another_run_is_refused_or_named_in_a_warning(tmp_path, allow):
    """A step copied in from another run's directory: an error naming both runs, or with allow_other_run=True a
    warning naming both and the step restored. Nothing is set aside: it is not damage."""
    for name, scale in (("a", 1.0), ("b", 2.0)):
        dp, state, loader = make(scale)
        with jddp.Checkpointer(tmp_path / name, snapshots=False) as ckpt:
            state, _ = dp.step(state, next(iter(loader)))
            ckpt.save(state, wait=True)
    runs = {n: identity.read(tmp_path / n)[0] for n in "ab"}
    assert None not in runs.values() and runs["a"] != runs["b"]
    shutil.rmtree(tmp_path / "b" / "1")
    shutil.copytree(tmp_path / "a" / "1", tmp_path / "b" / "1")
    _, fresh, _ = make(3.0)
    both = rf"written by run {runs['a']} .*belongs to run {runs['b']}"
    with jddp.Checkpointer(tmp_path / "b", allow_other_run=allow, snapshots=False) as ckpt:
        if allow:
            with pytest.warns(jddp.CheckpointWarning, match=both):
                got = ckpt.restore_or_init(fresh)
            assert (weight(got), ckpt.restored_from) != (3.0, None)
        else:
            with pytest.raises(ValueError, match=both + ".*allow_other_run=True"):
                ckpt.restore_or_init(fresh)
        assert ckpt.damaged == [] and ckpt.all_steps() == [1]


@pytest.mark.parametrize("where", ["missing", "mistyped", "empty"])
def test_a_reader_of_a_directory_holding_nothing_says_so(tmp_path, where):
    (tmp_path / "ckpt").mkdir()
    path = {"missing": tmp_path / "no" / "ckpt", "mistyped": tmp_path / "ckpy", "empty": tmp_path / "ckpt"}[where]
    said = {
        "missing": r"does not exist: the state passed in is returned untrained",
        "mistyped": r"does not exist.*close names there: 'ckpt'",
        "empty": r"holds no checkpoint \(yet\)",
    }[where]
    _, fresh, _ = make(1.0)
    with jddp.Checkpointer(path, read_only=True) as reader:
        with pytest.warns(jddp.CheckpointWarning, match=said):
            assert reader.restore_or_init(fresh) is fresh
        assert reader.run_id is None


def test_every_checkpoint_and_snapshot_names_its_run_and_fingerprint(tmp_path, memory):
    dp, state, loader = make(1.0)
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=1, snapshot_every=1, config={"lr": 0.01}) as ckpt:
        state, _ = dp.step(state, next(iter(loader)))
        ckpt.maybe_save(state)
        ckpt.wait()
        snaps = ckpt._snapshots
        assert snaps is not None
        snaps.wait()
        run, fingerprint, folder = ckpt.run_id, ckpt.fingerprint, snaps.folder
        ckpt._close(remove_snapshots=False)
    from jddp.checkpoint import restore, snapshot_format

    meta, _ = restore.read_meta(tmp_path / "ckpt", 1)
    assert meta is not None and (meta["run"], meta["config_fingerprint"]) == (run, fingerprint)
    data = (folder / "1.snap").read_bytes()
    (length,) = snapshot_format.HEADER_LENGTH.unpack_from(data, 0)
    import json

    header = json.loads(data[8 : 8 + length])
    assert (header["run"], header["fingerprint"]) == (run, fingerprint) and header["leaves"]
