"""The goodput ledger (jddp.goodput): every attempt's wall time accounted for, across SIGKILLs and restarts."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp import goodput, goodput_ledger, logs
from tests import multiprocess

FIT_TRAIN = str(multiprocess.WORKERS / "fit_train.py")


@pytest.mark.multiprocess
def test_a_run_killed_twice_accounts_for_its_wall_time_and_the_steps_it_redid(tmp_path):
    start = time.time()
    done = multiprocess.launch(
        "-n", "2", "--max-restarts", "2", "--peer-timeout", "10", FIT_TRAIN, str(tmp_path), "30",
        env={"KILL_AT": "10,17,-1"}, timeout=400,
    )  # fmt: skip
    wall = time.time() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.count("restarting the group") == 2

    records = logs.read_metrics(tmp_path / "log" / logs.METRICS_FILE)
    accounts = [r for r in records if r["split"] == "goodput"]
    (total,) = [r for r in records if r["split"] == "goodput_total"]
    assert [a["attempt"] for a in accounts] == [0, 1, 2]
    assert [a["finished"] for a in accounts] == [0, 0, 1]
    spans = [(int(a["first_step"]), int(a["last_step"])) for a in accounts]
    # Killed at steps 10 and 17, each inside the step's maybe_save, once the step completed; the ledger counts a step
    # once known complete (jddp.goodput), which the loop notes just after dispatching it and after its maybe_save:
    # the killed step, or the one before. Each restart resumes at or before the kill: from the disk checkpoint (every
    # 4), an in-memory snapshot, or the kept step of the kill (jddp.checkpoint.snapshot_kept).
    assert spans[0][0] == 0 and spans[0][1] in (9, 10) and spans[1][1] in (16, 17) and spans[2][1] == 30, spans
    assert 8 <= spans[1][0] <= 10 and 16 <= spans[2][0] <= 17, spans

    # The steps redone, recorded independently by the worker (every step process 0 took, at its maybe_save, once
    # the step completed, by attempt): a step taken in two attempts was recomputed, less the killed step when the
    # ledger did not know it complete.
    taken = [tuple(map(int, line.split())) for line in (tmp_path / "steps0.txt").read_text().splitlines()]
    redone = sum(
        len({s for a, s in taken if a == i and s <= last} & {s for a, s in taken if a == i + 1})
        for i, (_, last) in enumerate(spans)
    )
    expected = sum(max(0, last - following) for (_, last), (following, _) in itertools.pairwise(spans))
    assert redone == total["recomputed_steps"] == sum(a["recomputed_steps"] for a in accounts) == expected
    for a, following in itertools.pairwise(accounts):
        mine = {s for attempt, s in taken if attempt == a["attempt"] and s <= a["last_step"]}
        theirs = {s for attempt, s in taken if attempt == following["attempt"]}
        assert a["recomputed_steps"] == len(mine & theirs)
        assert (a["recomputed_s"] > 0) == (a["recomputed_steps"] > 0) and a["lost_s"] > 0  # killed: its end lost
        assert following["start"] - a["end"] == pytest.approx(a["downtime_s"], abs=1e-3)

    # Each attempt's parts add up to its wall time; the run's to the launcher's wall time as measured here.
    for a in accounts:
        assert sum(a[k] for k in goodput.PARTS) - a["downtime_s"] == pytest.approx(a["end"] - a["start"], abs=1e-3)
        assert all(a[k] >= 0 for k in goodput.PARTS)
    parts = sum(total[k] for k in goodput.PARTS)
    assert parts == pytest.approx(total["wall_s"], rel=1e-3)
    # The launcher wrote its end into the last ledger (after fit's records): with the teardown after fit's end,
    # the run's account is the launcher's wall time (the first attempt starts with the launcher).
    run = goodput.Total.of(goodput.run_records(tmp_path / "log"))
    assert run.teardown_s > 0 and "teardown_s" not in total
    # Each part of each attempt is floored to the microsecond (goodput_accounts._floor6): the sum stays within the
    # span, short of it by at most a microsecond a part.
    assert 0 <= run.wall_s - sum(run.parts.values()) <= 1e-6 * len(goodput.PARTS) * run.attempts + 1e-9
    # The launcher's wall time, from its own start (run.json keeps $JDDP_RUN_START, taken once its imports were
    # done; a loaded machine makes the interpreter's start before it slow, which no account sees) to its end.
    (run_id,) = goodput.runs(tmp_path / "log")
    launched = float(goodput.run_info(tmp_path / "log", run_id)["launchers"][0])
    assert start <= launched <= start + wall
    seen = start + wall - launched
    assert abs(run.wall_s + run.teardown_s - seen) <= 0.05 * seen, (run.wall_s, run.teardown_s, seen, wall)
    assert run.parts == pytest.approx({k: total[k] for k in goodput.PARTS}, abs=1e-5)
    assert run.wall_s == pytest.approx(total["wall_s"], abs=1e-5)
    assert total["step_s"] > 0 and total["compile_s"] > 0 and total["startup_s"] > 0
    assert total["goodput"] == pytest.approx(total["step_s"] / total["wall_s"], rel=1e-4)
    assert f"3 attempt(s) ({expected} steps recomputed)" in done.stdout
    assert {r["run"] for r in records} == set(goodput.runs(tmp_path / "log"))  # one run, its three attempts

    shown = subprocess.run(
        [sys.executable, "-m", "jddp.cli.main", "goodput", str(tmp_path / "log")],
        capture_output=True, text=True, check=True, env=multiprocess.environment(),
    ).stdout  # fmt: skip
    assert f"attempt 0: steps 0..{spans[0][1]} (stopped)" in shown
    assert f"attempt 2: steps {spans[2][0]}..30 (finished)" in shown
    assert f"{run.wall_s:.2f}" in shown
    # fit's summary line and `jddp goodput`'s are the same figures for the same span (the run's start to fit's
    # end), which each names; `jddp goodput` shows the teardown after it apart.
    (said,) = [line.split("fit: ", 1)[1] for line in done.stdout.splitlines() if "fit: goodput of run" in line]
    assert said in shown.splitlines(), (said, shown)
    assert "from the run's start to the end of its last fit" in said
    assert f"teardown (the script's end, the processes' exit, jddp launch's end): {run.teardown_s:.2f} s" in shown
    assert (tmp_path / "log" / "goodput.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------------ unit tests


def ledger(**changes) -> dict[str, float]:
    values = dict.fromkeys(goodput.SLOTS, 0.0)
    values.update(attempt_start=100.0, fit_start=103.0, restore_s=1.0, compile_s=2.0, step_s=8.0, data_wait_s=2.0)
    values.update(checkpoint_s=1.5, eval_s=0.5, first_step=0, last_step=50, steps_run=50, last_update=120.0)
    values.update(previous_end=math.nan, **changes)
    return values


def test_a_stopped_attempt_redone_from_an_older_checkpoint():
    a = goodput.account(ledger(), 0, next_start=130.0, next_first_step=40, end=125.0)
    # 10 of 50 steps redone, at (8 + 2) / 50 s each, moved out of step and data wait in their proportions
    assert a["recomputed_steps"] == 10 and a["recomputed_s"] == pytest.approx(2.0)
    assert a["step_s"] == pytest.approx(8.0 - 1.6) and a["data_wait_s"] == pytest.approx(2.0 - 0.4)
    assert a["startup_s"] == 3.0 and a["lost_s"] == 5.0 and a["downtime_s"] == 5.0
    assert a["other_s"] == pytest.approx(120 - 103 - 15)
    assert sum(a[k] for k in goodput.PARTS) == pytest.approx(130.0 - 100.0)
    assert (a["start"], a["end"], a["finished"]) == (100.0, 125.0, 0.0)


def test_without_a_launcher_an_attempt_ends_at_its_last_step():
    a = goodput.account(ledger(), 0, next_start=130.0, next_first_step=50, end=math.nan)
    assert (a["end"], a["lost_s"], a["downtime_s"], a["recomputed_steps"]) == (120.0, 0.0, 10.0, 0)
    # an outside end before the last step (clocks of two hosts) is not believed either
    assert goodput.account(ledger(), 0, next_start=None, next_first_step=None, end=110.0)["end"] == 120.0


def test_a_finished_attempt_ends_at_its_end_and_loses_nothing():
    a = goodput.account(ledger(end=121.0, last_update=121.0), 2, next_start=None, next_first_step=None)
    assert (a["end"], a["lost_s"], a["downtime_s"], a["finished"], a["attempt"]) == (121.0, 0.0, 0.0, 1.0, 2.0)
    assert sum(a[k] for k in goodput.PARTS) == pytest.approx(21.0)


def test_the_total_telescopes_over_attempts():
    first = goodput.account(ledger(), 0, next_start=130.0, next_first_step=40, end=125.0)
    second = goodput.account(
        ledger(attempt_start=130.0, fit_start=131.0, last_update=150.0, end=150.0, first_step=40, last_step=90),
        1, next_start=None, next_first_step=None,
    )  # fmt: skip
    total = goodput.Total.of([second, first])
    assert total.wall_s == 50.0 and total.attempts == 2 and total.recomputed_steps == 10
    assert sum(total.parts.values()) == pytest.approx(50.0)
    assert total.goodput == pytest.approx(total.parts["step_s"] / 50.0)
    assert "goodput (step time / wall)" in total.table() and "over 2 attempt(s)" in total.line()


def test_the_ledger_file_keeps_what_was_written_and_each_attempt_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("JDDP_ATTEMPT_START", "1000.5")
    monkeypatch.setenv("JDDP_PREVIOUS_END", "999.0")
    monkeypatch.setattr(goodput_ledger, "_last_fit_end", None)
    first = goodput.Ledger(tmp_path, 0)
    first.start_at(8)
    first.update(12, 4, {"step_s": 1.25, "eval_s": 0.5})
    on_disk = goodput.read(first.path)  # what a SIGKILL now would leave: the memory map is the file
    assert (on_disk["first_step"], on_disk["last_step"], on_disk["steps_run"]) == (8, 12, 4)
    assert (on_disk["step_s"], on_disk["eval_s"], on_disk["attempt_start"], on_disk["previous_end"]) == (
        1.25, 0.5, 1000.5, 999.0,
    )  # fmt: skip
    ended = time.time() + 5  # the launcher saw the group of the first attempt stopped then
    monkeypatch.setenv("JDDP_PREVIOUS_END", f"{ended:.6f}")
    monkeypatch.setenv("JDDP_ATTEMPT_START", f"{ended + 1:.6f}")  # the launcher started the next group then
    with monkeypatch.context() as later:
        later.setattr(time, "time", lambda: ended + 2)  # the next attempt's fit starts after its start
        second = goodput.Ledger(tmp_path, 0)
    second.start_at(10)
    assert (first.index, second.index) == (0, 1)
    ((path, account),) = second.open_accounts()
    assert path == first.path and account["recomputed_steps"] == 2
    assert account["end"] == pytest.approx(ended) and account["lost_s"] == pytest.approx(ended - on_disk["last_update"])
    goodput.close(path)
    assert second.open_accounts() == []
    # a second fit in the same process starts where the first one ended, not at the process start
    second.finish(10, 0, {})
    assert goodput.Ledger(tmp_path, 0).path.name == "attempt-0002.ledger"
    assert goodput.read(tmp_path / "attempt-0002.ledger")["attempt_start"] == second["end"]


def test_cutting_the_log_back_on_resume_keeps_the_goodput_records(tmp_path):
    path = tmp_path / logs.METRICS_FILE
    rows = [
        {"step": 5, "split": "train"},
        {"step": 20, "split": "train"},
        {"step": 20, "split": "goodput", "attempt": 0},
        {"step": 30, "split": "goodput_total"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = logs.keep_until(path, 10)
    assert kept == [rows[0], rows[2], rows[3]] == logs.read_metrics(path)


def test_goodput_cli_says_what_is_missing(tmp_path, capsys):
    assert goodput.main([str(tmp_path)]) == 2
    assert "no goodput records or ledgers in" in capsys.readouterr().out


# ------------------------------------------------------------------------------- parts never past 100%, generated


@st.composite
def attempts(draw) -> list[dict[str, float]]:
    """The ledgers of one run's attempts as they can arrive: restarts after kills (a later attempt restoring an
    older step, so steps are recomputed), finished attempts, launcher ends before or after the last step, spans
    that overlap the next attempt's (clocks of two hosts, a group still stopping), a second fit starting before the
    first's end, timers that add up to more than the wall time, a teardown mark on any attempt."""
    t = st.floats(0.0, 50.0, allow_nan=False)
    out, clock, step = [], 1000.0, 0
    for _ in range(draw(st.integers(1, 5))):
        start = clock + draw(st.floats(-20.0, 20.0))  # may start before the previous attempt ended
        fit_start = start + draw(st.floats(-2.0, 10.0))
        steps_run = draw(st.integers(0, 40))
        first = max(0, step - draw(st.integers(0, 30)))  # restored an older checkpoint: steps recomputed
        last_update = fit_start + draw(t)
        finished = draw(st.booleans())
        values: dict[str, float] = dict.fromkeys(goodput.SLOTS, 0.0)
        values.update({k: draw(t) for k in goodput.TIMERS})
        values.update(
            attempt_start=start, fit_start=fit_start, first_step=first, last_step=first + steps_run,
            steps_run=steps_run, last_update=last_update, end=last_update if finished else 0.0,
            previous_end=draw(st.one_of(st.just(math.nan), st.floats(start - 30.0, start + 5.0))),
            teardown_end=draw(st.one_of(st.just(0.0), st.floats(last_update - 5.0, last_update + 30.0))),
        )  # fmt: skip
        out.append(values)
        clock, step = last_update + draw(t), first + steps_run
    return out


