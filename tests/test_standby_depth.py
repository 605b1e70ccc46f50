"""The launcher's standby generations without processes: how deep they go (``--standby-depth``), the flags' checks,
and the spares' priority while they prepare (``jddp.cli.launch.spares``: the autogroup nice value, retried under the
host's rate limit)."""

from __future__ import annotations

import itertools

import pytest

from jddp.cli import launch as launch_lib
from jddp.cli.launch import snapshots
from jddp.cli.launch import spares as spares_lib
from jddp.cli.output import Output


def pool(**options) -> spares_lib.SparePool:
    config = launch_lib.LaunchConfig(target="train", module=True, nprocs=2, **options)
    return spares_lib.SparePool(config, Output(), snapshots.SnapshotDir(), lambda rank, coordinator, attempt: {})


CASES = list(itertools.product((0, 1, 2, 5), (1, 2, 3), (True, False), (None, "127.0.0.1:29500")))


@pytest.mark.parametrize(("max_restarts", "depth", "standby", "coordinator"), CASES, ids=str)
def test_generations_are_kept_as_deep_as_asked_never_past_the_last_attempt_and_one_without_standby(
    max_restarts, depth, standby, coordinator
):
    p = pool(max_restarts=max_restarts, standby_depth=depth, standby=standby, coordinator=coordinator)
    possible = standby and coordinator is None  # one node, the launcher's own coordinator
    assert p.standby_possible() == possible
    for attempt in range(max_restarts + 1):
        left = max_restarts - attempt  # restarts that can still follow
        assert p.depth(attempt) == min(depth if possible else 1, left)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"standby_depth": 0}, r"--standby-depth must be at least 1, got 0 \(no standby at all: --no-standby\)"),
        ({"standby_nice": 20}, r"--standby-nice must be a nice value from 0 to 19, got 20"),
        ({"standby_nice": -1}, r"--standby-nice must be a nice value from 0 to 19, got -1"),
    ],
    ids=["depth 0", "nice 20", "nice -1"],
)
def test_bad_standby_flags_are_refused_naming_the_flag_and_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        launch_lib.LaunchConfig(target="train", module=True, **options)


def test_the_flags_reach_the_config_and_default_to_depth_2_and_no_lowered_priority():
    parser = launch_lib.get_args_parser()
    config = launch_lib.config_from_args(parser.parse_args(["--standby-depth", "3", "--standby-nice", "7", "-m", "x"]))
    assert (config.standby_depth, config.standby_nice) == (3, 7)
    config = launch_lib.config_from_args(parser.parse_args(["-m", "x"]))
    assert (config.standby_depth, config.standby_nice) == (2, 0)


def test_a_priority_the_rate_limit_refused_is_written_at_the_next_poll_and_an_impossible_one_dropped(monkeypatch):
    """EAGAIN (an unprivileged writer within 100 ms of the host's last autogroup write): kept, written by a later
    poll; any other error (no autogroups here, the process gone): dropped, never retried."""
    written: list[tuple[str, str]] = []
    refuse = {"eagain": 1}

    class Autogroup:
        def __init__(self, path: str, mode: str) -> None:
            self.path = path
            if "404" in path:
                raise FileNotFoundError(path)
            if refuse["eagain"]:
                refuse["eagain"] -= 1
                raise BlockingIOError(11, "write could not complete without blocking")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def write(self, text: str) -> None:
            written.append((self.path, text))

    monkeypatch.setattr(spares_lib, "open", Autogroup, raising=False)
    p = pool(standby_nice=19)
    p.set_nice(101, 19)  # refused once
    assert p.renice == {101: 19} and written == []
    p.set_nice(404, 19)  # gone: dropped
    assert p.renice == {101: 19}
    p.retry_renice()
    assert p.renice == {} and written == [("/proc/101/autogroup", "19")]
    refuse["eagain"] = 1
    p.set_nice(101, 0)
    p.set_nice(101, 19)  # the newer value replaces the one still pending
    p.retry_renice()
    assert p.renice == {} and written[-1] == ("/proc/101/autogroup", "19")


@pytest.mark.parametrize(
    ("woken", "covered", "first_step", "early", "prepared"),
    [c for c in itertools.product((True, False), repeat=5) if c[4] or not c[1]],  # covered: one is prepared
    ids=lambda v: str(v),
)
def test_the_next_generation_starts_at_once_after_a_wake_unless_the_next_attempt_stands_by_already(
    monkeypatch, woken, covered, first_step, early, prepared
):
    """``Launcher.prepare_restart``: an attempt woken from standby prepares at once when the next attempt has no
    standby (a second failure right after the restart needs one); any attempt with no generation behind it at all
    starts one at once too, its spares lowered (``early``: the attempt's own start-up has the CPUs first, the spares
    their idle moments); and every attempt prepares at full priority once its first step is taken or
    ``PREPARE_AFTER_S`` passed, lifting the lowered spares."""
    from jddp.cli.launch import supervisor, workers

    launcher = supervisor.Launcher(launch_lib.LaunchConfig(target="train", module=True, nprocs=2, max_restarts=3))
    try:
        called: list[tuple[int, bool]] = []
        lifted: list[bool] = []
        monkeypatch.setattr(launcher.spares, "prepare", lambda a, early=False: called.append((a, early)))
        monkeypatch.setattr(launcher.spares, "lift_early", lambda: lifted.append(True))
        monkeypatch.setattr(launcher.spares, "next_standing_by", lambda: covered)
        monkeypatch.setattr(launcher, "first_step_taken", lambda: first_step)
        launcher.spares.generations = [object()] if prepared else []  # type: ignore[list-item]
        launcher.attempt, launcher.attempt_start = 1, supervisor.time.time() - (0 if early else 10)
        how = "woken" if woken else "handed"
        launcher.group.workers = [workers.Worker(p, None, from_spare=how) for p in range(2)]  # type: ignore[arg-type]
        launcher.prepare_restart()
        started_up = first_step or not early
        if started_up or (woken and not covered):
            assert called == [(1, False)]
        elif not prepared:
            assert called == [(1, True)]
        else:
            assert called == []
        assert lifted == ([True] if started_up else [])
    finally:
        launcher.spares.generations = []
        launcher.notes.remove()


