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

This module checks ``fit``'s arguments and returns its ``FitResult``; the loop
is ``jddp.fit_loop``, what it writes and prints ``jddp.fit_outputs``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax

from jddp import checkpoint as checkpoint_lib
from jddp import config as config_lib
from jddp import fit_loop, fit_outputs, logs, validate
from jddp.data import loader as loader_lib
from jddp.engine import parallel
from jddp.runtime import distributed
from jddp.runtime import state as state_lib

# Steps between replica checks in fit: a check reads the state once on every device (about one optimizer update's
# memory traffic), so every 100 steps costs well under 1% of the step time (benchmarks/replica_check.py).
REPLICA_CHECK_EVERY = 100
# Kept here for those who read them from jddp.loop; the code reads them where they are defined (patch them there).
CONFIG_FILE, HISTORY_KEEP, TIMES = fit_outputs.CONFIG_FILE, fit_outputs.HISTORY_KEEP, fit_loop.TIMES


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
    _check_other_runs(other_runs)
    log_dir = _check_log_dir(log_dir)
    if eval_every is not None and eval_loader is None:
        raise ValueError(f"`eval_every={eval_every}` needs an `eval_loader`; pass one or drop `eval_every`.")
    _check_skip_steps(skip_steps)
    config_text = config_lib.to_yaml(config) if config is not None else None
    if checkpointer is not None and config is not None:
        _fingerprint(checkpointer, config)
    loop = fit_loop.Loop(
        dp,
        train_loader,
        eval_loader,
        checkpointer,
        total,
        eval_every=eval_every,
        log_every=log_every,
        progress=progress,
        skip_steps=None if skip_steps is None else (int(skip_steps[0]), int(skip_steps[1])),
        replica_check_every=replica_check_every,
        other_runs=other_runs,
    )
    return FitResult(*loop(state, Path(log_dir) if log_dir is not None else None, config, config_text))


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


def _check_other_runs(other_runs) -> None:
    validate.check_str("other_runs", other_runs)
    if other_runs not in logs.OTHER_RUNS:
        raise ValueError(
            f"`other_runs` must be one of {', '.join(map(repr, logs.OTHER_RUNS))}, got other_runs={other_runs!r}: "
            "'apart' logs a new run beside the runs already in `log_dir`, 'refuse' raises instead."
        )


def _check_log_dir(log_dir) -> str | None:
    log_dir = validate.check_path("log_dir", log_dir, optional=True)  # "" would write into the working directory
    if log_dir is not None and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(f"`log_dir` must be a directory (created if missing), got log_dir={log_dir!r}: a file.")
    return log_dir


def _check_skip_steps(skip_steps) -> None:
    if skip_steps is not None:
        ok = isinstance(skip_steps, tuple | list) and len(skip_steps) == 2 and all(type(x) is int for x in skip_steps)
        if not (ok and 0 <= skip_steps[0] <= skip_steps[1]):
            raise ValueError(
                f"`skip_steps={skip_steps!r}` must be (first, last): two step numbers with 0 <= first <= last, "
                "e.g. (100, 110) to skip the data of steps 100 to 110."
            )


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