@settings(max_examples=400, deadline=None)
@given(attempts())
def test_the_parts_of_a_run_sum_to_its_span_never_past_it(ledgers):
    accounts = goodput.accounts(ledgers)
    for a in accounts:
        assert all(a[k] >= 0 for k in (*goodput.PARTS, goodput.TEARDOWN)), a
        assert a["end"] >= a["start"]
        assert sum(a[k] for k in goodput.PARTS) == pytest.approx(a["end"] - a["start"] + a["downtime_s"], abs=1e-5)
        assert a["recomputed_steps"] <= a["steps"]
    for a, following in itertools.pairwise(accounts):  # no instant counted in two attempts
        assert a["end"] + a["downtime_s"] == pytest.approx(following["start"], abs=1e-6)
    total = goodput.Total.of(accounts)
    assert sum(total.parts.values()) <= total.wall_s + 1e-9  # never past 100%, rounded down to the microsecond
    assert sum(total.parts.values()) == pytest.approx(total.wall_s, abs=1e-4)  # and short of it by rounding only
    assert 0 <= total.goodput <= 1 + 1e-9
    assert total.wall_s == pytest.approx(accounts[-1]["end"] - accounts[0]["start"])


def test_a_teardown_before_the_next_attempt_is_its_downtime_not_both():
    """The overlap that made two runs in one folder sum to 107%: the first launcher's end written into the first
    ledger, before the next attempt started."""
    first = ledger(end=120.0, last_update=120.0, teardown_end=126.0)
    second = ledger(attempt_start=130.0, fit_start=131.0, last_update=150.0, end=150.0, first_step=0, last_step=50)
    a, b = goodput.accounts([first, second])
    assert (a["teardown_s"], a["downtime_s"]) == (0.0, 10.0)
    assert sum(goodput.Total.of([a, b]).parts.values()) == pytest.approx(50.0)


