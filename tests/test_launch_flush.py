"""Survivors flush before they die (``jddp.runtime.flush``): a restart's survivors write out what they buffered."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from jddp.runtime import flush
from tests import multiprocess

FLUSH_RESTART = str(multiprocess.WORKERS / "flush_restart.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["native", "python", "ignored"])
def test_a_survivors_buffered_line_is_on_disk_after_the_restart(how, tmp_path):
    """Process 1 fails; a restart follows, and the launcher ends process 0, which waits with its epoch's line in a
    1 MiB buffer: with its main thread in C, or in Python, its line is on disk after the restart. One that ignores
    the flush signal is SIGKILLed after --flush-grace and its line is lost, but the restart goes on."""
    done = multiprocess.launch(
        "-n", "2", "--max-restarts", "1", "--no-spares", "--flush-grace", "2", FLUSH_RESTART, str(tmp_path), how,
        timeout=300,
    )  # fmt: skip
    shown = done.stdout[-3000:] + done.stderr[-5000:]
    assert done.returncode == 0, shown
    assert f"[0] WAITING 0 {how}" in done.stdout and "restarting the group (1 of 1)" in done.stderr, shown
    assert re.search(r"process 0 \(pid \d+\): stopped by the launcher for the restart", done.stderr), shown
    survivor = (tmp_path / "metrics-0-0.jsonl").read_text()
    if how == "ignored":
        assert survivor == "", survivor
    else:
        assert [json.loads(line) for line in survivor.splitlines()] == [
            {"process": 0, "attempt": 0, "epoch": 0, "loss": 0.5}
        ], survivor
    for p in (0, 1):  # the second attempt finished normally (its files closed)
        assert json.loads((tmp_path / f"metrics-{p}-1.jsonl").read_text())["attempt"] == 1


def test_register_flush_takes_files_and_callables_and_flushes_newest_first(monkeypatch):
    monkeypatch.setattr(flush, "_registered", [])
    order: list[str] = []

    class Writer(io.StringIO):
        def flush(self) -> None:
            order.append("file")

    def broken() -> None:
        order.append("broken")
        raise OSError("a full disk")

    flush.register_flush(Writer())
    flush.register_flush(broken)
    flush.register_flush(lambda: order.append("queue"))
    flush.flush_all()
    assert order == ["queue", "broken", "file"]  # newest first; an error in one does not stop the others


@pytest.mark.parametrize("wrong", ["metrics.jsonl", b"metrics.jsonl", 3, None, object()])
def test_register_flush_refuses_what_it_cannot_flush(wrong, monkeypatch):
    monkeypatch.setattr(flush, "_registered", [])
    with pytest.raises(TypeError, match=r"`register_flush\(f\)` takes a file object or a callable, got f="):
        flush.register_flush(wrong)
    assert flush._registered == []


def test_install_does_nothing_outside_the_launcher(monkeypatch):
    monkeypatch.delenv("JDDP_LEDGER_NOTE", raising=False)
    monkeypatch.setattr(flush, "_installed", False)
    assert flush.install() is False
    assert os.read  # the signal keeps its meaning: nothing was installed
