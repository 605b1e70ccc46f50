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

import os
import re
import sys
import threading
from typing import IO, TextIO

# gloo's message is one C++ statement, ``std::cout << "[Gloo] Rank " << rank << " is connected to " << n <<
# " peer ranks. " << "Expected number of connected peer ranks is : " << n << std::endl``: each operand reaches
# the pipe in one piece (one write, or appended whole to stdio's buffer under its lock; a pipe write of under
# PIPE_BUF bytes is atomic), but the operands of several threads interleave in any order.
GLOO_OPERANDS = (
    b"[Gloo] Rank ",
    b" is connected to ",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
)
GLOO_PIECES = re.compile(rb"\[Gloo\]|is connected to|connected peer ranks")  # any of it at all (for tests)
_GLOO_TOKEN = re.compile(b"|".join(re.escape(op) for op in GLOO_OPERANDS) + rb"|\d+")


def only_gloo(line: bytes) -> bool:
    """Whether ``line`` is made of nothing but gloo's operands and numbers, in any order (an empty line too).

    Example:
      >>> only_gloo(b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
      True
      >>> only_gloo(b" is connected to  is connected to 11 peer ranks. "), only_gloo(b"[Gloo] Rank [Gloo] Rank 01")
      (True, True)
      >>> only_gloo(b"step 3 loss 0.25"), only_gloo(b"[Gloo] Rank 0 is connected to 1 peer ranks. step 3")
      (False, False)
    """
    text = line.rstrip(b"\r\n")
    position = 0
    while position < len(text):
        match = _GLOO_TOKEN.match(text, position)
        if match is None:
            return False
        position = match.end()
    return True


RANK_PREFIX = re.compile(rb"^\[\d+\] ")


def native_line(line: bytes) -> bytes | None:
    """A line of a process's native stdout, or ``None`` when it is nothing but gloo's chatter.

    Example:
      >>> native_line(b"[Gloo] Rank 1 is connected to 1 peer ranks. "
      ...             b"Expected number of connected peer ranks is : 1\\n") is None
      True
      >>> native_line(b"step 3\\n")
      b'step 3\\n'
    """
    return None if only_gloo(line) else line


def segments(pipe: IO[bytes]):
    """The pieces of ``pipe`` that end at ``\\n``, ``\\r`` or ``\\r\\n`` (kept), then what is left unterminated."""
    pending = b""
    fd = pipe.fileno()
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        pending += chunk
        start = 0
        for match in re.finditer(rb"\r\n|\n|\r(?!$)", pending):
            yield pending[start : match.end()]
            start = match.end()
        pending = pending[start:]  # a "\r" at the very end may be the first half of "\r\n": wait for more
    if pending:
        yield pending


class Output:
    """Writes whole lines to the launcher's stdout and stderr, one writer at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def pump(self, pipe: IO[bytes], target: TextIO, prefix: bytes, *, native: bool = False) -> None:
        """Copies ``pipe`` to ``target`` piece by piece, each after ``prefix``, until the pipe closes.

        With ``native``, the pipe is a process's fd 1, where C++ writes: lines with gloo's chatter are dropped, also
        behind a rank's ``[N] `` (``mpiexec -prepend-rank``).
        """
        for piece in segments(pipe):
            if piece == b"\r" or (native and native_line(RANK_PREFIX.sub(b"", piece, count=1)) is None):
                continue  # a bare carriage return: every piece forwarded already ends the line it wrote
            if not piece.endswith((b"\n", b"\r")):
                piece += b"\n"
            self.write(target, prefix + piece)
        pipe.close()

    def write(self, target: TextIO, data: bytes) -> None:
        with self.lock:
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
