"""`fit`: the training loop for examples and users who want one, made of jddp's own pieces.

    result = jddp.fit(dp, state, train_loader, epochs=30, eval_loader=test_loader,
                      checkpointer=jddp.Checkpointer("runs/a/ckpt", save_every=500),
                      log_dir="runs/a", config=config)

It adds nothing ``DataParallel``, ``DataLoader`` and ``Checkpointer`` cannot
do; it runs them in the right order and writes what happened:

* **Start**: ``checkpointer.restore_or_init`` (resume), a topology line and the
  resolved config printed, ``config.yaml`` written to ``log_dir`` and beside the
  checkpoints.
* **Each step**: ``dp.step``; every ``log_every`` steps (and at the last) the
  steps' metrics are read (the only wait for the devices fit adds; ``dp.step``
  itself keeps at most ``max_inflight`` steps queued) and a ``train`` record
  appended to ``log_dir/metrics.jsonl`` (flushed: a kill loses nothing
  already logged) and to TensorBoard: the means over the steps since the last
  record, weighted by their real examples or ``Weighted`` weights (``RunningMeans``), plus ``examples``,
  ``steps`` and the last step's metrics as ``last_<name>``; at each epoch's end
  a ``train_epoch`` record of the epoch's means; ``dp.evaluate`` on ``eval_loader`` every
  ``eval_every`` steps (or at each epoch end) and at the end;
  ``checkpointer.maybe_save`` (a SIGTERM saves and raises ``SystemExit(75)``,
  which ``fit`` lets through after closing its logs).
* **End**: a final save, ``log_dir/loss.png``, a summary line, and the run's
  goodput (``jddp.goodput``; the same line ``jddp goodput log_dir`` prints).

**Runs.** Every call with a ``log_dir`` belongs to a run: a new one, or the
run it resumed from a checkpoint or that ``jddp launch`` restarted (the rules
are ``jddp.goodput``'s). Every record of ``metrics.jsonl`` names its run, and
each run's TensorBoard events go to ``log_dir/tensorboard/<run>/``; with
``other_runs="refuse"``, a new run into a ``log_dir`` that holds another run's
logs is refused instead (``jddp.logs``).

Length is counted from step 0 (``steps``, or ``epochs`` times the batches per
epoch), so a resumed run stops where an uninterrupted one does. On resume at
step ``k`` the records of ``metrics.jsonl`` with a step after ``k`` (logged
after the checkpoint, before the kill) are dropped, so the log has no gap and
no duplicated step; TensorBoard is told the same (``purge_step``).

Every decision (log, evaluate, save, stop) follows from the step counter and
the loader position, which every process advances identically. Only process 0
prints, shows the progress bar and writes files.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax

from jddp import checkpoint as checkpoint_lib
from jddp import config as config_lib
from jddp import exitcodes, goodput, logs, validate
from jddp.data import loader as loader_lib
from jddp.engine import metrics as metrics_lib
from jddp.engine import parallel
from jddp.runtime import distributed, progress, standby
from jddp.runtime import state as state_lib

CONFIG_FILE = "config.yaml"
# Steps between replica checks in fit: a check reads the state once on every device (about one optimizer update's
# memory traffic), so every 100 steps costs well under 1% of the step time (benchmarks/replica_check.py).
REPLICA_CHECK_EVERY = 100
TIMES = goodput.TIMERS  # the seconds fit counts, the same its ledger keeps
# Records FitResult.history keeps (the last ones): a long run's memory stays flat (one record per log_every steps
# grew it by about 0.1 MB per 1000 steps); metrics.jsonl in log_dir keeps every record.
HISTORY_KEEP = 1000


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What ``fit`` returns.

    Attributes:
      state: the final ``TrainState``.
      history: the last ``HISTORY_KEEP`` (1000) records this call logged (the
        same on every process; ``metrics.jsonl`` in ``log_dir`` keeps them all):
        ``{"step", "epoch", "split", **metrics}``; ``epoch`` is the loader
        position in epochs (1.0 at the end of the first). ``split`` "train":
        each metric's mean over the steps since the previous train record
        (weighted by real examples; non-finite skipped steps left out and
        counted in ``nonfinite``), ``examples``, ``steps``, and ``last_<name>``
        for the last step's values; "train_epoch": the same means over the
        epoch just ended (over its steps since the start of this call, after a
        resume mid-epoch; ``steps`` says how many); "eval": ``dp.evaluate``.
      final_eval: the metrics of the last evaluation (``{}`` without ``eval_loader``).
      summary: ``steps`` (taken by this call), ``final_step``, ``wall_s``,
        ``examples_per_s`` (global batch size times the steps after the first,
        per second of stepping and waiting for data) and the seconds spent in
        ``compile_s`` (the first step), ``step_s``, ``data_wait_s``,
        ``checkpoint_s`` and ``eval_s``.
    """

    state: state_lib.TrainState
    history: list[dict]
    final_eval: dict[str, float]
    summary: dict[str, float]


