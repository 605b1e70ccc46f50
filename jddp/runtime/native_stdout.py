"""This process's stdout in a group: Python's own output kept apart from gloo's chatter on fd 1.

Under ``jddp launch``, ``own_stdout`` moves ``sys.stdout`` to the pipe the launcher gave Python alone, and the
launcher drops gloo's "[Gloo] Rank ... is connected to" lines; in a group joined without it (``srun``, ``mpiexec``,
``JDDP_*`` variables set by hand), ``filter_native_stdout`` drops them from fd 1 itself.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from jddp import envvars, lines

ENV_STDOUT_FD = "JDDP_STDOUT_FD"  # set by `jddp launch` (jddp.cli.launch.ENV_STDOUT_FD)


def own_stdout() -> bool:
    """Under ``jddp launch``: ``sys.stdout`` moves to the pipe the launcher gave Python alone, so that what C++
    writes to fd 1 (gloo's chatter, from its own threads, cut anywhere) never lands inside a printed line
    (``jddp.cli.output``). Returns whether it moved (the launcher then drops the chatter)."""
    fd = envvars.get(ENV_STDOUT_FD)
    os.environ.pop(ENV_STDOUT_FD, None)
    if fd is None:
        return False
    try:
        stream = os.fdopen(fd, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")
    except OSError:
        return False  # not inherited (a process started by the script itself): keep fd 1
    sys.stdout.flush()
    sys.stdout = stream
    return True


_native_filtered = False  # fd 1 goes through _filter_native_stdout's thread


def filter_native_stdout() -> None:
    """Drops gloo's chatter from fd 1 in a group joined without ``jddp launch`` (``srun``, ``mpiexec``, ``JDDP_*``
    variables set by hand), where no launcher filters it.

    gloo's C++ prints ``[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is :
    1`` with ``std::cout`` (fd 1), unconditionally (no log level or variable silences it), each time it connects the
    processes of a new set of devices: at the first collective over them, after ``initialize`` returned, so no
    window around ``initialize`` could hold it. fd 1 therefore becomes a pipe that a thread reads line by line for
    the life of the process, writing on every line that is not made of gloo's words alone (``jddp.lines``; its
    "is NOT connected to" warning passes); ``sys.stdout`` keeps the original fd 1, so Python's own output never
    waits on the thread, and both streams write whole lines (``mpiexec`` and ``srun --label`` prefix each write).
    fd 2, where errors go, is untouched."""
    global _native_filtered
    if _native_filtered:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.flush()
            stream.reconfigure(line_buffering=True)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        original = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
    except OSError:
        return
    _native_filtered = True
    sys.stdout = os.fdopen(original, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")

    def forward() -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            for piece in lines.segments(pipe):
                if lines.native_line(piece) is not None:
                    with contextlib.suppress(OSError):
                        os.write(original, piece)

    threading.Thread(target=forward, name="jddp-native-stdout", daemon=True).start()
