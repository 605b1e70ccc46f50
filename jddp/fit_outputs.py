"""What one call of ``fit`` writes and prints: its records, and process 0's run, ledger, files, bar and lines.

Every process keeps the history (the last ``HISTORY_KEEP`` records, ``FitResult.history``); process 0 also
chooses the run the call belongs to and keeps its goodput ledger (``jddp.run_ids``, ``jddp.goodput_ledger``),
appends the records to ``metrics.jsonl`` and TensorBoard (``jddp.logs``), writes ``config.yaml`` beside the log
and the checkpoints, shows the progress bar and prints. The loop itself is ``jddp.fit_loop``.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import jax

from jddp import config as config_lib
from jddp import fit_bar, goodput_accounts, goodput_ledger, logs, run_ids

CONFIG_FILE = "config.yaml"
# Records FitResult.history keeps (the last ones): a long run's memory stays flat (one record per log_every steps
# grew it by about 0.1 MB per 1000 steps); metrics.jsonl in log_dir keeps every record.
HISTORY_KEEP = 1000


class Outputs:
    """One call of ``fit``'s records (every process) and process 0's outputs; see the module docstring."""

    def __init__(self, *, main: bool, total: int, show_bar: bool, checkpointer, other_runs: str):
        """``main``: this is process 0; ``total``: the run's length in steps; ``show_bar``: a tqdm bar on process 0;
        ``checkpointer``: fit's (its directory gets a ``config.yaml``, its restore says where the state came from);
        ``other_runs``: fit's, checked when the run is chosen."""
        self.main, self.total, self.show_bar = main, total, show_bar
        self.ckpt, self.other_runs = checkpointer, other_runs
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY_KEEP)
        self.log: logs.RunLog | None = None
        self.bar: fit_bar.Bar | None = None
        self.ledger: goodput_ledger.Ledger | None = None
        self.goodput: goodput_accounts.Total | None = None
        self.run_id, self.run_why = "", ""

    def start_run(self, log_dir: Path, first: int, fit_start: float, resumed: str | None) -> str:
        """Process 0: the run this call belongs to (``jddp.goodput``; refused here under ``other_runs="refuse"``,
        before anything is written) and its ledger; returns the run's id. ``resumed``: the run of the restored
        checkpoint, if it has steps left."""
        self.run_id, self.run_why = run_ids.choose_run(log_dir, resumed)
        logs.check_other_runs(log_dir, self.run_id, self.other_runs)
        self.ledger = goodput_ledger.Ledger(
            run_ids.run_dir(log_dir, self.run_id),
            first,
            fit_start=fit_start,
            restored_from=self.ckpt.restored_from if self.ckpt is not None else None,
        )
        return self.run_id

    def open(self, first: int, log_dir: Path | None, config, at: dict) -> None:
        """Process 0: the log files (cut back to step ``first``), config.yaml files, the progress bar. ``at``: the
        ``step`` and ``epoch`` the records written now carry."""
        self.log = logs.RunLog(log_dir, first, self.run_id) if log_dir is not None else None
        self.account_attempts(own=False, at=at)
        for directory in (log_dir, self.ckpt and self.ckpt.directory):
            if directory is not None and config is not None:
                config_lib.save(config, Path(directory) / CONFIG_FILE)
        if self.show_bar:  # tqdm on a terminal, lines in a log file or a pipe
            self.bar = fit_bar.Bar(total=self.total, initial=min(first, self.total))

    def account_attempts(self, *, own: bool, at: dict) -> None:
        """Process 0: the accounts of the earlier attempts not written yet (at the start), or this attempt's own
        and the run's total (at the end), as ``goodput`` records (``jddp.goodput``) at ``at``."""
        if self.ledger is None or self.log is None:
            return
        if not own:
            for path, account in self.ledger.open_accounts():
                self.record({**at, "split": "goodput", **account}, history=False)
                goodput_ledger.close(path)
            return
        # A ledger damaged since (a disk, a hand) is set aside with a warning, as at the start: no error at the end
        found = sorted(self.ledger.directory.glob("attempt-*.ledger"))
        accounts = goodput_ledger.ledger_accounts(goodput_ledger.usable(found))
        self.record({**at, "split": "goodput", **accounts[-1]}, history=False)  # this attempt's: the run's last
        goodput_ledger.close(self.ledger.path)
        total = goodput_accounts.Total.of(accounts, self.run_id)  # what `jddp goodput` shows for the same span
        self.record({**at, "split": "goodput_total", **total.record()}, history=False)
        self.goodput = total
        self.say(f"fit: {total.line()}")

    def stepped(self, step: int, steps_run: int, times: dict[str, float]) -> None:
        """After each step: the ledger (process 0 with a ``log_dir``) and the bar."""
        if self.ledger is not None:
            self.ledger.update(step, steps_run, times)
        if self.bar is not None:
            self.bar.update(1)

    def completed(self, step: int) -> None:
        """The newest step known complete, later in a step than ``stepped`` (the ledger's ``last_step``)."""
        if self.ledger is not None:
            self.ledger["last_step"] = step

    def end_attempt(self, step: int, steps_run: int, times: dict[str, float], at: dict) -> None:
        """``fit`` is done: the ledger's end, this attempt's account and the run's total (process 0)."""
        if self.ledger is not None:
            self.ledger.finish(step, steps_run, times)
            self.account_attempts(own=True, at=at)

    def show_loss(self, means: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{means.get('loss', float('nan')):.4g}", refresh=False)

    def announce(self, dp, loader, first: int, config_text: str | None) -> None:
        """The topology line, the run (process 0 with a ``log_dir``) and the resolved config."""
        mesh = ", ".join(f"{k}={v}" for k, v in dp.mesh.shape.items())
        devices = dp.mesh.devices.flat
        local = sum(d.process_index == jax.process_index() for d in devices)
        resumed = f", starting at step {first}" if first else ""
        self.say(
            f"fit: {jax.process_count()} process(es), {dp.mesh.devices.size} devices "
            f"({local} local), global batch {loader.sampler.global_batch_size}, "
            f"mesh ({mesh}), {self.total} steps ({len(loader)} per epoch){resumed}"
        )
        if self.run_id:
            where = self.ledger.directory.parent.parent if self.ledger is not None else ""
            self.say(f"fit: run {self.run_id} ({self.run_why}), logging to {where}")
        if config_text is not None:
            self.say("config:\n" + config_text.rstrip())

    def say(self, text: str) -> None:
        if self.main:
            if self.bar is not None:
                self.bar.write(text, file=sys.stdout)  # above the bar, its line cleared first
            else:
                print(text, flush=True)

    def record(self, rec: dict, *, history: bool = True) -> None:
        """``rec`` (``step``, ``epoch``, ``split``, the metrics) into the history and, on process 0, the log."""
        if history:  # the same on every process
            self.history.append(rec)
        if self.log is not None:
            self.log.write(rec)

    def close(self) -> None:
        """The bar and the log files (also after an error or a preemption: what was logged stays on disk)."""
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            self.log.close()

    def plot(self) -> None:
        """``loss.png`` (process 0 with a ``log_dir``)."""
        if self.log is not None:
            self.log.plot()