def fit(
    dp: parallel.DataParallel,
    state: state_lib.TrainState,
    train_loader: loader_lib.DataLoader,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    eval_loader: loader_lib.DataLoader | None = None,
    eval_every: int | None = None,
    checkpointer: checkpoint_lib.Checkpointer | None = None,
    log_dir: str | os.PathLike | None = None,
    log_every: int = 10,
    config: Any = None,
    progress: bool = True,
    skip_steps: tuple[int, int] | None = None,
    replica_check_every: int | None = REPLICA_CHECK_EVERY,
    other_runs: str = "apart",
) -> FitResult:
    """Trains ``state`` with ``dp`` on ``train_loader``; see the module docstring.

    Args:
      dp: the ``DataParallel`` engine.
      state: from ``dp.init``; replaced by the checkpoint's when there is one.
      train_loader: global training batches; its position is checkpointed.
      epochs: training length in epochs of ``train_loader``, counted from step 0.
      steps: training length in steps, counted from step 0 (exactly one of the two).
      eval_loader: evaluated exactly with ``dp.evaluate``; needs ``drop_last=False``.
      eval_every: steps between evaluations; None: at the end of each epoch.
        There is always one at the end.
      checkpointer: restores at the start, ``maybe_save`` each step, saves at
        the end and is closed.
      log_dir: where process 0 writes ``metrics.jsonl``, TensorBoard events,
        ``config.yaml`` and ``loss.png``; None writes no files.
      log_every: steps between training records (and the last step); None: a record at the last step only.
      config: the run's config (dataclass, mapping or OmegaConf config): printed,
        saved, and fingerprinted by the checkpointer.
      progress: a tqdm bar on process 0.
      replica_check_every: steps between checks that every replica of the
        state is still bit-identical (``dp.check_replicas``: a checksum of
        each copy on its device), also before each checkpoint, so a state
        whose replicas drifted apart is never saved; None: no checks. A
        mismatch raises ``ReplicaMismatchError`` naming the leaf, the devices
        and the processes.
      skip_steps: ``(first, last)``: when the run reaches step ``first``, the
        global batches of steps ``first`` to ``last`` are skipped, unread (after
        a loss spike: resume from a checkpoint before ``first``). The skip is
        recorded in the loader's state (and so in every later checkpoint, and
        in ``examples_at``) and as a ``skip`` record in ``metrics.jsonl``; a
        resume from before ``first`` with the same argument skips the same
        batches, one from after it has them skipped already.
      other_runs: when this call starts a new run (module docstring) in a
        ``log_dir`` that holds another run's logs: ``"apart"`` logs it beside
        them (every record of ``metrics.jsonl`` names its run, TensorBoard gets
        ``tensorboard/<run>/``, ``loss.png`` and the goodput are this run's);
        ``"refuse"`` raises ``ValueError`` on process 0 before it writes anything.

    Returns:
      A ``FitResult``.

    Raises:
      TypeError: for arguments of the wrong kind.
      ValueError: for bad lengths or intervals, an ``eval_loader`` that drops
        examples, ``eval_every`` without ``eval_loader``, or a checkpointer
        holding another config; all before anything runs.
      SystemExit: ``EXIT_PREEMPTED`` (75) after a preemption save.
    """
    _check_args(dp, state, train_loader, eval_loader, checkpointer)
    distributed.announce_topology()  # said once per run; here for a mesh not built by data_mesh
    total = _total_steps(epochs, steps, len(train_loader))
    validate.check_int("eval_every", eval_every, optional=True)
    validate.check_int("log_every", log_every, optional=True)
    validate.check_int("replica_check_every", replica_check_every, optional=True)
    validate.check_bool("progress", progress)
    validate.check_str("other_runs", other_runs)
    if other_runs not in logs.OTHER_RUNS:
        raise ValueError(
            f"`other_runs` must be one of {', '.join(map(repr, logs.OTHER_RUNS))}, got other_runs={other_runs!r}: "
            "'apart' logs a new run beside the runs already in `log_dir`, 'refuse' raises instead."
        )
    log_dir = validate.check_path("log_dir", log_dir, optional=True)  # "" would write into the working directory
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(f"`log_dir` must be a directory (created if missing), got log_dir={log_dir!r}: a file.")
    if eval_every is not None and eval_loader is None:
        raise ValueError(f"`eval_every={eval_every}` needs an `eval_loader`; pass one or drop `eval_every`.")
    if skip_steps is not None:
        ok = isinstance(skip_steps, tuple | list) and len(skip_steps) == 2 and all(type(x) is int for x in skip_steps)
        if not (ok and 0 <= skip_steps[0] <= skip_steps[1]):
            raise ValueError(
                f"`skip_steps={skip_steps!r}` must be (first, last): two step numbers with 0 <= first <= last, "
                "e.g. (100, 110) to skip the data of steps 100 to 110."
            )
    config_text = config_lib.to_yaml(config) if config is not None else None
    if checkpointer is not None and config is not None:
        _fingerprint(checkpointer, config)
    run = _Run(dp, train_loader, eval_loader, checkpointer, total, eval_every, log_every, progress)
    run.skip_steps = None if skip_steps is None else (int(skip_steps[0]), int(skip_steps[1]))
    run.replica_check_every = replica_check_every
    run.other_runs = other_runs
    return run(state, Path(log_dir) if log_dir is not None else None, config, config_text)