# --------------------------------------------------------------------------------------------- runs in a folder


def fit_once(log_dir, steps: int, checkpoint=None, **options):
    import jddp
    from tests.test_loop import make

    dp, state, train, test = make()
    ckpt = jddp.Checkpointer(checkpoint, save_every=3) if checkpoint is not None else None
    return jddp.fit(
        dp, state, train, steps=steps, eval_loader=test, log_dir=log_dir, log_every=3, progress=False,
        checkpointer=ckpt, **options,
    )  # fmt: skip


def run_of(records: list[dict]) -> list[str]:
    return [r["run"] for r in records]


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_second_fit_into_the_same_folder_is_a_new_run_with_its_own_account(tmp_path, capsys):
    fit_once(tmp_path, 6)
    after_first = logs.read_metrics(tmp_path / logs.METRICS_FILE)
    fit_once(tmp_path, 6)
    out = capsys.readouterr().out
    records = logs.read_metrics(tmp_path / logs.METRICS_FILE)
    first, second = goodput.runs(tmp_path)
    assert records[: len(after_first)] == after_first  # the first run's records stay as they were
    assert run_of(records) == [first] * len(after_first) + [second] * (len(records) - len(after_first))
    accounts = [r for r in records if r["split"] == "goodput"]
    assert [(a["run"], a["attempt"], a["recomputed_steps"], a["first_step"]) for a in accounts] == [
        (first, 0, 0, 0), (second, 0, 0, 0),
    ]  # fmt: skip
    totals = {r["run"]: r for r in records if r["split"] == "goodput_total"}
    for run in (first, second):
        assert totals[run]["attempts"] == 1 and totals[run]["recomputed_steps"] == 0
        # each part floored to 6 decimals, the wall rounded: short by under 1e-6 a part, and half that for the wall
        short = totals[run]["wall_s"] - sum(totals[run][k] for k in goodput.PARTS)
        assert -0.5e-6 <= short <= (len(goodput.PARTS) + 0.5) * 1e-6
    assert f"fit: run {first} (new)" in out and f"fit: run {second} (new)" in out
    # each run's TensorBoard events in a folder of their own; `jddp goodput` shows the newest, or the one named
    assert sorted(p.name for p in (tmp_path / logs.TENSORBOARD_DIR).iterdir()) == sorted([first, second])
    assert goodput.main([str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert f"showing {second}" in shown and f"goodput of run {second}: " in shown and "attempts 1," in shown
    assert goodput.main([str(tmp_path), "--run", first]) == 0 and f"goodput of run {first}: " in capsys.readouterr().out
    assert goodput.main([str(tmp_path), "--run", "nope"]) == 2 and first in capsys.readouterr().out


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_resumed_checkpoint_continues_its_run_and_a_finished_one_starts_a_new_run(tmp_path, capsys):
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    fit_once(log, 6, ckpt)
    fit_once(log, 9, ckpt)  # resumes step 6 of 9: the same run, its second attempt
    fit_once(log, 9, ckpt)  # restores step 9 of 9: the run is finished, this is a new one
    out = capsys.readouterr().out
    first, second = goodput.runs(log)
    assert f"fit: run {first} (resumed from its checkpoint)" in out and f"fit: run {second} (new)" in out
    accounts = [r for r in logs.read_metrics(log / logs.METRICS_FILE) if r["split"] == "goodput"]
    assert [(a["run"], a["attempt"], a["first_step"], a["last_step"]) for a in accounts] == [
        (first, 0, 0, 6), (first, 1, 6, 9), (second, 0, 9, 9),
    ]  # fmt: skip
    trained = [r["step"] for r in logs.read_metrics(log / logs.METRICS_FILE) if r["split"] == "train"]
    assert trained == [3, 6, 9]  # the new run took no step, and cut none of the old run's records


def test_other_runs_refuse_leaves_the_folder_as_it_was(tmp_path):
    fit_once(tmp_path, 3)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"holds the logs of another run .*other_runs='apart'"):
        fit_once(tmp_path, 3, other_runs="refuse")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match=r"`other_runs` must be one of 'apart', 'refuse', got other_runs='mix'"):
        fit_once(tmp_path, 3, other_runs="mix")
