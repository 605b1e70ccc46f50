"""fit's progress bar (jddp.fit_bar): eval lines above a clean bar on a terminal, whole lines in a log file."""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import typing

from hypothesis import given, settings
from hypothesis import strategies as st

from jddp import fit_bar, fit_outputs
from jddp.cli import output


class Screen:
    """A terminal's character grid: ``\\r`` to column 0, ``\\n`` to the next row, other characters overwrite."""

    def __init__(self):
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0

    def put(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                self.col = 0
            elif ch == "\n":
                self.row, self.col = self.row + 1, 0
                if self.row == len(self.rows):
                    self.rows.append([])
            else:
                line = self.rows[self.row]
                line.extend(" " * (self.col + 1 - len(line)))
                line[self.col] = ch
                self.col += 1

    def lines(self) -> list[str]:
        return ["".join(r).rstrip() for r in self.rows]


class TerminalStream(io.TextIOBase):
    """sys.stdout or sys.stderr on a terminal: line-buffered (a write holding a newline, or a flush, reaches the
    screen; anything else waits in the buffer), both streams on one screen."""

    def __init__(self, screen: Screen):
        self.screen, self.pending = screen, ""

    def isatty(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.pending += s
        if "\n" in s:
            self.flush()
        return len(s)

    def flush(self) -> None:
        self.screen.put(self.pending)
        self.pending = ""


class FileStream(io.StringIO):
    """A log file or a pipe: not a terminal."""

    def isatty(self) -> bool:
        return False


def _on_a_terminal(monkeypatch) -> Screen:
    """sys.stdout and sys.stderr on one fake terminal (set in the test's body: pytest's capture replaces them
    again when the test's call begins, after its fixtures)."""
    screen = Screen()
    out, err = TerminalStream(screen), TerminalStream(screen)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    return screen


def _check_lines_above_the_bar(screen: Screen, said: list[str], total: int) -> None:
    lines = [line for line in screen.lines() if line]
    for text in said:  # each printed line alone on its row: no bar's tail before or after it, nothing blanked in
        assert text in lines, (text, lines)
    assert not any(t in line and line != t for t in said for line in lines), lines
    assert re.search(rf"\b\d+/{total}\b", lines[-1]), lines  # the bar drawn again under the last line


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.integers(1, 30), min_size=1, max_size=6))
def test_each_line_printed_on_a_terminal_is_above_the_bar_with_nothing_of_it_left(steps):
    screen = Screen()
    out, err = TerminalStream(screen), TerminalStream(screen)
    total = sum(steps) + 1
    bar = fit_bar.Bar(total, stream=err)
    said = []
    for i, n in enumerate(steps):
        bar.update(n)
        bar.set_postfix(loss=f"{1 / (i + 1):.4g}")
        said.append(f"step {bar.n} eval: accuracy={0.5 + i / 100:.5g} loss={i:.5g}")
        bar.write(said[-1], file=out)
    _check_lines_above_the_bar(screen, said, total)
    bar.close()


def test_fit_prints_its_lines_above_the_bar_on_a_terminal(monkeypatch):
    screen = _on_a_terminal(monkeypatch)
    outputs = fit_outputs.Outputs(main=True, total=20, show_bar=True, checkpointer=None, other_runs="apart")
    outputs.open(0, None, None, {"step": 0, "epoch": 0.0})
    assert outputs.bar is not None and outputs.bar.terminal
    said = []
    for step in range(1, 8):
        outputs.stepped(step, step, {})
        outputs.show_loss({"loss": 1.0 / step})
        if step % 3 == 0:
            said.append(f"step {step} eval: loss={step / 10:.5g}")
            outputs.say(said[-1])
    _check_lines_above_the_bar(screen, said, 20)
    outputs.close()