def _check_args(dp, state, train_loader, eval_loader, checkpointer) -> None:
    expected = [
        ("dp", dp, parallel.DataParallel, "jddp.DataParallel"),
        ("state", state, state_lib.TrainState, "jddp.TrainState from `dp.init`"),
        ("train_loader", train_loader, loader_lib.DataLoader, "jddp.data.DataLoader"),
        ("eval_loader", eval_loader, (loader_lib.DataLoader, type(None)), "jddp.data.DataLoader or None"),
        ("checkpointer", checkpointer, (checkpoint_lib.Checkpointer, type(None)), "jddp.Checkpointer or None"),
    ]
    for name, value, kind, what in expected:
        if not isinstance(value, kind):
            raise TypeError(f"`{name}` must be a {what}, got {type(value).__name__}.")
    if not isinstance(state.step, jax.Array) or state.step.is_deleted():
        what = "deleted (donated to a later step)" if isinstance(state.step, jax.Array) else "a host copy"
        raise TypeError(
            f"`state` must hold live jax.Arrays on the devices, got a state whose step is {what}. Pass the "
            "TrainState from `dp.init` (or the one the last step returned)."
        )
    if eval_loader is not None and eval_loader.sampler.drop_last:
        raise ValueError(
            "`eval_loader` drops the last partial batch (drop_last=True), so evaluation would skip examples. "
            "Build it with `shuffle=False, drop_last=False`: the padding is masked and every example counts once."
        )
    loader_lib.check_accumulate_steps(train_loader, dp.options.accumulate_steps)


def _total_steps(epochs, steps, per_epoch: int) -> int:
    if (epochs is None) == (steps is None):
        raise ValueError(f"Pass exactly one of `epochs` or `steps`, got epochs={epochs!r}, steps={steps!r}.")
    name, value = ("epochs", epochs) if steps is None else ("steps", steps)
    validate.check_int(name, value)
    return value * per_epoch if name == "epochs" else value


def _fingerprint(checkpointer: checkpoint_lib.Checkpointer, config: Any) -> None:
    fingerprint, plain = checkpoint_lib.config_fingerprint(config)
    if not checkpointer.fingerprint:
        checkpointer.fingerprint, checkpointer.config = fingerprint, plain
    elif checkpointer.fingerprint != fingerprint:
        raise ValueError(
            "`config` differs from the config the `checkpointer` was built with; pass the same one to both "
            "(or build the Checkpointer without `config` and let `fit` give it)."
        )


