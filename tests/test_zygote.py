"""The zygote (``jddp.cli.zygote``, ``jddp.cli.launch.zygote``): spares forked from one imported process behave as
spares started as processes of their own, as the launcher sees them (exit codes, signals, sessions, output) and as
the script sees itself (imported already, its own random state, its cores, its role's environment and argv)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from jddp.cli import output
from jddp.cli import spare as spare_lib
from jddp.cli.launch import zygote
from tests import multiprocess

pytestmark = pytest.mark.multiprocess

SCRIPT = """\
import json, os, sys
imported = "jax" in sys.modules and "flax.nnx" in sys.modules  # before this script imports anything heavy
import numpy as np
record = {
    "imported": imported,
    "session": os.getsid(0) == os.getpid(),
    "random": float(np.random.random()),
    "cores": sorted(os.sched_getaffinity(0)),
    "argv": sys.argv[1:],
    "role": os.environ.get("ROLE"),
    "name": __name__,
}
with open(sys.argv[1], "w") as f:
    json.dump(record, f)
print("said on stdout", flush=True)
if sys.argv[2] == "wait":
    import time
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def z():
    zyg = zygote.Zygote()
    zyg.start(multiprocess.environment())
    deadline = time.monotonic() + 120
    while not zyg.ready():
        assert zyg.pending() and time.monotonic() < deadline, "the zygote never finished its imports"
        time.sleep(0.05)
    yield zyg
    zyg.close()


def forked(z: zygote.Zygote, tmp_path: Path, name: str, how: str, cores=None, lines=None):
    """A spare forked from ``z`` and handed the role of SCRIPT writing ``name``.json then exiting ``how``."""
    out = output.Output()
    if lines is not None:

        def pump(pipe, target, prefix, native=False) -> None:  # as Output.pump: read to the end, then close
            with pipe:
                lines.extend(pipe.read().decode().splitlines())

        out.pump = pump
    got = z.fork(out, cores, output.Prefix(b"[spare 0] "))
    assert got is not None, "the zygote did not fork"
    popen, readers, stdout_fd, channel = got
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**multiprocess.environment(), "ROLE": name, "JDDP_STDOUT_FD": str(stdout_fd)}
    message = spare_lib.role(env, module=False, target=str(script), args=[str(tmp_path / f"{name}.json"), how])
    spare = spare_lib.Spare(0, popen, channel, output.Prefix(b"[spare 0] "), readers, stdout_fd)
    assert spare.hand(message, 0)
    return popen, readers


def test_forked_spares_are_imported_reseeded_in_sessions_of_their_own_and_report_their_exit_codes(z, tmp_path):
    lines: list[str] = []
    a, readers = forked(z, tmp_path, "a", "3", lines=lines)
    b, _ = forked(z, tmp_path, "b", "0", cores=[sorted(os.sched_getaffinity(0))[0]])
    assert a.wait(60) == 3 and b.wait(60) == 0
    for reader in readers:
        reader.join(10)
    ra, rb = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert ra["imported"] and rb["imported"]  # its imports were done in the zygote
    assert ra["session"] and rb["session"]  # signalled as a session, as the launcher signals every process
    assert ra["random"] != rb["random"]  # NumPy's global state reseeded in each fork
    assert ra["argv"] == [str(tmp_path / "a.json"), "3"] and (ra["role"], ra["name"]) == ("a", "__main__")
    assert rb["cores"] == [sorted(os.sched_getaffinity(0))[0]]
    assert "said on stdout" in lines  # its output reaches the launcher's pipes


def test_a_forked_spare_killed_reports_the_signal_and_one_orphaned_by_its_zygote_counts_as_killed(tmp_path):
    zyg = zygote.Zygote()
    zyg.start(multiprocess.environment())
    try:
        deadline = time.monotonic() + 120
        while not zyg.ready():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        killed, _ = forked(zyg, tmp_path, "k", "wait")
        orphaned, _ = forked(zyg, tmp_path, "o", "wait")
        while not (tmp_path / "k.json").exists() or not (tmp_path / "o.json").exists():
            time.sleep(0.05)
        assert killed.poll() is None
        killed.send_signal(signal.SIGTERM)
        assert killed.wait(30) == -signal.SIGTERM
        assert zyg.popen is not None
        os.kill(zyg.popen.pid, signal.SIGKILL)  # its children's codes die with it
        zyg.popen.wait(30)
        os.killpg(orphaned.pid, signal.SIGKILL)
        assert orphaned.wait(30) == -signal.SIGKILL
    finally:
        zyg.close()


def test_a_zygote_whose_launcher_closes_its_socket_exits():
    zyg = zygote.Zygote()
    zyg.start(multiprocess.environment())
    deadline = time.monotonic() + 120
    while not zyg.ready():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert zyg.popen is not None
    popen = zyg.popen
    zyg.close()
    assert popen.wait(10) == 0
    assert not zyg.ready() and zyg.fork(output.Output(), None, output.Prefix(b"")) is None


def test_usable_only_where_a_forks_environment_is_every_process_s():
    from jddp.cli.launch import config

    base = {"target": "x", "module": True}
    assert zygote.usable(config.LaunchConfig(**base, nprocs=2))
    assert not zygote.usable(config.LaunchConfig(**base, nprocs=2, spares=False))
    assert not zygote.usable(config.LaunchConfig(**base, nprocs=2, cpu_share=True))
    assert zygote.usable(config.LaunchConfig(**base, nprocs=1, cpu_share=True))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
