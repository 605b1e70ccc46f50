"""fit's progress bar: tqdm in place on a terminal, one line per update where the output is a file or a pipe.

On a terminal (the bar's stream ``isatty()``) the bar is tqdm's, updated in place with carriage returns, and every
line ``fit`` prints goes above it: ``write`` clears the bar's line (and flushes the clearing, which tqdm leaves in
the stream's buffer: the line printed next otherwise starts where the blanked bar ended), prints the line on
stdout and draws the bar again under it.

Anywhere else (a log file, a pipe, ``nohup``, a scheduler's output file) carriage returns would pile every update
of the run onto one line of tens of kilobytes, so the bar writes whole lines instead: ``step 120/1000 (12%),
35.2 steps/s, loss=0.4321``, at most one every ``LINE_EVERY_S`` seconds, and one for the last step at ``close``.
Under ``jddp launch`` a process's stderr is a pipe to the launcher: its bar is lines too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

# Lines of a bar that is not on a terminal: at most one per this many seconds (a day of training: under 9000
# lines), and the last step's at the end.
LINE_EVERY_S = 10.0


class Stream(Protocol):
    """What the bar writes to: ``sys.stderr``, a file, a pipe."""

    def write(self, s: str, /) -> Any: ...

    def flush(self) -> None: ...


class Bar:
    """fit's bar over ``total`` steps starting at ``initial`` on ``stream`` (default ``sys.stderr``), the subset
    of tqdm's interface ``jddp.fit_outputs`` uses: ``update``, ``set_postfix``, ``write``, ``close``."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        *,
        stream: Stream | None = None,
        clock: Callable[[], float] = time.monotonic,
        every_s: float | None = None,
    ):
        """``clock`` and ``every_s`` (default ``LINE_EVERY_S``): the lines' rate limit off a terminal."""
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.n, self.clock = total, initial, clock
        self.every_s = LINE_EVERY_S if every_s is None else every_s
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.postfix: dict[str, Any] = {}
        self._start = self._last_line = clock()
        self._start_n = self._line_n = initial
        self._tqdm = None
        if self.terminal:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._tqdm is not None:
            self._tqdm.update(n)
        elif self.clock() - self._last_line >= self.every_s:
            self._line()

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        """What the bar shows after the count (the running loss)."""
        self.postfix = values
        if self._tqdm is not None:
            self._tqdm.set_postfix(values, refresh=refresh)

    def write(self, text: str, file: Stream | None = None) -> None:
        """``text`` as a line of its own on ``file`` (default ``sys.stdout``), above the bar."""
        out = file if file is not None else sys.stdout
        if self._tqdm is None:
            out.write(text + "\n")
            out.flush()
            return
        with self._tqdm.get_lock():
            self._tqdm.clear(nolock=True)
            self.stream.flush()  # the bar blanked and the cursor at column 0 before the line (tqdm 4.70 flushes too)
            out.write(text + "\n")
            out.flush()
            self._tqdm.refresh(nolock=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.n != self._line_n:
            self._line()

    def _line(self) -> None:
        now = self.clock()
        rate = (self.n - self._start_n) / (now - self._start) if now > self._start else 0.0
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.stream.write(f"step {self.n}/{self.total}{share}, {rate:.3g} steps/s{extra}\n")
        self.stream.flush()
        self._last_line, self._line_n = now, self.n