class _Means:
    """The running means of a ``fit``: the logging window's and the epoch's, saved with each checkpoint so that a
    resumed run logs the same means as an uninterrupted one; and the run's id (``jddp.goodput``: process 0's, which
    is the one Orbax writes), so that a resume continues the run."""

    def __init__(self):
        self.epoch = metrics_lib.RunningMeans()
        self.window = metrics_lib.RunningMeans(parent=self.epoch)
        self.run: str | None = None

    def get_state(self) -> dict:
        window = self.window.get_state()  # reads the window's pending steps into the epoch too: first
        return {"window": window, "epoch": self.epoch.get_state(), "run": self.run}

    def get_state_later(self):
        """``get_state`` as a function to call later from another thread, without waiting for the steps now
        (``RunningMeans.get_state_later``; the window's pending steps count in the epoch's copy as well)."""
        epoch = self.epoch._detached()
        window = self.window._detached(parent=epoch)
        run = self.run

        def state() -> dict:
            window._read_detached()  # into the epoch's copy too
            epoch._read_detached()
            return {"window": window.get_state(), "epoch": epoch.get_state(), "run": run}

        return state

    def set_state(self, state: dict) -> None:
        self.window.set_state(state["window"])
        self.epoch.set_state(state["epoch"])
        self.run = state.get("run")  # None from a checkpoint saved before runs had ids


