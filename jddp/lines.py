"""gloo's chatter, and a pipe cut into lines: shared by the launcher's output (``jddp.cli.output``) and, under
``mpiexec``, by a worker filtering its own fd 1 (``jddp.runtime.distributed``).

Imports no JAX.
"""

from __future__ import annotations

import os
import re
from typing import IO

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
