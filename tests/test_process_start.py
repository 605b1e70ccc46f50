"""Where a single process's goodput span starts (jddp.process_start): the process's own start, not fit's import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jddp import goodput_ledger, process_start
from tests import multiprocess


@given(
    comm=st.text(alphabet=st.characters(blacklist_characters="\x00\n"), max_size=15),
    start=st.integers(0, 2**63),
    before=st.lists(st.integers(-(2**31), 2**31), min_size=19, max_size=19),
    after=st.lists(st.integers(0, 2**40), min_size=0, max_size=30),
)
def test_the_start_is_field_22_whatever_the_command_name_holds(comm, start, before, after):
    """The kernel's format: pid, (comm), then fields 3.. ; comm may hold spaces and parentheses."""
    fields = ["R", *map(str, before[1:19]), str(start), *map(str, after)]
    line = f"{before[0]} ({comm}) " + " ".join(fields) + "\n"
    assert process_start.stat_start_ticks(line) == start


@pytest.mark.parametrize("line", ["", "123 (python) R 1 2", "no parenthesis " + " 0" * 30, "1 (x) " + "a " * 25])
def test_a_line_without_a_start_time_is_refused_naming_it(line):
    with pytest.raises(ValueError, match=r"`stat` is not a /proc/<pid>/stat line .* stat="):
        process_start.stat_start_ticks(line)


def test_this_process_started_when_the_system_says_and_before_jddp_was_imported():
    """Against psutil's create_time (/proc/stat's btime: whole seconds, so within about a second)."""
    started = process_start.started()
    assert started <= process_start.IMPORTED_AT <= time.time()
    assert abs(started - psutil.Process().create_time()) < 1.5, (started, psutil.Process().create_time())
    assert goodput_ledger._PROCESS_START <= process_start.IMPORTED_AT


def test_an_interactive_session_starts_when_jddp_was_imported(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert process_start.interactive() and process_start.started() == process_start.IMPORTED_AT


# A fresh interpreter that waits before it imports jddp (as a script waits for JAX's import, its data, its model),
# then runs a fit of two steps with a log_dir: the wait is in the attempt's startup_s.
DELAYED = """
import time, sys
time.sleep({delay})
import jax, numpy as np, optax
import jddp
mesh = jddp.data_mesh(jax.devices()[:1])
loss = lambda p, s, b, k: (jddp.masked_mean(((b["x"] @ p["w"]) - b["y"]) ** 2, b.get("mask")), (s, {{}}))
dp = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh)
state = dp.init({{"w": np.zeros((4,), np.float32)}})
data = {{"x": np.ones((8, 4), np.float32), "y": np.ones((8,), np.float32)}}
loader = jddp.data.DataLoader(data, global_batch_size=4, seed=0, mesh=mesh)
jddp.fit(dp, state, loader, steps=2, log_dir=sys.argv[1], progress=False)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_delay_before_import_and_fit_is_in_the_startup_time(tmp_path):
    delay = 2.0
    env = multiprocess.environment()
    for name in ("JDDP_ATTEMPT_START", "JDDP_RUN_START", "JDDP_PREVIOUS_END", "JDDP_RESTART_COUNT"):
        env.pop(name, None)
    script = textwrap.dedent(DELAYED.format(delay=delay))
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (account,) = [r for r in records if r.get("split") == "goodput"]
    assert account["startup_s"] >= delay, account
    # the span starts with the interpreter the test spawned (the kernel's ticks are 10 ms), not with its first line
    assert spawned - 0.05 <= account["start"] <= spawned + account["startup_s"] - delay, (spawned, account)
