"""jddp.fit: logs the metrics dp.step and dp.evaluate give, resumes a killed run without gaps, checks its arguments."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import exitcodes
from jddp.logs import read_metrics
from jddp.loop import FitResult, fit
from tests import multiprocess

WORKER = str(multiprocess.WORKERS / "fit_train.py")

rng = np.random.default_rng(0)
X = rng.normal(size=(200, 8)).astype(np.float32)
Y = (X[:, :3].argmax(1)).astype(np.int32)


def loss_fn(params, model_state, batch, key):
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    return loss, (model_state, {"accuracy": jddp.masked_mean((logits.argmax(-1) == batch["y"]).astype(float), mask)})


def make(devices: int = 4):
    mesh = jddp.data_mesh(jax.devices()[:devices])
    dp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh)
    init = np.random.default_rng(1)
    state = dp.init({"w1": init.normal(size=(8, 16)).astype(np.float32), "w2": np.zeros((16, 3), np.float32)})
    train = jddp.data.DataLoader({"x": X[:160], "y": Y[:160]}, global_batch_size=16, seed=2, mesh=mesh)
    test = jddp.data.DataLoader(
        {"x": X[160:], "y": Y[160:]}, global_batch_size=16, shuffle=False, drop_last=False, mesh=mesh
    )
    return dp, state, train, test


def tensorboard_scalars(log_dir: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value from the TFRecord event files (length, crc, event, crc)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in log_dir.glob("tensorboard/*/events.out.tfevents.*"):  # one folder per run (jddp.logs)
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = value.simple_value
    return scalars


def weighted_means(rows: list[dict]) -> dict:
    """NumPy's reference for a train record: each metric's mean over the steps, weighted by their examples."""
    w = np.array([r["examples"] for r in rows], np.float64)
    means = {k: float(np.dot([r[k] for r in rows], w) / w.sum()) for k in rows[0] if k not in ("examples", "nonfinite")}
    return {**means, "examples": float(w.sum()), "steps": len(rows), "nonfinite": 0}


def training(records: list[dict]) -> list[dict]:
    """The records of training and evaluation, without the goodput accounts of wall time (jddp.goodput) and
    without the run's id (random: compared apart)."""
    return [{k: v for k, v in r.items() if k != "run"} for r in records if not r["split"].startswith("goodput")]


def assert_records_equal(got: list[dict], expected: list[dict]) -> None:
    assert [(r["step"], r["split"], sorted(r)) for r in got] == [(r["step"], r["split"], sorted(r)) for r in expected]
    for g, e in zip(got, expected, strict=True):
        numbers = {k: v for k, v in e.items() if k != "split"}
        assert {k: g[k] for k in numbers} == pytest.approx(numbers, rel=1e-12, abs=1e-15), (g["step"], g["split"])


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_logged_metrics_are_the_step_and_evaluate_metrics(tmp_path, capsys):
    """fit's records: the example-weighted means of dp.step's metrics over each window and each epoch (the last
    batch of an epoch holds 6 real examples of 16), the last step's, and dp.evaluate's results, for the same steps
    run by hand."""

    def uneven(mesh):
        return jddp.data.DataLoader(
            {"x": X[:150], "y": Y[:150]}, global_batch_size=16, seed=2, drop_last=False, mesh=mesh
        )

    dp, state, _, test = make()
    train = uneven(dp.mesh)
    outside = time.perf_counter()
    result = fit(dp, state, train, steps=13, eval_loader=test, eval_every=5, log_dir=tmp_path, log_every=3,
                 config={"lr": 0.01}, progress=False)  # fmt: skip
    outside = time.perf_counter() - outside

    dp, state, _, test = make()
    train = uneven(dp.mesh)
    expected, window, epoch_rows = [], [], []
    for step in range(1, 14):
        if step in (1, 11):
            loader = iter(train)
        state, metrics = dp.step(state, next(loader))
        window.append(dict(metrics))
        epoch_rows.append(dict(metrics))
        epoch = step / 10
        if step % 3 == 0 or step == 13:
            last = {f"last_{k}": v for k, v in metrics.items()}
            expected.append({"step": step, "epoch": epoch, "split": "train", **weighted_means(window), **last})
            window = []
        if step == 10:
            expected.append({"step": step, "epoch": epoch, "split": "train_epoch", **weighted_means(epoch_rows)})
        if step % 5 == 0 or step == 13:
            expected.append({"step": step, "epoch": epoch, "split": "eval", **dp.evaluate(state, test)})
    assert epoch_rows[9]["examples"] == 6  # the epoch's last batch: the weights matter
    assert_records_equal(result.history, expected)
    assert_records_equal(training(read_metrics(tmp_path / "metrics.jsonl")), expected)
    assert result.final_eval == {k: v for k, v in expected[-1].items() if k not in ("step", "epoch", "split")}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(result.state), jax.device_get(state))

    scalars = tensorboard_scalars(tmp_path)
    assert scalars[("train/loss", 9)] == pytest.approx(expected[3]["loss"], rel=1e-7)
    assert scalars[("eval/accuracy", 13)] == pytest.approx(result.final_eval["accuracy"], rel=1e-7)
    assert len(scalars) == sum(len(r) - 3 for r in expected)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "config.yaml").read_text() == "lr: 0.01\n"

    out = capsys.readouterr().out
    assert "fit: 1 process(es), 4 devices (4 local), global batch 16, mesh (data=4), 13 steps (10 per epoch)" in out
    assert "config:\nlr: 0.01\n" in out and "step 10 eval: accuracy=" in out
    assert "fit: 13 steps to step 13 in " in out
    s = result.summary
    assert s["steps"] == 13 and s["final_step"] == 13
    assert all(s[k] > 0 for k in ("compile_s", "step_s", "data_wait_s", "eval_s")) and s["checkpoint_s"] == 0
    # The parts are disjoint and inside the call: each counted once, none outside fit's own time.
    assert sum(s[k] for k in ("compile_s", "step_s", "data_wait_s", "eval_s")) <= s["wall_s"] <= outside
    assert s["examples_per_s"] == pytest.approx(12 * 16 / (s["step_s"] + s["data_wait_s"]))  # steps after the first


