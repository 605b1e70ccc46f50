"""Worker for tests/test_spares.py: ``jddp launch -n 2 --max-restarts 1 tests/workers/spare_restart.py``.

Each process prints ``ATTEMPT a PROCESS p SPARE s SNAPSHOT dir KEPT k``: whether it runs in a spare
(``python -m jddp.cli.spare``, its command line), the snapshot directory it got and whether the mark that process 0
wrote there on the first attempt is still in it. On attempt 0, once the launcher's two spares exist, process 0
SIGKILLs one of them (the restart starts that process anew, and hands the other its role) and process 1 SIGKILLs
itself. Attempt 1 prints DONE.
"""

import os
import signal
import time

import jddp

jddp.initialize()

import jax  # noqa: E402

me, attempt = jax.process_index(), int(os.environ["JDDP_RESTART_COUNT"])
snapshot_dir = os.environ["JDDP_SNAPSHOT_DIR"]
spare = b"jddp.cli.spare" in open("/proc/self/cmdline", "rb").read().split(b"\0")
mark = os.path.join(snapshot_dir, "mark")
print(f"ATTEMPT {attempt} PROCESS {me} SPARE {spare} SNAPSHOT {snapshot_dir} KEPT {os.path.exists(mark)}")


def spares() -> list[int]:
    """The launcher's processes started as spares, in start order."""
    launcher = os.getppid()
    found = []
    for pid in open(f"/proc/{launcher}/task/{launcher}/children").read().split():
        try:
            if b"jddp.cli.spare" in open(f"/proc/{pid}/cmdline", "rb").read():
                started = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
                found.append((started, int(pid)))
        except OSError:
            continue
    return [pid for _, pid in sorted(found)]


if attempt == 0:
    if me == 0:
        with open(mark, "w") as f:
            f.write("written on attempt 0")
    deadline = time.monotonic() + 60
    while len(spares()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    if me == 0:
        os.kill(spares()[-1], signal.SIGKILL)
        print("KILLED A SPARE")
    if me == 1:
        time.sleep(0.5)  # process 0 kills its spare first
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # stopped by the launcher for the restart
print(f"DONE {me}")
