"""Who may write a checkpoint directory: one writer (a lease), any number of read-only readers."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jddp
from jddp.checkpoint import lease
from tests import multiprocess
from tests.test_checkpoint import make, train


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` with its size and modification time (ns): what a refused open must not touch."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.name != lease.FILENAME  # its heartbeat changes it
    }


def in_flight(directory: Path, step: int) -> Path:
    """What Orbax leaves while it writes ``step``: the temporary directory a second manager would delete."""
    tmp = directory / f"{step}.orbax-checkpoint-tmp-1234"
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "part").write_bytes(b"x" * 100)
    return tmp


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def write_lease(
    directory: Path, *, host: str, pid: int, age_s: float = 0.0, text: str | None = None, **more: object
) -> Path:
    path = directory / lease.FILENAME
    directory.mkdir(parents=True, exist_ok=True)
    owner = {"id": "other", "host": host, "pid": pid, "started": None, "processes": 1, "taken": time.time(), **more}
    path.write_text(text if text is not None else json.dumps(owner))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


# ------------------------------------------------------------------ one writer


def test_a_second_writer_is_refused_naming_the_owner_and_touches_nothing(tmp_path):
    dp, state, loader = make(2)
    first = jddp.Checkpointer(tmp_path, save_every=2)
    train(dp, state, loader, 2, first)
    first.wait()
    tmp = in_flight(tmp_path, 4)  # Orbax's start-up clean-up of a second manager would delete this
    before = snapshot(tmp_path)
    pattern = (
        rf"Checkpoint directory '{tmp_path}' is being written by another run: pid {os.getpid()} on "
        rf"'{socket.gethostname()}', since .*, last heartbeat \d+ s ago\. .*read_only=True"
    )
    for kwargs in ({}, {"save_every": 5}, {"max_to_keep": 1}):
        with pytest.raises(jddp.CheckpointLeaseError, match=pattern):
            jddp.Checkpointer(tmp_path, **kwargs)
    assert snapshot(tmp_path) == before and tmp.is_dir()
    assert first.all_steps() == [2]
    first.close()
    assert not (tmp_path / lease.FILENAME).exists()  # given back
    with jddp.Checkpointer(tmp_path) as second:  # now it may write (Orbax cleans the leftover, in the background)
        assert second.all_steps() == [2] and (tmp_path / lease.FILENAME).exists()


@pytest.mark.parametrize(
    ("owner", "taken_over"),
    [
        ("a dead process of this host", True),
        ("another host, heartbeat fresh", False),
        ("another host, heartbeat stale", True),
        ("unreadable, heartbeat fresh", False),
        ("unreadable, heartbeat stale", True),
    ],
)
@pytest.mark.multiprocess  # starts a process of its own
def test_a_stale_lease_is_taken_over_and_a_live_one_is_not(tmp_path, owner, taken_over):
    if owner.startswith("a dead"):
        path = write_lease(tmp_path, host=socket.gethostname(), pid=dead_pid())
    elif owner.startswith("another"):
        path = write_lease(tmp_path, host="elsewhere", pid=1, age_s=30 if "fresh" in owner else 90)
    else:
        path = write_lease(tmp_path, host="", pid=0, age_s=30 if "fresh" in owner else 90, text='{"id": "oth')
    if not taken_over:
        with pytest.raises(jddp.CheckpointLeaseError, match=r"is being written by another run"):
            jddp.Checkpointer(tmp_path, lease_timeout_s=60)
        assert path.read_text().startswith('{"id": "oth')
        return
    with jddp.Checkpointer(tmp_path, lease_timeout_s=60):
        mine = json.loads(path.read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
    # the stale file is not left aside either; the run's id (jddp.run) is the taker's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jddp.run"]


RUN, ATTEMPT = 1700000000.5, 1700000100.25  # this process's launched run and attempt (jddp launch's variables)


@pytest.mark.parametrize("run", [None, RUN - 1, RUN])
@pytest.mark.parametrize("attempt", [None, ATTEMPT - 50, ATTEMPT, ATTEMPT + 50])
@pytest.mark.parametrize("mine", [True, False])
def test_a_lease_of_an_earlier_attempt_of_the_same_run_is_taken_over_at_once(tmp_path, monkeypatch, run, attempt, mine):
    """A live-looking lease (another host, fresh heartbeat: a lost node 0's process 0) is taken over at once only
    when it was this launched run's, of an earlier attempt or elastic round; any other is refused as before. Generated
    over the owner's run and attempt against this process's (and a process outside jddp launch, which has neither)."""
    if mine:
        monkeypatch.setenv("JDDP_RUN_START", str(RUN))
        monkeypatch.setenv("JDDP_ATTEMPT_START", str(ATTEMPT))
    else:
        monkeypatch.delenv("JDDP_RUN_START", raising=False)
        monkeypatch.delenv("JDDP_ATTEMPT_START", raising=False)
    write_lease(tmp_path, host="elsewhere", pid=1, age_s=1, run=run, attempt=attempt)
    held = lease.Lease(tmp_path, timeout_s=60)
    owner, age = held.read()
    assert owner is not None
    expected = mine and run == RUN and attempt is not None and attempt < ATTEMPT
    reason = held.stale_reason(owner, age)
    assert (reason is not None) == expected, (reason, run, attempt, mine)
    if expected:
        held.acquire()
        assert json.loads((tmp_path / lease.FILENAME).read_text())["attempt"] == ATTEMPT
        held.release()
    else:
        with pytest.raises(jddp.CheckpointLeaseError, match="is being written by another run"):
            held.acquire()


def test_a_writer_whose_lease_was_taken_over_saves_nothing_more(tmp_path):
    """It froze past the timeout and another run took over: its next save raises instead of writing beside it."""
    dp, state, loader = make(2)
    ckpt = jddp.Checkpointer(tmp_path)
    ckpt.save(state, wait=True)
    path = write_lease(tmp_path, host="elsewhere", pid=4242)  # what a take-over leaves
    state, _ = train(dp, state, loader, 1)
    with pytest.raises(jddp.CheckpointLeaseError, match=r"no longer holds the lease .*held by pid 4242 on 'elsewhere'"):
        ckpt.save(state)
    assert ckpt.all_steps() == [0]
    ckpt.close()
    assert json.loads(path.read_text())["pid"] == 4242  # the new owner's lease is not removed by the old one


def test_the_heartbeat_keeps_a_lease_fresh(tmp_path):
    with jddp.Checkpointer(tmp_path, lease_timeout_s=1.2):  # a beat every 0.2 s
        path = tmp_path / lease.FILENAME
        os.utime(path, (0, 0))
        deadline = time.time() + 30
        while path.stat().st_mtime < time.time() - 60 and time.time() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 30


# ------------------------------------------------------------------ readers


def test_read_only_restores_the_newest_step_and_never_writes(tmp_path):
    dp, state, loader = make(2)
    writer = jddp.Checkpointer(tmp_path, save_every=2)
    trained, _ = train(dp, state, loader, 4, writer)
    writer.wait()
    tmp = in_flight(tmp_path, 6)
    before = snapshot(tmp_path)
    _, fresh, _ = make(2)
    with jddp.Checkpointer(tmp_path, read_only=True) as reader:  # beside the writer, which keeps its lease
        restored = reader.restore_or_init(fresh)
        assert int(restored.step) == 4
        np.testing.assert_array_equal(np.asarray(restored.params["w1"]), np.asarray(trained.params["w1"]))
        for call in (lambda: reader.save(restored), lambda: reader.maybe_save(restored)):
            with pytest.raises(jddp.CheckpointError, match=rf"Checkpointer of '{tmp_path}' is read-only"):
                call()
        train(dp, trained, loader, 6, writer)
        writer.wait()
        assert int(reader.restore_or_init(fresh).step) == 6  # it reads the directory afresh
    assert tmp.is_dir() and all(snapshot(tmp_path)[name] == value for name, value in before.items())
    writer.close()


def test_read_only_leaves_a_damaged_step_in_place(tmp_path):
    dp, state, loader = make(2)
    with jddp.Checkpointer(tmp_path, save_every=2) as writer:
        train(dp, state, loader, 4, writer)
    (tmp_path / "4" / "meta" / "metadata").write_text("{torn")
    before = snapshot(tmp_path)
    with jddp.Checkpointer(tmp_path, read_only=True) as reader:
        with pytest.warns(jddp.CheckpointWarning, match=r"step 4 .* leaving it in place \(read-only\)"):
            assert int(reader.restore_or_init(make(2)[1]).step) == 2
    assert snapshot(tmp_path) == before


def test_read_only_on_a_directory_not_written_yet_restores_nothing_and_creates_nothing(tmp_path):
    _, state, _ = make(2)
    with jddp.Checkpointer(tmp_path / "later", read_only=True) as reader:
        assert reader.all_steps() == []
        with pytest.warns(jddp.CheckpointWarning, match=r"'.*later' does not exist: the state passed in is returned"):
            assert reader.restore_or_init(state) is state
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"read-only Checkpointer never saves, got save_every=5"):
        jddp.Checkpointer(tmp_path, read_only=True, save_every=5)
    with pytest.raises(TypeError, match=r"`read_only` must be True or False, got read_only='yes'"):
        jddp.Checkpointer(tmp_path, read_only="yes")


@pytest.mark.multiprocess
def test_an_evaluator_restores_10_complete_steps_while_a_trainer_saves_16_mb_every_step(tmp_path):
    """Two processes on one directory: no save lost, every restore a complete step, a second writer refused."""
    worker = str(multiprocess.WORKERS / "ckpt_access.py")
    env = multiprocess.environment(JDDP_LOCAL_DEVICES="1")
    directory = str(tmp_path / "ckpt")
    trainer = subprocess.Popen(
        [sys.executable, worker, "train", directory, "40"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        evaluator = subprocess.run(
            [sys.executable, worker, "evaluate", directory, "10"], env=env, capture_output=True, text=True, timeout=600
        )
        trained, _ = trainer.communicate(timeout=600)
    finally:
        trainer.kill()
    assert trainer.returncode == 0 and evaluator.returncode == 0, evaluator.stderr[-3000:]
    assert "trainer saved 40 published [39, 40]" in trained, trained
    lines = evaluator.stdout.splitlines()
    assert f"second writer refused: Checkpoint directory '{directory}' is being written by another run" in lines
    restored = [line for line in lines if line.startswith("restored ")]
    assert len(restored) == 10 and all(line.endswith(" complete") for line in restored), evaluator.stdout
    steps = [int(line.split()[1]) for line in restored]
    assert steps == sorted(steps) and steps[-1] <= 40
    assert len(set(steps)) >= 3, steps  # it restored while the trainer saved, not 10 times the last step


# ------------------------------------------------------------------ what is not damage, what is an error


def test_a_checkpoint_without_a_loader_position_restores_the_model_and_says_so(tmp_path):
    dp, state, loader = make(2)
    trained, _ = train(dp, state, loader, 3)
    with jddp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(trained)  # no loader
    dp, state, loader = make(2)
    with jddp.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(jddp.CheckpointWarning, match=r"step 3 .* has no data loader position .* starts from its"):
            state, loader = ckpt.restore_or_init(state, loader)
        assert ckpt.damaged == [] and ckpt.all_steps() == [3]
    assert int(state.step) == 3 and loader.get_state()["position"] == 0
    np.testing.assert_array_equal(np.asarray(state.params["w1"]), np.asarray(trained.params["w1"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "jddp.run"]  # nothing set aside


def test_save_or_restore_after_close_is_an_error_and_closing_twice_is_not(tmp_path):
    _, state, _ = make(2)
    ckpt = jddp.Checkpointer(tmp_path)
    ckpt.close()
    ckpt.close()
    ckpt.wait()
    for action, call in (
        ("save", lambda: ckpt.save(state)),
        ("save", lambda: ckpt.maybe_save(state)),
        ("restore", lambda: ckpt.restore_or_init(state)),
    ):
        with pytest.raises(
            jddp.CheckpointError, match=rf"Cannot {action}: this Checkpointer of '{tmp_path}' is closed"
        ):
            call()
    assert [p.name for p in tmp_path.iterdir()] == ["jddp.run"]  # the run's identity, written when it opened


@pytest.mark.parametrize("url", ["gs://jddp-no-such-bucket/ckpt", "s3://jddp-no-such-bucket/ckpt"])
def test_a_remote_path_goes_to_orbax_not_into_a_local_folder(tmp_path, monkeypatch, url):
    scheme = url.split(":")[0]
    backend = {"gs": "gcsfs", "s3": "s3fs"}[scheme]
    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed: it would try the network")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as caught:  # etils.epath: the backend package is missing
        jddp.Checkpointer(url)
    assert backend in str(caught.value) or scheme in str(caught.value).lower(), caught.value
    assert list(tmp_path.iterdir()) == []  # no folder named "gs:" or "s3:"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lease_timeout_s": 0}, ValueError, r"`lease_timeout_s` must be a finite number >= 1, got lease_timeout_s=0"),
        ({"lease_timeout_s": float("nan")}, ValueError, r"got lease_timeout_s=nan"),
        ({"directory": ""}, ValueError, r"`directory` is empty"),
        ({"directory": 3}, TypeError, r"`directory` must be a path \(str or os.PathLike\), got int: 3"),
    ],
)
def test_bad_access_options_are_refused_before_anything_is_created(tmp_path, monkeypatch, kwargs, error, match):
    monkeypatch.chdir(tmp_path)
    directory = kwargs.pop("directory", tmp_path / "ckpt")
    with pytest.raises(error, match=match):
        jddp.Checkpointer(directory, **kwargs)
    assert list(tmp_path.iterdir()) == []
