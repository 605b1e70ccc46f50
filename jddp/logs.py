"""Process 0's record of a run: ``metrics.jsonl``, TensorBoard events and the loss plot (used by ``jddp.fit``).

``metrics.jsonl`` holds one JSON record per line (``step``, ``epoch``,
``split`` = ``"train"`` or ``"eval"``, ``run``, then the metrics), appended and
flushed as the run goes, so a kill loses nothing already logged; a resumed run
first drops its own records after its restored step (``keep_until``).

Several runs in one ``log_dir`` (``jddp.goodput`` says what makes a run) are
kept apart: every record of ``metrics.jsonl`` names its run (``run``), each
run's TensorBoard events go to ``tensorboard/<run>/`` (a run of its own in
TensorBoard's list), and ``loss.png`` draws the current run. With
``other_runs="refuse"`` a new run into a ``log_dir`` holding another run's
records or ledgers is refused instead (``check_other_runs``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jddp import run_ids

METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR = "metrics.jsonl", "loss.png", "tensorboard"
OTHER_RUNS = ("apart", "refuse")  # fit's `other_runs`


def check_other_runs(log_dir: Path, run: str, other_runs: str) -> None:
    """Raises ``ValueError`` if ``other_runs="refuse"`` and ``log_dir`` holds records or ledgers of a run other
    than ``run`` (before anything is written): the runs of ``metrics.jsonl`` and of ``jddp.run_ids.runs``."""
    if other_runs != "refuse":
        return
    found = {str(r.get("run", "(no run id: an older jddp)")) for r in read_metrics(log_dir / METRICS_FILE)}
    found |= set(run_ids.runs(log_dir))
    found.discard(run)
    if found:
        raise ValueError(
            f"`log_dir={str(log_dir)!r}` holds the logs of another run ({', '.join(sorted(found))}), and "
            f"`other_runs='refuse'`: this run ({run}) is a new one. Pass another `log_dir`, or "
            "`other_runs='apart'` to log it beside them (every record says its run; TensorBoard gets a folder "
            "per run)."
        )


class RunLog:
    """Process 0's files: ``metrics.jsonl`` (appended, flushed per record), TensorBoard events, the loss plot."""

    def __init__(self, log_dir: Path, first: int, run: str = ""):
        """``run``: the run's id (``jddp.goodput``), written into every record; ``first``: the step it starts at."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.dir = log_dir
        self.run = run
        self.path = log_dir / METRICS_FILE
        kept = keep_until(self.path, first, run)
        # The keys already written (step, split, attempt), to write each once; fit's records come in step order, so
        # only those at the last step written or later can come again: the rest are dropped as the steps go on
        # (a set of every key written grew by one per record, without bound in a long run).
        self.seen = {(r["step"], r["split"], r.get("attempt")) for r in kept if r.get("run") == run}
        # whether this file already holds this run's curves: a resume that goes on logging here (not a new log_dir,
        # not a new run started from a finished run's checkpoint)
        self.continues = any(r.get("run") == run and not r["split"].startswith("goodput") for r in kept)
        self.seen_from = first
        self.file = open(self.path, "a")  # closed in close()
        self.tb = summary_writer(log_dir / TENSORBOARD_DIR / (run or "run"), purge_step=first + 1)

    def write(self, rec: dict) -> None:
        key = (rec["step"], rec["split"], rec.get("attempt"))
        if key in self.seen:  # e.g. the final evaluation of a run resumed after its end
            return
        if key[0] > self.seen_from:
            self.seen_from = key[0]
            self.seen = {k for k in self.seen if k[0] >= key[0]}
        self.seen.add(key)
        rec = {k: rec[k] for k in ("step", "epoch", "split") if k in rec} | {"run": self.run} | rec
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if rec["split"].startswith("goodput"):
            return  # an account of wall time, not a curve
        for name, value in rec.items():
            if name not in ("step", "epoch", "split", "run"):
                self.tb.add_scalar(f"{rec['split']}/{name}", value, rec["step"])

    def close(self) -> None:
        self.file.close()
        self.tb.close()

    def plot(self) -> None:
        """``loss.png``: training and evaluation loss over the whole run (all its attempts, not other runs),
        written atomically."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        records = [r for r in read_metrics(self.path) if r.get("run", "") == self.run]
        figure = Figure(figsize=(6, 4), dpi=100)
        FigureCanvasAgg(figure)
        ax = figure.add_subplot()
        for split, style in (("train", "-"), ("eval", "o-")):
            points = [(r["step"], r["loss"]) for r in records if r["split"] == split and "loss" in r]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=f"{split} loss", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log" if all(r.get("loss", 1) > 0 for r in records) else "linear")
        ax.grid(alpha=0.3)
        ax.legend()
        figure.tight_layout()
        tmp = self.dir / f".{PLOT_FILE}.tmp"
        figure.savefig(tmp, format="png")
        os.replace(tmp, self.dir / PLOT_FILE)


def summary_writer(log_dir: Path, purge_step: int):
    """A tensorboardX ``SummaryWriter``, imported without PyTorch.

    tensorboardX imports ``torch`` when it is installed (seconds), only to accept
    its tensors; fit logs floats. Unless the program already imported it, torch
    is hidden while tensorboardX loads (``sys.modules[name] = None`` makes
    ``import torch`` raise ``ImportError``, which tensorboardX handles).
    """
    hide = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter(str(log_dir), purge_step=purge_step)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl``; a last line cut by a kill is ignored, and so is a line that is not a
    JSON object (a hand's note).

    Raises:
      ValueError: a line that is not JSON before the last one (the file damaged, not cut by a kill), naming the file
        and the line: the records after it would otherwise be lost without a word.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # only the last line can be partial: records are written whole and flushed in order
            raise ValueError(
                f"{path} line {number} is not JSON ({line[:60]!r}) but {len(lines) - number} line(s) follow it: the "
                "file is damaged, not cut by a kill. Remove or repair that line (or move the file aside) to go on."
            ) from None
        if isinstance(record, dict):
            records.append(record)
    return records


def keep_until(path: Path, step: int, run: str = "") -> list[dict]:
    """Drops run ``run``'s records after ``step`` (and a line cut by a kill) from ``path``, atomically; returns the
    rest. ``goodput`` records (``jddp.goodput``) and other runs' records are kept whatever their step."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    # goodput records stay: they account for time spent, whatever happened to the steps
    kept = [
        r
        for r in read_metrics(path)
        if r.get("step", -1) <= step or str(r.get("split", "")).startswith("goodput") or r.get("run", "") != run
    ]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
    return kept
