"""Worker for tests/test_runtime.py's host collective tests: ``python tests/workers/host_collectives.py``.

Each process makes the same calls with values that depend on its index and prints one JSON line per call,
``RESULT {"name": ..., "value": ...}`` (or the error's type and message), for the test to compare with NumPy.
The last call is a timeout: the last process does not make it.
"""

import json
import sys

import jddp

group = jddp.initialize()

import numpy as np  # noqa: E402

me, n = group.process_id, group.num_processes


def say(name, call):
    try:
        value = call()
        if isinstance(value, np.ndarray):
            value = {"array": value.tolist(), "dtype": str(value.dtype)}
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [len(v) for v in value]
        print("RESULT " + json.dumps({"name": name, "value": value, "type": type(value).__name__}), flush=True)
    except Exception as error:
        print("RESULT " + json.dumps({"name": name, "error": type(error).__name__, "message": str(error)}), flush=True)


rng = np.random.default_rng(me)
values = rng.normal(size=(3, 2)).astype(np.float32)
say("gather", lambda: jddp.host_all_gather({"process": me, "items": list(range(me))}))
say("sum_int", lambda: jddp.host_all_reduce(me + 1))
for op in ("sum", "mean", "max", "min"):
    say(f"{op}_array", lambda op=op: jddp.host_all_reduce(values, op=op))
say("mean_int", lambda: jddp.host_all_reduce(np.int32(me), op="mean"))
say("flag", lambda: jddp.host_all_reduce(me == n - 1, op="max"))
say("broadcast", lambda: jddp.host_broadcast({"vocab": ["a", "b", me]} if me == 0 else None))
say("big", lambda: jddp.host_all_gather(bytes(8 << 20)))  # 8 MiB from each process
say("too_big", lambda: jddp.host_all_gather(bytes(jddp.runtime.host.MAX_BYTES + 1) if me == 1 else b""))
say("unpicklable", lambda: jddp.host_all_gather((lambda: None) if me == n - 1 else 0))
say("shapes", lambda: jddp.host_all_reduce(np.zeros(me + 1)))
say("mismatch", lambda: jddp.host_broadcast(me) if me == 1 else jddp.host_all_gather(me))
say("after", lambda: jddp.host_all_reduce(1))
if me != n - 1:
    say("timeout", lambda: jddp.host_all_gather(me, timeout_s=3))
sys.stdout.flush()