def test_metrics_are_read_only_at_log_points():
    """Reading a step's metrics waits for the devices; fit does it every `log_every` steps, never per step."""
    dp, state, train, _ = make(2)
    returned = []
    step = dp.step

    def recording_step(state, batch):
        read_before.append(sum(m._host is not None for m in returned))
        state, metrics = step(state, batch)
        returned.append(metrics)
        return state, metrics

    dp.step = recording_step
    read_before = []
    fit(dp, state, train, steps=12, log_every=5, progress=False)
    # Steps 1-5 are read together after step 5 (its record), 6-10 after step 10 (its record and the epoch's end).
    assert read_before == [0] * 5 + [5] * 5 + [10] * 2
    assert all(m._host is not None for m in returned)


def test_log_every_none_records_training_once_at_the_last_step(tmp_path):
    """``log_every=None`` (accepted by the validation) means one train record, at the end; it used to pass the
    validation and then fail after the first step (``step % None``), the state already donated."""
    dp, state, train, _ = make(2)
    fit(dp, state, train, steps=7, log_every=None, log_dir=tmp_path, progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") == "train"] == [7]
    assert next(r for r in records if r.get("split") == "train")["steps"] == 7


def test_epochs_evaluate_at_each_epoch_end_once(tmp_path):
    dp, state, train, test = make(2)
    result = fit(dp, state, train, epochs=2, eval_loader=test, log_every=4, progress=False)
    assert isinstance(result, FitResult) and int(result.state.step) == 20
    assert [(r["step"], r["epoch"]) for r in result.history if r["split"] == "eval"] == [(10, 1.0), (20, 2.0)]
    assert [r["step"] for r in result.history if r["split"] == "train"] == [4, 8, 12, 16, 20]
    assert train.get_state()["position"] == 20
    again = fit(dp, result.state, train, epochs=2, progress=False)  # already at its length: no step, no file
    assert again.summary["steps"] == 0 and again.history == [] and again.final_eval == {}


def test_bad_arguments_are_rejected_before_anything_runs(tmp_path):
    dp, state, train, test = make(2)
    log = tmp_path / "log"
    cases = [
        (dict(), ValueError, r"Pass exactly one of `epochs` or `steps`, got epochs=None, steps=None"),
        (dict(epochs=1, steps=5), ValueError, r"exactly one of `epochs` or `steps`, got epochs=1, steps=5"),
        (dict(steps=0), ValueError, r"`steps` must be an int >= 1, got steps=0"),
        (dict(epochs=1.5), ValueError, r"`epochs` must be an int >= 1, got epochs=1.5"),
        (
            dict(steps=2, eval_every=0, eval_loader=test),
            ValueError,
            r"`eval_every` must be an int >= 1 or None, got eval_every=0",
        ),
        (dict(steps=2, log_every=True), ValueError, r"`log_every` must be an int >= 1 or None, got log_every=True"),
        (dict(steps=2, eval_every=5), ValueError, r"`eval_every=5` needs an `eval_loader`"),
        (dict(steps=2, eval_loader=train), ValueError, r"`eval_loader` drops the last partial batch"),
        (dict(steps=2, checkpointer="ckpt"), TypeError, r"`checkpointer` must be a jddp.Checkpointer or None, got str"),
        (dict(steps=2, config=3), TypeError, r"`config` must be a dataclass instance, an OmegaConf config or a"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            fit(dp, state, train, log_dir=log, progress=False, **kwargs)
    with pytest.raises(TypeError, match=r"`dp` must be a jddp.DataParallel, got str"):
        fit("dp", state, train, steps=1)
    with pytest.raises(TypeError, match=r"`state` must be a jddp.TrainState from `dp.init`, got dict"):
        fit(dp, {}, train, steps=1)
    with pytest.raises(TypeError, match=r"`train_loader` must be a jddp.data.DataLoader, got list"):
        fit(dp, state, [], steps=1)
    with jddp.Checkpointer(tmp_path / "ckpt", config={"lr": 1}) as ckpt:
        with pytest.raises(ValueError, match=r"`config` differs from the config the `checkpointer` was built with"):
            fit(dp, state, train, steps=1, checkpointer=ckpt, config={"lr": 2}, log_dir=log)
    assert not log.exists() and int(state.step) == 0 and train.get_state()["position"] == 0


@pytest.mark.slow  # compiling and training twice: the full tier
@pytest.mark.parametrize("lost", [("train",), ("train", "train_epoch", "eval")])
def test_a_resume_writes_the_restored_steps_records_its_process_0_died_before_writing(tmp_path, lost):
    """Process 0 alone writes the log, and its peers snapshot a step while it still waits for that step's metrics:
    killed there, it never wrote the records of a step the group then resumes from. Here a run of 10 steps saves
    step 10 (an epoch's end, an evaluation, a train record); its log loses that step's records (``lost``); the
    resume from step 10 writes them back from the checkpoint (``Means.last``), equal to the lost ones, each once,
    and the rest of the run logs as before."""
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    dp, state, train, test = make()
    with jddp.Checkpointer(ckpt, save_every=10) as c:
        fit(dp, state, train, steps=10, eval_loader=test, eval_every=5, log_dir=log, log_every=5,
            checkpointer=c, progress=False)  # fmt: skip
    path = log / "metrics.jsonl"
    records = read_metrics(path)
    gone = [r for r in records if r["step"] == 10 and r["split"] in lost]
    assert sorted(r["split"] for r in gone) == sorted(lost)
    path.write_text("".join(json.dumps(r) + "\n" for r in records if r not in gone))
    dp, state, train, test = make()
    with jddp.Checkpointer(ckpt, save_every=10) as c:
        fit(dp, state, train, steps=15, eval_loader=test, eval_every=5, log_dir=log, log_every=5,
            checkpointer=c, progress=False)  # fmt: skip
    after = training(read_metrics(path))
    at_10 = [r for r in after if r["step"] == 10]
    assert sorted(r["split"] for r in at_10) == ["eval", "train", "train_epoch"]  # each once
    assert [r for r in at_10 if r["split"] in lost] == training(gone)
    assert [r["step"] for r in after if r["split"] == "train"] == [5, 10, 15]


def run_worker(out: Path, steps: int, **env: str) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, WORKER, str(out), str(steps)],
        env=multiprocess.environment(JDDP_LOCAL_DEVICES="2", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, code: int) -> str:
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == code, f"exit {proc.returncode}\n{out}\n{err}"
    return out


@pytest.mark.slow
def test_killed_and_preempted_run_continues_its_log_and_ends_bitwise_equal(tmp_path):
    """SIGKILL after step 10 (checkpoint 8), then SIGTERM at step 15, then to the end: the log and the
    parameters equal an uninterrupted run's (records after the checkpoint are dropped, none is repeated)."""
    clean, broken = tmp_path / "clean", tmp_path / "broken"
    reference = run_worker(clean, 25)  # alongside the interrupted runs
    try:
        finish(run_worker(broken, 25, KILL_AT="10"), -9)
        assert [r["step"] for r in read_metrics(broken / "log" / "metrics.jsonl")][-2:] == [10, 10]  # past 8
        out = finish(run_worker(broken, 25, TERM_AT="15"), exitcodes.EXIT_PREEMPTED)
        assert "starting at step 8" in out and "fit: preempted; saved step 15, exiting with 75" in out
        out = finish(run_worker(broken, 25), 0)
        assert "starting at step 15" in out and "fit: 10 steps to step 25" in out
    finally:
        finish(reference, 0)

    logged = training(read_metrics(broken / "log" / "metrics.jsonl"))
    assert logged == training(read_metrics(clean / "log" / "metrics.jsonl"))
    # The goodput accounts without a launcher: the killed attempt's steps 9 and 10 were taken again. Its ledger counts
    # a step once known complete (jddp.goodput): step 10 completed inside the maybe_save the kill came in, so the
    # ledger knew it only if the step was done when the loop noted it, just after dispatching it.
    accounts = [r for r in read_metrics(broken / "log" / "metrics.jsonl") if r["split"] == "goodput"]
    assert len({r["run"] for r in read_metrics(broken / "log" / "metrics.jsonl")}) == 1  # resumed: one run
    killed = accounts[0]["last_step"]
    assert killed in (9, 10)
    assert [(a["attempt"], a["first_step"], a["last_step"], a["finished"]) for a in accounts] == [
        (0, 0, killed, 0), (1, 8, 15, 0), (2, 15, 25, 1),
    ]  # fmt: skip
    assert [a["recomputed_steps"] for a in accounts] == [killed - 8, 0, 0]
    assert [r["step"] for r in logged if r["split"] == "train"] == [*range(2, 25, 2), 25]
    assert [r["step"] for r in logged if r["split"] == "eval"] == [5, 10, 15, 20, 25]
    a, b = np.load(clean / "final.npz"), np.load(broken / "final.npz")
    for name in a.files:
        np.testing.assert_array_equal(a[name], b[name])
    assert (broken / "ckpt" / "config.yaml").read_text() == "learning_rate: 0.01\nhidden: 32\n"


@pytest.mark.multiprocess
def test_only_process_0_prints_and_writes(tmp_path):
    done = multiprocess.launch(
        "-n", "2", "--devices-per-process", "2", WORKER, str(tmp_path), "6", env={"PER_PROCESS_LOG": "1"}
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "log0").iterdir()) == [
        "config.yaml",
        "goodput",
        "loss.png",
        "metrics.jsonl",
        "tensorboard",
    ]
    assert not (tmp_path / "log1").exists()
    assert "[0] fit: 2 process(es), 4 devices (2 local)" in done.stdout
    process_1 = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("[1]")]
    assert not [line for line in process_1 if "fit" in line or "eval" in line or "step" in line], process_1
    histories = [json.loads((tmp_path / f"history{p}.json").read_text()) for p in (0, 1)]
    assert histories[0]["history"] == histories[1]["history"]  # the same decisions and values on both
    assert [r["step"] for r in histories[0]["history"]] == [2, 4, 5, 6, 6]


