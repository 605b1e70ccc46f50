"""Worker for tests/test_spares.py: ``jddp launch -n 2 --max-restarts 1 tests/workers/spare_restart.py``.

Each process prints ``ATTEMPT a PROCESS p SPARE s SNAPSHOT dir KEPT k``: whether it runs in a spare
(``python -m jddp.cli.spare``, or forked by ``python -m jddp.cli.zygote``: its command line), the snapshot directory
it got and whether the mark that process 0 wrote there on the first attempt is still in it. On attempt 0, once the
launcher's two spares exist, process 0 SIGKILLs one of them (the restart starts that process anew, and hands the
other its role) and process 1 SIGKILLs itself. Attempt 1 prints DONE.
"""

import os
import signal
import time

import jddp

jddp.initialize()

import jax  # noqa: E402

me, attempt = jax.process_index(), int(os.environ["JDDP_RESTART_COUNT"])
snapshot_dir = os.environ["JDDP_SNAPSHOT_DIR"]
# a spare started as a process of its own, or one forked by the zygote (jddp.cli.zygote: its command line)
SPARE_COMMANDS = (b"jddp.cli.spare", b"jddp.cli.zygote")
spare = any(c in open("/proc/self/cmdline", "rb").read().split(b"\0") for c in SPARE_COMMANDS)
mark = os.path.join(snapshot_dir, "mark")
print(f"ATTEMPT {attempt} PROCESS {me} SPARE {spare} SNAPSHOT {snapshot_dir} KEPT {os.path.exists(mark)}")


def children(pid: int | str) -> list[str]:
    try:
        return open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []


def spares() -> list[int]:
    """The launcher's spares, in start order: its processes started as spares, and the zygote's children."""
    launcher = os.getppid()
    found = []
    for child in children(launcher):
        try:
            command = open(f"/proc/{child}/cmdline", "rb").read()
        except OSError:
            continue
        candidates = [child] if b"jddp.cli.spare" in command else []
        if b"jddp.cli.zygote" in command:
            candidates = children(child)
        for pid in candidates:
            try:
                started = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
            except OSError:
                continue
            found.append((started, int(pid)))
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