@settings(max_examples=25, deadline=None)
@given(
    total=st.integers(1, 3000),
    tick=st.floats(0.001, 5.0),
    every=st.floats(0.5, 30.0),
    initial=st.integers(0, 10),
)
def test_off_a_terminal_the_bar_writes_whole_lines_at_most_one_per_interval(total, tick, every, initial):
    initial = min(initial, total)
    now = [0.0]
    log = FileStream()
    bar = fit_bar.Bar(total, initial, stream=log, clock=lambda: now[0], every_s=every)
    for _ in range(initial, total):
        now[0] += tick
        bar.update(1)
        bar.set_postfix(loss="0.25")
    bar.close()
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    pattern = re.compile(rf"^step (\d+)/{total} \(\d+%\), [\d.e+-]+ steps/s(, loss=0\.25)?$")
    steps = [int(m.group(1)) for m in map(pattern.match, lines) if m]
    assert len(steps) == len(lines), lines[:3]  # every line whole and of that form
    elapsed = tick * (total - initial)
    assert len(lines) <= elapsed / every + 2, (len(lines), elapsed, every)  # rate-limited (+1 at close)
    if total > initial:
        assert steps[-1] == total and steps == sorted(steps)  # the last step always, in order
    assert text == "" or text.endswith("\n")


def test_fit_on_a_log_file_writes_no_carriage_return(monkeypatch):
    log, out = FileStream(), FileStream()
    monkeypatch.setattr(sys, "stderr", log)
    monkeypatch.setattr(sys, "stdout", out)
    outputs = fit_outputs.Outputs(main=True, total=5, show_bar=True, checkpointer=None, other_runs="apart")
    outputs.open(0, None, None, {"step": 0, "epoch": 0.0})
    for step in range(1, 6):
        outputs.stepped(step, step, {})
    outputs.say("step 5 eval: loss=0.5")
    outputs.close()
    assert "\r" not in log.getvalue() + out.getvalue()
    assert log.getvalue().splitlines()[-1].startswith("step 5/5 (100%)") and "step 5 eval: loss=0.5\n" in out.getvalue()


class Recorder:
    """What the launcher writes to its terminal, piece by piece."""

    def __init__(self):
        self.pieces: list[str] = []

    def write(self, s: str) -> None:
        self.pieces.append(s)

    def flush(self) -> None:
        pass


def _relayed(data: str) -> list[str]:
    """``data``, written on a worker's pipe, as ``jddp launch`` forwards it (``jddp.cli.output.Output.pump``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipe")
        with open(path, "w") as f:
            f.write(data)
        recorder = Recorder()
        output.Output().pump(open(path, "rb"), typing.cast(typing.TextIO, recorder), b"[0] ")
    return recorder.pieces


def _worker_under_the_launcher(monkeypatch) -> tuple[list[str], list[str], list[str]]:
    """A fit's bar and lines in a process under ``jddp launch`` (stdout and stderr are pipes), as the launcher
    forwards them: the bar's pieces, the printed lines' pieces, and the lines printed."""
    err, out = FileStream(), FileStream()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(fit_bar, "LINE_EVERY_S", 0.0)  # a line per update, the most a pipe can get
    outputs = fit_outputs.Outputs(main=True, total=9, show_bar=True, checkpointer=None, other_runs="apart")
    outputs.open(0, None, None, {"step": 0, "epoch": 0.0})
    said = []
    for step in range(1, 10):
        outputs.stepped(step, step, {})
        outputs.show_loss({"loss": 1.0 / step})
        if step % 4 == 0:
            said.append(f"step {step} eval: loss={step / 10:.5g}")
            outputs.say(said[-1])
    outputs.close()
    monkeypatch.undo()
    return _relayed(err.getvalue()), _relayed(out.getvalue()), said


def test_under_the_launcher_each_line_stays_whole_however_the_two_pipes_interleave(monkeypatch):
    """The launcher reads a worker's stderr (the bar) and stdout (fit's lines) in two threads: any interleaving of
    their pieces can reach its terminal. Every one leaves each printed line alone on its row."""
    bar, lines, said = _worker_under_the_launcher(monkeypatch)

    @settings(max_examples=200, deadline=None)
    @given(order=st.permutations([0] * len(bar) + [1] * len(lines)))
    def check(order):
        screen, queues = Screen(), [iter(bar), iter(lines)]
        for which in order:
            screen.put(next(queues[which]))
        rows = screen.lines()
        for text in said:
            assert f"[0] {text}" in rows, (text, rows)
        assert not any("eval:" in row and not row.startswith("[0] step ") for row in rows), rows
        assert all(row == f"[0] {t}" for row in rows if "eval:" in row for t in said if t in row), rows

    check()