def test_early_spares_are_lowered_until_lifted_or_taken(monkeypatch):
    """``SparePool.start(early=True)``: the spare's autogroup at ``EARLY_NICE``; taken for a role (``restore``) it is
    back at 0, and ``lift_early`` puts the others at ``--standby-nice`` (0 by default)."""
    from jddp.cli.launch import workers

    written: list[tuple[int, int]] = []
    monkeypatch.setattr(spares_lib, "set_autogroup_nice", lambda pid, nice: written.append((pid, nice)) or True)
    pids = iter(range(500, 600))

    class Popen:
        def __init__(self) -> None:
            self.pid = next(pids)

    monkeypatch.setattr(workers, "spawn", lambda *a, **k: (Popen(), [], 3))
    for standby_nice in (0, 7):
        written.clear()
        p = pool(standby_nice=standby_nice)
        a, b, c = p.start(0, early=True), p.start(1, early=True), p.start(2)
        assert written == [(a.popen.pid, spares_lib.EARLY_NICE), (b.popen.pid, spares_lib.EARLY_NICE)] + (
            [(c.popen.pid, standby_nice)] if standby_nice else []
        )
        written.clear()
        p.restore(a)  # handed a role: it trains next
        assert written == [(a.popen.pid, 0)]
        p.lift_early()
        p.lift_early()  # once
        for spare in (a, b, c):
            spare.channel.close()
        assert written == [(a.popen.pid, 0), (b.popen.pid, standby_nice)]


class _Running:
    """A process (or service) that still runs, as ``Popen.poll`` says."""

    def poll(self):
        return None


class _Preparing:
    """A standby process that runs and has not stood by."""

    popen = _Running()

    def standing_by(self) -> bool:
        return False


@pytest.mark.parametrize("prepared_s", [0.0, 29.7, 31.0, 120.0])
def test_a_failure_waits_for_a_preparing_generation_only_until_30_s_after_its_roles_and_only_once_in_vain(prepared_s):
    """A generation still preparing is waited for up to ``STANDBY_WAIT_S`` counted from its roles' handing: one that
    prepared longer stands by nowhere (a script that never reaches ``standby.wait``) and is not waited for; once
    one was waited for in vain, no later generation of the run is."""
    import time
    import types

    p = pool(max_restarts=3)
    service = types.SimpleNamespace(popen=_Running())

    def generation(prepared: float) -> spares_lib.Generation:
        g = spares_lib.Generation(1, service, {0: _Preparing(), 1: _Preparing()})  # pyright: ignore[reportArgumentType]
        g.handed, g.handed_at = True, time.monotonic() - prepared
        return g

    left = spares_lib.STANDBY_WAIT_S - prepared_s
    waited = time.monotonic()
    if left < 1:
        p.await_standing_by(generation(prepared_s), lambda: False)
        assert time.monotonic() - waited < max(left, 0) + 10  # what was left of the 30 s, not 30 s more
        assert p.stands_by_nowhere == (left > 0)  # waited in vain: the run's script stands by nowhere
    else:  # a fresh generation is waited for; stopped at once here by ``stop``
        p.await_standing_by(generation(prepared_s), lambda: True)
        assert not p.stands_by_nowhere
    if p.stands_by_nowhere:
        waited = time.monotonic()
        p.await_standing_by(generation(0.0), lambda: False)  # a fresh one, after a wait in vain: not waited for
        assert time.monotonic() - waited < 10  # not the 30 s


def test_spares_wait_for_the_zygote_it_starts_when_the_first_generation_is_wanted(monkeypatch):
    """``SparePool.prepare``: no zygote runs before a generation is wanted (the first attempt's start-up has the
    CPUs to itself); the first ``prepare`` starts one, and while it imports (``Zygote.pending``) no spare is
    started as a process of its own (it will fork them, imported, in a moment); once it is ready they are."""
    from jddp.cli.launch import zygote

    opened: list[dict] = []
    ready = {"now": False}

    class Importing:
        def start(self, env) -> None:
            opened.append(env)

        def pending(self) -> bool:
            return not ready["now"]

    monkeypatch.setattr(zygote, "Zygote", Importing)
    p = pool(max_restarts=2, standby=False)
    started: list[int] = []
    monkeypatch.setattr(p, "start", lambda rank, early=False: started.append(rank))
    monkeypatch.setattr(p.services, "spawn_local", lambda: None)
    assert p.zygote is None
    p.prepare(0)
    p.prepare(0)
    assert len(opened) == 1 and started == [] and p.generations == []
    ready["now"] = True
    p.prepare(0)
    assert started == [0, 1] and len(p.generations) == 1 and len(opened) == 1
