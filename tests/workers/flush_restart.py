"""Worker for ``tests/test_launch_flush.py``: ``python tests/workers/flush_restart.py DIR HOW``.

Each process opens ``DIR/metrics-<process>-<attempt>.jsonl`` with a buffer far larger than its line, registers it
with ``jddp.runtime.flush.register_flush`` and writes its epoch's line into the buffer (nothing on disk yet). Then, in
the first attempt, process 1 exits 3 (``os._exit``: the restart's cause) while process 0 waits for ever:

* ``native``: its main thread in C (libc's ``sleep``, the GIL released, the flush signal blocked in that thread): a
  collective waiting for a peer that is gone, where no Python signal handler can run;
* ``python``: in a Python loop, where the handler runs between bytecodes;
* ``ignored``: in a Python loop with the flush signal ignored (a script that took it over): the launcher's SIGKILL
  after ``--flush-grace`` ends it.

In the second attempt both processes write their line, meet at a barrier and exit 0.
"""

import ctypes
import json
import os
import signal
import sys
import time

import jddp

jddp.initialize()

from jddp.runtime import flush  # noqa: E402

folder, how = sys.argv[1], sys.argv[2]
me, attempt = jddp.process_index(), int(os.environ["JDDP_RESTART_COUNT"])
metrics = open(os.path.join(folder, f"metrics-{me}-{attempt}.jsonl"), "a", buffering=1 << 20)
flush.register_flush(metrics)
metrics.write(json.dumps({"process": me, "attempt": attempt, "epoch": 0, "loss": 0.5}) + "\n")
jddp.barrier("epoch")
if attempt > 0:
    metrics.close()
    print(f"FINISHED {me}", flush=True)
    sys.exit(0)
if me == 1:
    time.sleep(2)
    os._exit(3)
print(f"WAITING {me} {how}", flush=True)
if how == "native":
    signal.pthread_sigmask(signal.SIG_BLOCK, {flush.FLUSH_SIGNAL})
    ctypes.CDLL(None).sleep(600)
elif how == "ignored":
    signal.signal(flush.FLUSH_SIGNAL, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)
while True:
    time.sleep(0.01)