def test_a_restore_without_the_loader_says_the_data_position_is_not_restored(tmp_path):
    """``restore_or_init(state)`` of a checkpoint that holds a data position warns, naming the fix; with the
    loader, the position comes back and nothing is said."""
    import warnings

    _, state, train, _ = make()
    train.skip(3)  # a position of its own: 3 batches in
    ckpt = jddp.Checkpointer(tmp_path / "ckpt")
    ckpt.save(state, train, wait=True)
    ckpt.close()
    _, state, train, _ = make()
    ckpt = jddp.Checkpointer(tmp_path / "ckpt")
    fix = r"without the loader.*`state, loader = checkpointer\.restore_or_init\(state, loader\)`"
    with pytest.warns(jddp.CheckpointWarning, match=fix) as caught:
        ckpt.restore_or_init(state)
    assert [w.filename for w in caught] == [__file__]  # points at the call that lacks the loader
    _, state, train, _ = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.restore_or_init(state, train)
    assert train.sampler.position == 3
    ckpt.close()
    with warnings.catch_warnings():  # an evaluator beside the run reads the model only: nothing to say
        warnings.simplefilter("error")
        with jddp.Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
            assert int(reader.restore_or_init(state).step) == int(state.step)


@pytest.mark.fast
@pytest.mark.parametrize(
    "last",
    [
        "train",
        {"step": 3, "split": "train"},
        [1, 2],
        [{"split": "train"}],
        [{"step": 3.0, "split": "train"}],
        [{"step": True, "split": "train"}],
        [{"step": 3, "split": 7}],
        [{"step": 3, "split": "train"}, None],
    ],
    ids=str,
)
def test_a_checkpoints_records_that_are_not_records_are_refused_naming_them(last):
    """``Means.set_state``: the restored step's records (``last``) come from a file jddp reads back; anything but a
    list of records with a whole ``step`` and a ``split`` is refused, the value named, before the means change."""
    from jddp.fit_loop import Means

    good = Means()
    state = {**good.get_state(), "last": [{"step": 3, "split": "train", "loss": 1.0}]}
    means = Means()
    means.set_state(state)
    assert means.last == state["last"]
    with pytest.raises(ValueError, match=r"holds last=.*expected a list of records with a whole 'step'"):
        means.set_state({**state, "run": "other", "last": last})
    assert means.run == state["run"] and means.last == state["last"]  # refused before anything changed
    empty = Means()
    empty.set_state({k: v for k, v in state.items() if k != "last"})  # a checkpoint from before they were kept
    assert empty.last == []