class _Run:
    """One call of ``fit``: the loop state, the timers and process 0's outputs."""

    def __init__(self, dp, train_loader, eval_loader, checkpointer, total, eval_every, log_every, progress):
        self.dp, self.loader, self.eval_loader, self.ckpt = dp, train_loader, eval_loader, checkpointer
        self.total, self.eval_every, self.log_every, self.progress = total, eval_every, log_every, progress
        self.main = jax.process_index() == 0
        self.times: dict[str, float] = dict.fromkeys(TIMES, 0.0)
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_KEEP)
        self.final_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.steps_run = self.step = 0
        self.means = _Means()
        self.epoch, self.window = self.means.epoch, self.means.window
        self.log: logs.RunLog | None = None
        self.bar = None
        self.ledger: goodput.Ledger | None = None
        self.goodput: goodput.Total | None = None
        self.skip_steps: tuple[int, int] | None = None
        self.replica_check_every: int | None = None
        self.other_runs = "apart"
        self.run_id, self.run_why = "", ""

    @contextlib.contextmanager
    def timed(self, key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[key] += time.perf_counter() - start

    def __call__(self, state, log_dir: Path | None, config, config_text: str | None) -> FitResult:
        if standby.active():  # the next attempt's process, started before the failure (jddp launch): ready it, wait
            self.compile_ahead(state)
            standby.wait()
        start, fit_start = time.perf_counter(), time.time()
        if self.ckpt is not None:
            with self.timed("restore_s"):
                state, _ = self.ckpt.restore_or_init(state, self.loader, extra=self.means)
        self.step = first = int(jax.device_get(state.step))
        if self.main and log_dir is not None:
            self.start_run(log_dir, first, fit_start)
        progress.set_step(first)
        self.announce(first, config_text)
        if self.skip_steps is not None and first > self.skip_steps[0] and not self.loader.sampler.skipped:
            self.say(
                f"fit: skip_steps starts at step {self.skip_steps[0]}, before the restored step {first}: nothing is "
                "skipped (resume from a checkpoint at or before that step to skip its data)"
            )
        if log_dir is not None and progress.PROGRESS.settings.flight_dir is None:
            progress.configure(flight_dir=log_dir)  # stall flight records beside the run's log
        if self.main:
            self.open_outputs(first, log_dir, config)
        try:
            state = self.train(state)
            if self.last_eval_step != self.step and self.eval_loader is not None:
                self.evaluate(state)
            if self.ckpt is not None:
                with self.timed("checkpoint_s"):
                    self.ckpt.save(state, self.loader, extra=self.means)
                    self.ckpt.close()
            if self.ledger is not None:
                self.ledger.finish(self.step, self.steps_run, self.times)
                self.account_attempts(own=True)
        except SystemExit as stop:
            if stop.code == exitcodes.EXIT_PREEMPTED:
                self.say(f"fit: preempted; saved step {self.step}, exiting with {stop.code}. Run again to resume.")
            raise
        finally:  # also on preemption (SystemExit) and errors: what was logged stays on disk
            if self.bar is not None:
                self.bar.close()
            if self.log is not None:
                self.log.close()
        summary = self.summary(time.perf_counter() - start)
        if self.log is not None:
            self.log.plot()
        self.say(
            f"fit: {self.steps_run} steps to step {self.step} in {summary['wall_s']:.1f} s, "
            f"{summary['examples_per_s']:.0f} examples/s; "
            + ", ".join(f"{k[:-2].replace('_', ' ')} {summary[k]:.2f} s" for k in TIMES)
            + (
                f"; {summary['snapshots']:.0f} in-memory snapshots, every {summary['snapshot_every']:.0f} step(s) at "
                "the end"
                if "snapshots" in summary
                else ""
            )
        )
        return FitResult(state, list(self.history), self.final_eval, summary)

    def compile_ahead(self, state) -> None:
        """Compiles the step for ``state`` and the loader's batches (``DataParallel.compile``), the loader's position
        put back: the restored state has ``state``'s shapes and shardings, so the first step runs at once."""
        position = self.loader.get_state()
        iterator = iter(self.loader)
        try:
            batch = next(iterator, None)
        finally:
            iterator.close()
            self.loader.set_state(position)
        if batch is not None:
            self.dp.compile(state, batch)

    def start_run(self, log_dir: Path, first: int, fit_start: float) -> None:
        """Process 0: the run this call belongs to (``jddp.goodput``; refused here under ``other_runs="refuse"``,
        before anything is written) and its ledger."""
        resumed = self.means.run if first < self.total else None  # a finished run's checkpoint starts a new run
        self.run_id, self.run_why = goodput.choose_run(log_dir, resumed)
        logs.check_other_runs(log_dir, self.run_id, self.other_runs)
        self.means.run = self.run_id
        self.ledger = goodput.Ledger(
            goodput.run_dir(log_dir, self.run_id),
            first,
            fit_start=fit_start,
            restored_from=self.ckpt.restored_from if self.ckpt is not None else None,
        )

    def open_outputs(self, first: int, log_dir: Path | None, config) -> None:
        """Process 0: the log files (cut back to step ``first``), config.yaml files, the progress bar."""
        self.log = logs.RunLog(log_dir, first, self.run_id) if log_dir is not None else None
        self.account_attempts(own=False)
        for directory in (log_dir, self.ckpt and self.ckpt.directory):
            if directory is not None and config is not None:
                config_lib.save(config, Path(directory) / CONFIG_FILE)
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=min(first, self.total), unit="step", dynamic_ncols=True)

    def account_attempts(self, *, own: bool) -> None:
        """Process 0: the accounts of the earlier attempts not written yet (at the start), or this attempt's own
        and the run's total (at the end), as ``goodput`` records (``jddp.goodput``)."""
        if self.ledger is None or self.log is None:
            return
        if not own:
            for path, account in self.ledger.open_accounts():
                self.record("goodput", account, history=False)
                goodput.close(path)
            return
        accounts = goodput.ledger_accounts(sorted(self.ledger.directory.glob("attempt-*.ledger")))
        self.record("goodput", accounts[-1], history=False)  # this attempt's: the last ledger of the run
        goodput.close(self.ledger.path)
        total = goodput.Total.of(accounts, self.run_id)  # what `jddp goodput` shows for the same span
        self.record("goodput_total", total.record(), history=False)
        self.goodput = total
        self.say(f"fit: {total.line()}")

    def announce(self, first: int, config_text: str | None) -> None:
        mesh = ", ".join(f"{k}={v}" for k, v in self.dp.mesh.shape.items())
        devices = self.dp.mesh.devices.flat
        local = sum(d.process_index == jax.process_index() for d in devices)
        resumed = f", starting at step {first}" if first else ""
        self.say(
            f"fit: {jax.process_count()} process(es), {self.dp.mesh.devices.size} devices "
            f"({local} local), global batch {self.loader.sampler.global_batch_size}, "
            f"mesh ({mesh}), {self.total} steps ({len(self.loader)} per epoch){resumed}"
        )
        if self.run_id:
            where = self.ledger.directory.parent.parent if self.ledger is not None else ""
            self.say(f"fit: run {self.run_id} ({self.run_why}), logging to {where}")
        if config_text is not None:
            self.say("config:\n" + config_text.rstrip())

    def say(self, text: str) -> None:
        if self.main:
            if self.bar is not None:
                self.bar.write(text, file=sys.stdout)
            else:
                print(text, flush=True)

    def train(self, state):
        iterator = iter(self.loader)
        try:
            while self.step < self.total:
                if self.skip_steps is not None and self.step == self.skip_steps[0]:
                    iterator.close()
                    self.skip_data(*self.skip_steps)
                    iterator = iter(self.loader)
                with self.timed("data_wait_s"):
                    batch = next(iterator, None)
                if batch is None:  # end of an epoch: the loader goes on with the next
                    iterator = iter(self.loader)
                    continue
                state = self.one_step(state, batch)
        finally:
            iterator.close()
        with self.timed("step_s"):  # the steps still running on the devices
            jax.block_until_ready(state)
        return state

    def skip_data(self, first: int, last: int) -> None:
        """Skips the batches of steps ``first`` to ``last`` (the run is at step ``first``), on every process."""
        start = self.loader.sampler.position
        self.loader.skip(last - first + 1)
        self.record("skip", {"position": float(start), "batches": float(last - first + 1)})
        self.say(
            f"fit: skipped the data of steps {first} to {last} (loader positions {start} to {start + last - first})"
        )

    def one_step(self, state, batch):
        start = time.perf_counter()
        state, metrics = self.dp.step(state, batch)
        if self.steps_run == 0:
            jax.block_until_ready(metrics)
            self.times["compile_s"] += time.perf_counter() - start
        else:
            self.times["step_s"] += time.perf_counter() - start
        self.step += 1
        self.steps_run += 1
        if self.ledger is not None:
            self.ledger.update(self.step, self.steps_run, self.times)
        if self.bar is not None:
            self.bar.update(1)
        self.window.add(metrics)
        epoch_end = self.loader.sampler.position % len(self.loader) == 0
        if (self.log_every is not None and self.step % self.log_every == 0) or self.step == self.total:
            with self.timed("step_s"):
                means = self.window.compute()  # waits for this step: the only wait per log interval
            self.record("train", {**means, **{f"last_{k}": v for k, v in self.window.last.items()}})
            self.window.reset()
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{means.get('loss', float('nan')):.4g}", refresh=False)
        if epoch_end:
            with self.timed("step_s"):
                self.window.compute()  # reads the window's steps into the epoch's means
            self.record("train_epoch", self.epoch.compute())
            self.epoch.reset()
        if self.eval_due():
            self.evaluate(state)
        save_due = self.ckpt is not None and bool(self.ckpt.save_every) and self.step % self.ckpt.save_every == 0
        every = self.replica_check_every
        if every is not None and (self.step % every == 0 or save_due):
            with self.timed("step_s"):
                self.dp.check_replicas(state)  # raises before a drifted state can be saved
        if self.ckpt is not None:
            if save_due:
                with self.timed("step_s"):  # a save waits for the step first; count that as stepping
                    jax.block_until_ready(state)
            with self.timed("checkpoint_s"):
                self.ckpt.maybe_save(state, self.loader, extra=self.means)
        return state

    def eval_due(self) -> bool:
        if self.eval_loader is None:
            return False
        if self.eval_every is not None:
            return self.step % self.eval_every == 0
        return self.loader.sampler.position % len(self.loader) == 0

    def evaluate(self, state) -> None:
        with self.timed("step_s"):
            jax.block_until_ready(state)
        with self.timed("eval_s"):
            self.final_eval = self.dp.evaluate(state, self.eval_loader)
        self.last_eval_step = self.step
        self.record("eval", self.final_eval)
        self.say(f"step {self.step} eval: " + " ".join(f"{k}={v:.5g}" for k, v in self.final_eval.items()))

    def record(self, split: str, metrics: dict[str, float], *, history: bool = True) -> None:
        epoch = round(self.loader.sampler.position / len(self.loader), 6)
        rec = {"step": self.step, "epoch": epoch, "split": split, **metrics}
        if history:  # the same on every process
            self.history.append(rec)
        if self.log is not None:
            self.log.write(rec)

    def summary(self, wall: float) -> dict[str, float]:
        t = self.times
        after_first = max(self.steps_run - 1, 0) * self.loader.sampler.global_batch_size
        busy = t["step_s"] + t["data_wait_s"]
        return {
            "steps": float(self.steps_run),
            "final_step": float(self.step),
            "wall_s": wall,
            "examples_per_s": after_first / busy if after_first and busy > 0 else 0.0,
            **t,
            # process 0 with a log_dir: the run's goodput over all its attempts (jddp.goodput)
            **({"goodput": self.goodput.goodput, "run_wall_s": self.goodput.wall_s} if self.goodput else {}),
            **self.snapshot_summary(),
        }

    def snapshot_summary(self) -> dict[str, float]:
        """The in-memory snapshots taken (``jddp.checkpoint.snapshot``) and their interval at the end, if any."""
        every = self.ckpt.snapshot_every if self.ckpt is not None else None
        if self.ckpt is None or every is None:
            return {}
        return {"snapshots": float(self.ckpt.stats["snapshots"]), "snapshot_every": float(every)}
