"""Files jddp writes and reads back, damaged every way their format allows: set aside with a warning naming the
file (the writer goes on), or refused with the file named and exit 2 (a report); never Python's own error, never a
report built from garbage (issue 42).

The faults are generated from the formats: the goodput ledger's ``SLOTS`` and ``DOMAINS`` (every truncation length
class and slot boundary, every slot given values outside its domain, another format, run or attempt, a folder, bytes
of something else), the ``goodput`` records' ``RECORD_DOMAINS`` in ``metrics.jsonl``, and the ledger note the
launcher reads (``JDDP_LEDGER_NOTE``).
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import struct
from pathlib import Path

import pytest

from jddp import goodput, goodput_accounts, goodput_ledger, run_ids
from jddp.cli.launch import notes

RUN = "20261124-153012-a3f9"
LEDGER_BYTES = 8 * len(goodput_ledger.SLOTS)

# Each domain's values as the module docstring and DOMAIN_RULES word them, written out here independently of
# goodput_ledger.in_domain: (value, allowed). A domain added to DOMAINS without a line here fails the test (KeyError).
_T = 1.764e9  # a time in late 2025
_SPEC: dict[str, list[tuple[float, bool]]] = {
    "time": [(_T, True), (1.0, True), (0.0, False), (-1.0, False), (2.0**34, False)],
    "time or 0": [(0.0, True), (_T, True), (-1.0, False), (2.0**34, False)],
    "time or nan": [(math.nan, True), (_T, True), (0.0, False), (-_T, False)],
    "seconds": [(0.0, True), (12.5, True), (-1e-9, False), (-3.0, False), (2.0**34, False)],
    "whole": [(0.0, True), (7.0, True), (-1.0, False), (0.5, False), (2.0**53, False)],
    "positive whole": [(1.0, True), (4.0, True), (0.0, False), (-2.0, False), (1.5, False)],
    "flag": [(0.0, True), (1.0, True), (0.5, False), (2.0, False), (-1.0, False)],
    "restored_from": [(float(i), True) for i in range(len(goodput_ledger.RESTORED_FROM))]
    + [(float(len(goodput_ledger.RESTORED_FROM)), False), (-1.0, False), (1.5, False)],
}
_NON_FINITE = [math.nan, math.inf, -math.inf]  # outside every domain but "time or nan"'s NaN


def _domain_cases() -> list[tuple[str, float, bool]]:
    cases = []
    for slot in goodput_ledger.SLOTS:
        domain = goodput_ledger.DOMAINS[slot]
        if domain in ("format", "run", "attempt"):  # the header: its own tests below
            continue
        values = [*_SPEC[domain], *((v, domain == "time or nan" and math.isnan(v)) for v in _NON_FINITE)]
        cases += [(slot, v, ok) for v, ok in values]
    return cases


def _ledger(tmp_path: Path, monkeypatch, run: str = RUN) -> Path:
    """A complete, valid ledger of attempt 0 of ``run``, written by ``Ledger`` as a fit writes it."""
    monkeypatch.setattr(goodput_ledger, "_last_fit_end", None)
    monkeypatch.delenv("JDDP_LEDGER_NOTE", raising=False)
    ledger = goodput_ledger.Ledger(run_ids.run_dir(tmp_path / "log", run), 3, restored_from="disk")
    ledger.update(4, 1, dict.fromkeys(goodput_accounts.TIMERS, 0.125))
    ledger.update(5, 2, dict.fromkeys(goodput_accounts.TIMERS, 0.25))
    ledger.finish(6, 3, dict.fromkeys(goodput_accounts.TIMERS, 0.5))
    monkeypatch.setattr(goodput_ledger, "_last_fit_end", None)
    return ledger.path


def _with_slot(data: bytes, slot: str, value: float) -> bytes:
    at = 8 * goodput_ledger.SLOTS.index(slot)
    return data[:at] + struct.pack("<d", value) + data[at + 8 :]


def _damages(tmp_path: Path, monkeypatch) -> dict[str, bytes | None]:
    """Every damage of one ledger, by name; None: a folder in its place."""
    path = _ledger(tmp_path, monkeypatch)
    good = path.read_bytes()
    path.unlink()
    lengths = {0, 1, LEDGER_BYTES // 2, LEDGER_BYTES - 1} | {8 * k for k in range(1, len(goodput_ledger.SLOTS))}
    out: dict[str, bytes | None] = {f"cut to {n} bytes": good[:n] for n in sorted(lengths)}
    out["a folder"] = None
    out["one byte more"] = good + b"\0"
    out["twice over"] = good + good
    for version in (0.0, 1.0, goodput_ledger.FORMAT + 1.0, 999.0):
        out[f"format {version:.0f}"] = _with_slot(good, "format", version)
    out["another run's"] = _with_slot(good, "run", goodput_ledger.run_key("20261124-153012-ffff"))
    out["another attempt's"] = _with_slot(good, "attempt", 7.0)
    for slot, value, ok in _domain_cases():
        if not ok:
            out[f"{slot}={value!r}"] = _with_slot(good, slot, value)
    rng = random.Random(42)
    out["non-UTF-8 bytes"] = b"\xff\xfe" * (LEDGER_BYTES // 2)
    out["zeros"] = bytes(LEDGER_BYTES)
    for i in range(3):
        out[f"random bytes {i}"] = bytes(rng.randrange(256) for _ in range(LEDGER_BYTES))
    out["text"] = ("not a ledger\n" * 20).encode()[:LEDGER_BYTES]
    return out


def _place(path: Path, damage: bytes | None) -> None:
    if damage is None:
        path.mkdir()
        (path / "inside").write_text("x")
    else:
        path.write_bytes(damage)


def test_every_slot_domain_is_checked_as_its_rule_says(tmp_path, monkeypatch):
    good = _ledger(tmp_path, monkeypatch).read_bytes()
    path = goodput_ledger.read(_ledger(tmp_path, monkeypatch).parent / "attempt-0000.ledger")
    assert path["first_step"] == 3.0 and path["last_step"] == 6.0 and path["restored_from"] == 1.0
    target = run_ids.run_dir(tmp_path / "log", RUN) / "attempt-0000.ledger"
    for slot, value, ok in _domain_cases():
        target.write_bytes(_with_slot(good, slot, value))
        if ok:
            assert goodput_ledger.read(target)[slot] == pytest.approx(value, nan_ok=True), (slot, value)
        else:
            with pytest.raises(goodput_ledger.DamagedLedgerError, match=rf"{re.escape(str(target))}.*`{slot}`"):
                goodput_ledger.read(target)


def test_every_damage_is_refused_naming_the_file(tmp_path, monkeypatch):
    damages = _damages(tmp_path, monkeypatch)
    assert len(damages) > 60
    path = run_ids.run_dir(tmp_path / "log", RUN) / "attempt-0000.ledger"
    for damage in damages.values():
        _place(path, damage)
        with pytest.raises(goodput_ledger.DamagedLedgerError, match=re.escape(str(path))):
            goodput_ledger.read(path)
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def test_a_ledger_copied_into_another_run_or_renamed_is_refused(tmp_path, monkeypatch):
    path = _ledger(tmp_path, monkeypatch)
    other = run_ids.run_dir(tmp_path / "log", "20261124-153012-ffff") / path.name
    other.parent.mkdir(parents=True)
    shutil.copy(path, other)
    with pytest.raises(goodput_ledger.DamagedLedgerError, match=r"`run` holds"):
        goodput_ledger.read(other)
    renamed = path.with_name("attempt-0001.ledger")
    path.rename(renamed)
    with pytest.raises(goodput_ledger.DamagedLedgerError, match=r"`attempt` holds attempt=0.0"):
        goodput_ledger.read(renamed)


def test_a_damaged_ledger_is_set_aside_and_the_next_attempt_goes_on(tmp_path, monkeypatch):
    """The 0-byte ledger of issue 42 stopped every later attempt at its start (``Ledger`` read it and raised)."""
    for name, damage in _damages(tmp_path, monkeypatch).items():
        log = tmp_path / name.replace("/", "_")
        directory = run_ids.run_dir(log, RUN)
        directory.mkdir(parents=True)
        _place(directory / "attempt-0000.ledger", damage)
        monkeypatch.setattr(goodput_ledger, "_last_fit_end", None)
        with pytest.warns(RuntimeWarning, match=re.escape(str(directory / "attempt-0000.ledger"))):
            ledger = goodput_ledger.Ledger(directory, 0)
        assert (directory / "attempt-0000.ledger.damaged").exists(), name
        assert ledger.path.name == "attempt-0001.ledger", name  # never the damaged one's number
        assert ledger.open_accounts() == []
        ledger.finish(1, 1, {})
        (account,) = goodput.run_records(log, RUN)
        assert account["attempt"] == 1.0 and account["finished"] == 1.0


def test_the_report_refuses_a_damaged_ledger_naming_it_and_changes_nothing(tmp_path, monkeypatch, capsys):
    for name, damage in _damages(tmp_path, monkeypatch).items():
        log = tmp_path / name.replace("/", "_")
        first = _ledger(log, monkeypatch)  # attempt 0 whole, attempt 1 damaged
        path = first.with_name("attempt-0001.ledger")
        _place(path, damage)
        before = sorted(p.name for p in first.parent.iterdir())
        assert goodput.main([str(log / "log"), "--png", str(tmp_path / "chart.png")]) == 2, name
        out = capsys.readouterr().out
        assert str(path) in out and "not a usable goodput ledger" in out, (name, out)
        assert sorted(p.name for p in first.parent.iterdir()) == before
        assert not (tmp_path / "chart.png").exists()


def test_format_1_ledgers_without_the_header_are_still_read(tmp_path, monkeypatch):
    good = _ledger(tmp_path, monkeypatch)
    values = goodput_ledger.read(good)
    legacy = [values[k] for k in goodput_ledger.LEGACY_SLOTS]
    for missing in range(len(goodput_ledger._ADDED_SLOTS) + 1):
        good.write_bytes(struct.pack(f"<{len(legacy) - missing}d", *legacy[: len(legacy) - missing]))
        read = goodput_ledger.read(good)
        assert read["processes"] == (values["processes"] if missing < 3 else 1.0)
        assert read["attempt_start"] == values["attempt_start"]
    goodput_ledger.close(good)  # at format 1's offset of `closed`
    assert goodput_ledger.read(good)["closed"] == 1.0
    good.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(goodput_ledger.DamagedLedgerError, match="not a whole number of 8-byte slots"):
        goodput_ledger.read(good)


def test_the_launchers_note_never_writes_into_a_file_that_is_no_ledger(tmp_path, monkeypatch):
    ledger = _ledger(tmp_path, monkeypatch)
    note = tmp_path / "note"
    victim = tmp_path / "victim.bin"
    for damage in _damages(tmp_path / "d", monkeypatch).values():
        if damage is None:
            continue
        victim.write_bytes(damage)
        for named in (victim, victim.with_name("attempt-0000.ledger")):
            if named != victim:
                victim.rename(named)
            note.write_text(str(named))
            goodput_ledger.mark_teardown(note)
            assert named.read_bytes() == damage
            named.rename(victim) if named != victim else None
    for text in (b"\xff\xfe\x00garbage", b"", str(ledger)[:-3].encode(), str(tmp_path).encode()):
        note.write_bytes(text)
        goodput_ledger.mark_teardown(note)  # no error, nothing written
    note.write_text(str(ledger))
    goodput_ledger.mark_teardown(note)
    assert goodput_ledger.read(ledger)["teardown_end"] > 0


def test_the_launchers_first_step_check_reads_a_damaged_ledger_as_no_first_step(tmp_path, monkeypatch):
    ledger = _ledger(tmp_path, monkeypatch)
    start = goodput_ledger.read(ledger)["attempt_start"]
    folder = notes.NoteDir()
    try:
        Path(folder.ledger).write_text(str(ledger))
        assert folder.first_step_taken(start)
        for damage in _damages(tmp_path / "d", monkeypatch).values():
            ledger.unlink() if ledger.is_file() else shutil.rmtree(ledger)
            _place(ledger, damage)
            folder.first_step_taken(start)  # True or False, never an error
        Path(folder.ledger).write_bytes(b"\xff\xfe")
        assert not folder.first_step_taken(start)
    finally:
        folder.remove()


# ------------------------------------------------------------------------------ goodput records of metrics.jsonl


def _record(attempt: int) -> dict:
    """A valid ``goodput`` record as ``fit`` writes it (an account, with its run and split)."""
    base = {k: 1.0 for k in goodput_accounts.PARTS}
    start = _T + 100 * attempt
    return {
        "step": 10, "epoch": 0, "split": "goodput", "run": RUN, "attempt": attempt, "start": start,
        "end": start + sum(base.values()), **base, goodput_accounts.TEARDOWN: 0.0, "recomputed_steps": 0,
        "steps": 10, "first_step": 0, "last_step": 10, "finished": 1, "restored_from": 0, "processes": 2,
        "nodes": 0, "round": 0,
    }  # fmt: skip


def _record_damages() -> dict[str, dict]:
    out = {}
    domains = {**goodput_ledger.RECORD_DOMAINS, **goodput_ledger.OPTIONAL_RECORD_DOMAINS}
    for field, domain in domains.items():
        if field in goodput_ledger.RECORD_DOMAINS:
            out[f"no {field}"] = {k: v for k, v in _record(1).items() if k != field}
        values = [v for v, ok in _SPEC[domain] if not ok] + _NON_FINITE + ["1.0", None, True, [1.0]]
        for value in values:
            if not (domain == "time or nan" and isinstance(value, float) and math.isnan(value)):
                out[f"{field}={value!r}"] = {**_record(1), field: value}
    out["ends before it starts"] = {**_record(1), "end": _T}
    return out


def test_every_damaged_goodput_record_is_refused_naming_the_log(tmp_path, capsys):
    log = tmp_path / "log"
    log.mkdir()
    metrics = log / "metrics.jsonl"
    metrics.write_text(json.dumps(_record(0)) + "\n" + json.dumps(_record(1)) + "\n")
    assert goodput.main([str(log), "--png", str(tmp_path / "c.png")]) == 0  # whole: reported
    assert "over 2 attempt(s)" in capsys.readouterr().out
    damages = _record_damages()
    assert len(damages) > 100
    for name, record in damages.items():
        metrics.write_text(json.dumps(_record(0)) + "\n" + json.dumps(record) + "\n")
        assert goodput.main([str(log)]) == 2, name
        out = capsys.readouterr().out
        assert str(metrics) in out and "is not a usable goodput log" in out, (name, out)


def test_a_goodput_record_written_twice_counts_once(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    lines = [_record(0), _record(0), _record(1)]
    (log / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["attempt"] for r in goodput.run_records(log)] == [0, 1]


@pytest.mark.parametrize("damage", ["non-UTF-8", "a folder"])
def test_an_unreadable_log_is_refused_naming_it(tmp_path, capsys, damage):
    log = tmp_path / "log"
    log.mkdir()
    metrics = log / "metrics.jsonl"
    if damage == "a folder":
        metrics.mkdir()
    else:
        metrics.write_bytes(json.dumps(_record(0)).encode() + b"\n\xff\xfe\n")
    assert goodput.main([str(log)]) == 2
    assert str(metrics) in capsys.readouterr().out


def test_a_log_cut_anywhere_in_its_last_record_reports_the_records_before_it(tmp_path, capsys):
    log = tmp_path / "log"
    log.mkdir()
    whole = json.dumps(_record(0)) + "\n"
    last = json.dumps(_record(1))
    for n in sorted({0, 1, len(last) // 2, len(last) - 1}):
        (log / "metrics.jsonl").write_text(whole + last[:n])
        assert goodput.main([str(log), "--png", str(tmp_path / "c.png")]) == 0
        assert "over 1 attempt(s)" in capsys.readouterr().out
