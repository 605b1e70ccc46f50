"""The flight record a process writes when its group stalls, and where the process is stuck.

When the watchdog (``jddp.runtime.watchdog``) finds the group stalled (``jddp.runtime.progress``), every process
writes ``flight-process-<i>.txt`` in the flight directory (``$JDDP_FLIGHT_DIR``, else ``fit``'s ``log_dir``, else
``jddp-flight`` in the working directory): its step and phase, the programs it has completed and has in flight
(``jddp.runtime.dispatch``), every process's progress as it saw it, and the Python stack of every thread.
``stalled_frame`` names the frame of the script's own code where the process is stuck.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

from jddp.runtime import dispatch, progress

FLIGHT_FILE = "flight-process-{}.txt"


def flight_dir() -> Path:
    return Path(progress.PROGRESS.settings.flight_dir or "jddp-flight")


def write_flight_record(
    process_id: int, reason: str, seen: dict[int, progress.Seen], verdict_view: dict[str, str] | None = None
) -> Path | None:
    """Writes this process's flight record (atomically); returns its path, or None if it could not be written."""
    p = progress.PROGRESS
    pending = dispatch.DISPATCHER.in_flight()
    lines = [
        f"jddp flight record: process {process_id}, {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        f"reason: {reason}",
        "",
        f"step {p.step} (steps dispatched), phase {p.phase} for {time.monotonic() - p.since:.1f} s, {p.ticks} ticks",
        f"learned bound {p.bound():.1f} s from {len(p.intervals)} tick intervals{_interval_stats(p)}",
        f"compiled programs completed: {p.programs}, the last: {p.last_done}",
        f"in flight (dispatched, not yet waited for): {', '.join(pending) or 'none'}",
        "",
        "the group when the stall was judged (by the process that judged it):",
        *(f"  process {q}: {text}" for q, text in sorted((verdict_view or {}).items(), key=lambda kv: int(kv[0]))),
        "the group as this process saw it then (processes that had ended or stopped are left out):",
        *(f"  process {q}: {s.describe()}" for q, s in sorted(seen.items())),
        "",
        "Python stacks:",
    ]
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None:
            continue
        main = " (main)" if thread is threading.main_thread() else ""
        lines.append(f"--- thread {thread.name}{main}, most recent call last:")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    text = "\n".join(lines) + "\n"
    directory = flight_dir()
    path = directory / FLIGHT_FILE.format(process_id)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as error:
        os.write(2, f"jddp: could not write the flight record {path}: {error}\n{text}".encode())
        return None
    return path


def _interval_stats(p: progress.Progress) -> str:
    if not p.intervals:
        return ""
    ordered = sorted(p.intervals)
    return f" (median {ordered[len(ordered) // 2]:.4f} s, max {ordered[-1]:.4f} s)"


def _library(filename: str) -> bool:
    """A frame of Python's standard library, an installed package or jddp: not where a script is stuck."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return filename.startswith(tuple(roots)) or f"{os.sep}jddp{os.sep}" in filename or filename.startswith("<")


def stalled_frame() -> str:
    """Where this process is stuck: ``file:line in function``, the innermost frame of the script's own code in
    the thread where that frame is closest to the top of the stack (a transform sleeping in a prefetch thread
    rather than the main thread's call of ``fit``); the main thread wins ties. jddp's own threads are left out."""
    frames = sys._current_frames()
    best: tuple[int, int, str] | None = None
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None or thread.name.startswith("jddp-"):
            continue
        stack = traceback.extract_stack(frame)
        own = [i for i, f in enumerate(stack) if not _library(f.filename)]
        if not own:
            continue
        f = stack[own[-1]]
        main = thread is threading.main_thread()
        key = (len(stack) - 1 - own[-1], 0 if main else 1)
        where = f"{f.filename}:{f.lineno} in {f.name}" + ("" if main else f" (thread {thread.name})")
        if best is None or key < best[:2]:
            best = (*key, where)
    return best[2] if best is not None else "an unknown place (no frame of the script's own code)"
