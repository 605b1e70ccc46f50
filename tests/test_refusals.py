"""A refused call leaves nothing behind: a ``Checkpointer`` whose start fails after it took its directory's lease
(its snapshot directory cannot be made) gives the lease, Orbax's
manager and its threads back, so the corrected call succeeds in the same process (a notebook), instead of being
refused as "being written by another run: pid <its own>"."""

from __future__ import annotations

import threading

import pytest

import jddp


def refused_with_a_snapshot_directory_that_cannot_be_made(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(blocker / "memory"))  # under a file: mkdir fails
    with pytest.raises(OSError):
        jddp.Checkpointer(tmp_path / "ckpt", snapshots=True)
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(tmp_path / "memory"))
    return {"snapshots": True}


@pytest.mark.parametrize("refuse", [refused_with_a_snapshot_directory_that_cannot_be_made])
def test_after_a_refused_checkpointer_the_corrected_one_opens_the_same_directory(tmp_path, monkeypatch, refuse):
    before = {t.name for t in threading.enumerate()}
    corrected = refuse(tmp_path, monkeypatch)
    assert not {t.name for t in threading.enumerate() if t.name.startswith("jddp-")} - before
    with jddp.Checkpointer(tmp_path / "ckpt", **corrected) as ckpt:
        assert ckpt.all_steps() == []
