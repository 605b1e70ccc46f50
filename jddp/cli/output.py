"""The launcher's output: each process's lines copied to ours with its index in front, gloo's chatter dropped.

Imports no JAX.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import IO, TextIO

# gloo prints this from C++ threads without line buffering, so its pieces arrive whole, split, or inside a
# line the script printed at the same moment: the pieces are cut out wherever they are.
GLOO_CHATTER = re.compile(
    rb"\[Gloo\] Rank \d*|\d* ?is connected to \d+ peer ranks?\. Expected number of connected peer ranks is : \d+"
)


def without_gloo_chatter(line: bytes) -> bytes | None:
    """``line`` with gloo's pieces cut out; ``None`` when nothing but whitespace is left of a line that had some.

    Example:
      >>> without_gloo_chatter(b"[Gloo] Rank 1 is connected to 1 peer ranks. "
      ...                      b"Expected number of connected peer ranks is : 1\\n") is None
      True
      >>> without_gloo_chatter(b"step 3\\n")
      b'step 3\\n'
    """
    cleaned = GLOO_CHATTER.sub(b"", line)
    if cleaned != line and not cleaned.strip():
        return None
    return cleaned


class Output:
    """Writes whole lines to the launcher's stdout and stderr, one writer at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def pump(self, pipe: IO[bytes], target: TextIO, prefix: bytes) -> None:
        """Copies ``pipe`` to ``target`` line by line, each line after ``prefix``, until the pipe closes."""
        for line in iter(pipe.readline, b""):
            cleaned = without_gloo_chatter(line)
            if cleaned is None:
                continue
            if not cleaned.endswith(b"\n"):
                cleaned += b"\n"
            self.write(target, prefix + cleaned)
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
