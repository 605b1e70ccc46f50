"""Freed memory handed back to the system during a long run: ``Trimmer``.

``jddp launch`` starts its processes with glibc allocator settings that keep freed memory
(``jddp.cli.launch.MALLOC_TUNABLES``: one arena, no ``mmap`` for large blocks, a 16 GiB trim threshold), so that
XLA:CPU's fresh buffers for every collective reuse pages instead of faulting new ones in. The price is that the
one arena is never trimmed: a run that saves often (Orbax's saves and the in-memory snapshots allocate and free
blocks of many sizes) fragments it, and the free pages inside it stay resident. Under ``jddp launch -n 2`` with a
snapshot every step and a disk save every 10 (``benchmarks/soak.py``, 20,000 steps of the MNIST-1D MLP), resident
memory grew 0.28 to 0.53 MB per 1000 steps while the bytes in use stayed flat (``benchmarks/save_leak.py``): the
allocator's, not a leak.

``Trimmer.maybe`` calls glibc's ``malloc_trim(0)``, which returns the free pages inside the heap as well as its top
(``madvise(MADV_DONTNEED)``), at most once every ``TRIM_EVERY_S`` seconds: ``Checkpointer.maybe_save`` calls it
once per step, after the step's save and snapshot are started. A trim takes a few milliseconds; the pages it
returns are faulted in again by the next buffers that need them, once a minute instead of at every collective.
Where the C library has no ``malloc_trim`` (not glibc), it does nothing. The decision is local to each process and
changes nothing another process sees, so it needs no agreement.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

TRIM_EVERY_S = 60.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none. Looked up among the symbols the interpreter
    already has loaded (``CDLL(None)``: libc's among them), not through ``ctypes.util.find_library``, which runs
    ``ldconfig`` or a compiler in a child process."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class Trimmer:
    """Trims the process's heap at most every ``every`` seconds (``TRIM_EVERY_S`` when None).

    ``trims`` and ``seconds`` count the trims made and the time they took.
    """

    def __init__(self, every: float | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = TRIM_EVERY_S if every is None else every
        self._trim = _malloc_trim()
        self._clock = clock
        self._last = clock()
        self.trims = 0
        self.seconds = 0.0

    def maybe(self) -> bool:
        """Trims if ``every`` seconds have passed since the last trim (or the start); returns whether it did."""
        now = self._clock()
        if self._trim is None or now - self._last < self.every:
            return False
        start = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - start
        self.trims += 1
        self._last = self._clock()
        return True
