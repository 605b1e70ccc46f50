"""Worker for tests/test_spares.py: ``jddp launch -n 2 --max-restarts 1 tests/workers/slow_standby.py DIR``.

A standby process (attempt 1's, started during attempt 0) writes DIR/preparing-<process> once it joined its group,
then takes ``PREPARE_S`` seconds (a long compilation) before it stands by. Attempt 0's process 1 SIGKILLs itself
once both of attempt 1's standby processes are preparing: the failure comes while they do not stand by yet.
Every process prints ``RUNNING attempt A process P woken W`` once it runs its role (W: it stood by first).
"""

import os
import signal
import sys
import time

import jddp
from jddp.runtime import standby

out = sys.argv[1]
attempt = int(os.environ["JDDP_RESTART_COUNT"])
process = int(os.environ["JDDP_PROCESS_ID"])
woken = standby.active()
jddp.initialize()
if woken:
    open(os.path.join(out, f"preparing-{process}"), "w").close()
    time.sleep(float(os.environ.get("PREPARE_S", "6")))
    standby.wait()
print(f"RUNNING attempt {attempt} process {process} woken {woken}", flush=True)
if attempt == 0:
    if process == 1:
        while not all(os.path.exists(os.path.join(out, f"preparing-{p}")) for p in (0, 1)):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)  # stopped by the launcher for the restart
