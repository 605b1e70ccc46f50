"""The launcher's output: each process's lines copied to ours with its index in front, gloo's chatter dropped.

Each process has three pipes to the launcher: stderr, its native stdout (fd 1: what C++ writes, such as gloo's
"[Gloo] Rank 0 is connected to 1 peer ranks ..." from its own threads, unbuffered and cut anywhere) and, once
``jddp.initialize()`` ran, Python's ``sys.stdout`` on a pipe of its own (``JDDP_STDOUT_FD``). So gloo's pieces
never land inside a line the script printed, however the C++ writes are cut: on the native pipe every line
with a piece of gloo's message is dropped whole, and the script's lines come through the other pipe untouched.

Lines end at ``\n`` or at ``\r``: a progress bar's carriage-return updates are forwarded as such, each with
the prefix, so a terminal shows one bar per process that updates in place.

Imports no JAX.
"""

from __future__ import annotations

import sys
import threading
from typing import IO, TextIO

from jddp.lines import GLOO_PIECES, RANK_PREFIX, native_line, only_gloo, segments

__all__ = ["GLOO_PIECES", "RANK_PREFIX", "Output", "Prefix", "native_line", "only_gloo", "segments"]


class Prefix:
    """What goes in front of each line of one process, settable while its pipes are read: a spare worker
    (``jddp.cli.spare``) takes the ``[N] `` of the process it becomes when it is handed its role."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.held: list[tuple[TextIO, bytes]] | None = None  # a standby process's lines, kept until it is woken


class Output:
    """Writes whole lines to the launcher's stdout and stderr, one writer at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def pump(self, pipe: IO[bytes], target: TextIO, prefix: bytes | Prefix, *, native: bool = False) -> None:
        """Copies ``pipe`` to ``target`` piece by piece, each after ``prefix`` (read for each piece when it is a
        ``Prefix``), until the pipe closes.

        With ``native``, the pipe is a process's fd 1, where C++ writes: lines with gloo's chatter are dropped, also
        behind a rank's ``[N] `` (``mpiexec -prepend-rank``).
        """
        for piece in segments(pipe):
            if piece == b"\r" or (native and native_line(RANK_PREFIX.sub(b"", piece, count=1)) is None):
                continue  # a bare carriage return: every piece forwarded already ends the line it wrote
            if not piece.endswith((b"\n", b"\r")):
                piece += b"\n"
            with self.lock:
                if isinstance(prefix, Prefix) and prefix.held is not None:
                    prefix.held.append((target, piece))
                    continue
                self._write(target, (prefix.value if isinstance(prefix, Prefix) else prefix) + piece)
        pipe.close()

    def release(self, prefix: Prefix) -> None:
        """Writes the lines held for ``prefix`` (after its value now) and stops holding them."""
        with self.lock:
            held, prefix.held = prefix.held or [], None
            for target, piece in held:
                self._write(target, prefix.value + piece)

    def write(self, target: TextIO, data: bytes) -> None:
        with self.lock:
            self._write(target, data)

    @staticmethod
    def _write(target: TextIO, data: bytes) -> None:
        if hasattr(target, "buffer"):
            target.buffer.write(data)
        else:  # a stream without bytes underneath (pytest's capture, io.StringIO)
            target.write(data.decode(errors="replace"))
        target.flush()

    def say(self, message: str) -> None:
        """Prints ``jddp launch: message`` on stderr."""
        with self.lock:
            sys.stderr.write(f"jddp launch: {message}\n")
            sys.stderr.flush()
