"""One call of ``fit``: its loop over the steps, its evaluations, its saves and its timers.

``jddp.loop.fit`` checks the arguments and hands them to a ``Loop``; what the loop records, writes and prints goes
through ``jddp.fit_outputs``. Every decision (log, evaluate, save, stop) follows from the step counter and the
loader position, which every process advances identically (``jddp.loop``'s module docstring).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax

from jddp import exitcodes, fit_outputs, goodput_accounts
from jddp.engine import metrics as metrics_lib
from jddp.runtime import dispatch, progress, standby

TIMES = goodput_accounts.TIMERS  # the seconds fit counts, the same its ledger keeps


class Means:
    """The running means of a ``fit``: the logging window's and the epoch's, saved with each checkpoint so that a
    resumed run logs the same means as an uninterrupted one; the run's id (``jddp.goodput``: process 0's, which
    is the one Orbax writes), so that a resume continues the run; and the records of the newest step that wrote
    any (``last``), which a resume at that step writes if the log lacks them (``Loop.begin``): every process
    computes them, but only process 0 writes them, and a process 0 killed while it waited for a step's metrics
    never wrote the records of a step its peers had snapshotted already."""

    def __init__(self):
        self.epoch = metrics_lib.RunningMeans()
        self.window = metrics_lib.RunningMeans(parent=self.epoch)
        self.run: str | None = None
        self.last: list[dict] = []  # the records of the newest step that wrote any, as written

    def note(self, rec: dict) -> None:
        """``rec`` was written (or would have been, on a process other than 0)."""
        if self.last and self.last[0]["step"] != rec["step"]:
            self.last = []
        self.last.append(rec)

    def get_state(self) -> dict:
        window = self.window.get_state()  # reads the window's pending steps into the epoch too: first
        return {"window": window, "epoch": self.epoch.get_state(), "run": self.run, "last": list(self.last)}

    def get_state_later(self):
        """``get_state`` as a function to call later from another thread, without waiting for the steps now
        (``RunningMeans.get_state_later``; the window's pending steps count in the epoch's copy as well)."""
        epoch = self.epoch._detached()
        window = self.window._detached(parent=epoch)
        run, last = self.run, list(self.last)

        def state() -> dict:
            window._read_detached()  # into the epoch's copy too
            epoch._read_detached()
            return {"window": window.get_state(), "epoch": epoch.get_state(), "run": run, "last": last}

        return state

    def set_state(self, state: dict) -> None:
        last = _records(state.get("last") or [])  # first: refused before anything changes; none in older checkpoints
        self.window.set_state(state["window"])
        self.epoch.set_state(state["epoch"])
        self.run = state.get("run")  # None from a checkpoint saved before runs had ids
        self.last = last


def _records(value) -> list[dict]:
    """``Means.last`` as read back from a checkpoint: records, each with a whole ``step`` and a ``split``.

    Raises:
      ValueError: anything else (the checkpoint's ``extra`` damaged or written by other code), naming the value.
    """
    ok = isinstance(value, list) and all(
        isinstance(r, dict) and type(r.get("step")) is int and isinstance(r.get("split"), str) for r in value
    )
    if not ok:
        raise ValueError(
            f"The checkpoint's fit state holds last={value!r:.200}: expected a list of records with a whole 'step' "
            "and a 'split' (jddp.fit writes them). Restore another step, or remove 'last' from its extra state."
        )
    return list(value)


class Loop:
    """One call of ``fit``: the loop state and the timers; its outputs are ``self.out`` (``jddp.fit_outputs``)."""

    def __init__(
        self,
        dp,
        train_loader,
        eval_loader,
        checkpointer,
        total: int,
        *,
        eval_every: int | None,
        log_every: int | None,
        progress: bool,
        skip_steps: tuple[int, int] | None,
        replica_check_every: int | None,
        other_runs: str,
    ):
        self.dp, self.loader, self.eval_loader, self.ckpt = dp, train_loader, eval_loader, checkpointer
        self.total, self.eval_every, self.log_every = total, eval_every, log_every
        self.skip_steps, self.replica_check_every = skip_steps, replica_check_every
        main = jax.process_index() == 0
        self.out = fit_outputs.Outputs(
            main=main, total=total, show_bar=progress, checkpointer=checkpointer, other_runs=other_runs
        )
        self.times: dict[str, float] = dict.fromkeys(TIMES, 0.0)
        self.final_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.steps_run = self.step = 0
        self.means = Means()
        self.epoch, self.window = self.means.epoch, self.means.window

    @contextlib.contextmanager
    def timed(self, key: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[key] += time.perf_counter() - start

    def __call__(self, state, log_dir: Path | None, config, config_text: str | None):
        """Runs the call; returns what ``FitResult`` holds: the state, the history, the last evaluation, the
        summary."""
        if standby.active():  # the next attempt's process, started before the failure (jddp launch): ready it, wait
            standby.restoring(state, self.loader)  # the training loader: the engine's hook compiles for its batch
            self.compile_ahead(state)
            standby.wait()
        start, fit_start = time.perf_counter(), time.time()
        state = self.begin(state, log_dir, fit_start, config, config_text)
        try:
            state = self.run_to_end(state)
        except SystemExit as stop:
            if stop.code == exitcodes.EXIT_PREEMPTED:
                self.out.completed(self.step)  # saved, so complete
                self.out.say(f"fit: preempted; saved step {self.step}, exiting with {stop.code}. Run again to resume.")
            raise
        finally:  # also on preemption (SystemExit) and errors: what was logged stays on disk
            self.out.close()
        summary = self.summary(time.perf_counter() - start)
        self.out.plot()
        self.say_summary(summary)
        return state, list(self.out.history), self.final_eval, summary

    def begin(self, state, log_dir: Path | None, fit_start: float, config, config_text: str | None):
        """The restore, the run and its ledger, the lines said at the start and process 0's outputs opened."""
        if self.ckpt is not None:
            with self.timed("restore_s"):
                state, _ = self.ckpt.restore_or_init(state, self.loader, extra=self.means)
        self.step = first = int(jax.device_get(state.step))
        if self.out.main and log_dir is not None:
            resumed = self.means.run if first < self.total else None  # a finished run's checkpoint starts a new run
            self.means.run = self.out.start_run(log_dir, first, fit_start, resumed)
        progress.set_step(first)
        self.out.announce(self.dp, self.loader, first, config_text)
        if self.skip_steps is not None and first > self.skip_steps[0] and not self.loader.sampler.skipped:
            self.out.say(
                f"fit: skip_steps starts at step {self.skip_steps[0]}, before the restored step {first}: nothing is "
                "skipped (resume from a checkpoint at or before that step to skip its data)"
            )
        if log_dir is not None and progress.PROGRESS.settings.flight_dir is None:
            progress.configure(flight_dir=log_dir)  # stall flight records beside the run's log
        if self.out.main:
            self.out.open(first, log_dir, config, self.at())
            if self.out.log is not None and self.out.log.continues:  # this run's log goes on: no gap in its steps
                for rec in self.means.last:  # the restored step's records, where its process 0 died first
                    if rec.get("step") == first:
                        self.out.record(rec, history=False)  # the log writes each (step, split) once
        return state

    def run_to_end(self, state):
        """The steps, the final evaluation and save, and the attempt's account."""
        state = self.train(state)
        if self.last_eval_step != self.step and self.eval_loader is not None:
            self.evaluate(state)
        if self.ckpt is not None:
            with self.timed("checkpoint_s"):
                self.ckpt.save(state, self.loader, extra=self.means)
                self.ckpt.close()
        self.out.end_attempt(self.step, self.steps_run, self.times, self.at())
        return state

    def say_summary(self, summary: dict[str, float]) -> None:
        self.out.say(
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
        self.out.say(
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
        # the ledger's step: the newest one known complete (a step still running when a failure comes produced
        # nothing, and is not counted as recomputed by the next attempt)
        self.out.stepped(self.step - dispatch.DISPATCHER.unfinished(), self.steps_run, self.times)
        self.window.add(metrics)
        self.log_train(epoch_end=self.loader.sampler.position % len(self.loader) == 0)
        if self.eval_due():
            self.evaluate(state)
        self.check_and_save(state)
        self.out.completed(self.step - dispatch.DISPATCHER.unfinished())  # again: this step's work may have waited
        return state

    def log_train(self, *, epoch_end: bool) -> None:
        """A ``train`` record every ``log_every`` steps and at the last; a ``train_epoch`` record at an epoch's end."""
        if (self.log_every is not None and self.step % self.log_every == 0) or self.step == self.total:
            with self.timed("step_s"):
                means = self.window.compute()  # waits for this step: the only wait per log interval
            self.record("train", {**means, **{f"last_{k}": v for k, v in self.window.last.items()}})
            self.window.reset()
            self.out.show_loss(means)
        if epoch_end:
            with self.timed("step_s"):
                self.window.compute()  # reads the window's steps into the epoch's means
            self.record("train_epoch", self.epoch.compute())
            self.epoch.reset()

    def check_and_save(self, state) -> None:
        """The replica check when due (and before each save), then ``maybe_save``."""
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
        self.out.say(f"step {self.step} eval: " + " ".join(f"{k}={v:.5g}" for k, v in self.final_eval.items()))

    def at(self) -> dict:
        """The ``step`` and ``epoch`` (the loader position in epochs) a record written now carries."""
        return {"step": self.step, "epoch": round(self.loader.sampler.position / len(self.loader), 6)}

    def record(self, split: str, metrics: dict[str, float], *, history: bool = True) -> None:
        rec = {**self.at(), "split": split, **metrics}
        if history:  # a step's curves (train, train_epoch, eval), kept with the checkpoint: see Means
            self.means.note(rec)
        self.out.record(rec, history=history)

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
            **self.goodput_summary(),
            **self.snapshot_summary(),
        }

    def snapshot_summary(self) -> dict[str, float]:
        """The in-memory snapshots taken (``jddp.checkpoint.snapshot``) and their interval at the end, if any."""
        every = self.ckpt.snapshot_every if self.ckpt is not None else None
        if self.ckpt is None or every is None:
            return {}
        return {"snapshots": float(self.ckpt.stats["snapshots"]), "snapshot_every": float(every)}

    def goodput_summary(self) -> dict[str, float]:
        """Process 0 with a ``log_dir``: the run's goodput over all its attempts (``jddp.goodput``)."""
        total = self.out.goodput
        return {"goodput": total.goodput, "run_wall_s": total.wall_s} if total else {}
