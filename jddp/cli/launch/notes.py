"""The launcher's temporary ``jddp-launch-*`` folder: the notes its processes leave there when they stop
(``note-<process>.json``, ``jddp.runtime.watchdog``), and the note naming fit's goodput ledger
(``JDDP_LEDGER_NOTE``), read for the first step and marked at teardown (``jddp.goodput``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import tempfile

from jddp.cli.launch import orphans

NOTE_GLOB = re.compile(r"note-(\d+)\.json")  # jddp.runtime.group_link.NOTE_FILE: what a process tells its launcher


class NoteDir:
    """The folder, made when built, removed by ``remove``."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="jddp-launch-")  # JDDP_LEDGER_NOTE: where fit's ledger is
        orphans.remove_at_death(self.path)  # its processes, ended at the launcher's death, cannot remove it
        self.ledger = os.path.join(self.path, "ledger")  # the note naming the ledger (JDDP_LEDGER_NOTE)

    def read(self) -> dict[int, dict]:
        """What the processes told this launcher (``jddp.runtime.group_link.GroupLink.note``), by process index: the
        peers a process found silent, the cause it found (a collective made by a subset of the processes), an early
        end. Notes of an earlier attempt are removed when the next starts."""
        found: dict[int, dict] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                match = NOTE_GLOB.fullmatch(name)
                if match is None:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(self.path, name)) as f:
                        note = json.load(f)
                    if isinstance(note, dict):
                        found[int(match.group(1))] = note
        return found

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(self.path):
                if NOTE_GLOB.fullmatch(name):
                    os.remove(os.path.join(self.path, name))

    def first_step_taken(self, attempt_start: float) -> bool:
        """Whether the goodput ledger of the attempt started at ``attempt_start`` (fit's, named in the note
        ``JDDP_LEDGER_NOTE``) has a first step."""
        from jddp import goodput  # no JAX, no NumPy

        try:
            with open(self.ledger) as f:
                path = f.read().strip()
            with open(path, "rb") as f:
                start, first_step_end = (
                    struct.unpack("<d", os.pread(f.fileno(), 8, 8 * goodput.SLOTS.index(name)))[0]
                    for name in ("attempt_start", "first_step_end")
                )
        except (OSError, ValueError, struct.error):
            return False
        return abs(start - attempt_start) < 1e-3 and first_step_end > 0

    def mark_teardown(self) -> None:
        """Marks the ledger's teardown (the launcher ends)."""
        from jddp import goodput  # no JAX, no NumPy

        goodput.mark_teardown(self.ledger)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
