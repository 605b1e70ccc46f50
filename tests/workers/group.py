"""Worker for the runtime and launcher tests: ``python tests/workers/group.py MODE [args]``.

Modes:
  hello          gather the process indices, print them; exit with $EXIT_CODE_<process id> (default 0)
  die V N K      gather in a loop of N iterations; process V SIGKILLs itself at iteration 3 while
                 $JDDP_RESTART_COUNT < K; prints DONE at the end
  sockets        print this process's TCP sockets (from /proc) as JSON after a collective
  barrier        process 1 skips the first barrier: process 0's must time out naming it
  diverge        init with a broadcast that does nothing: DataParallel.init must name process 1
  preempt        loop until every process agrees on a preemption step (SIGTERM), then exit 75
  end V HOW      train with DataParallel; at step 3 process V ends by HOW (exit3, exit0, return, os_exit,
                 raise, sigkill, sigstop, gil: a C loop that holds the GIL); prints ENDING <time> first
"""

import json
import os
import sys
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

me = jax.process_index()
mode, args = sys.argv[1], sys.argv[2:]


def gather(value):
    return np.asarray(multihost_utils.process_allgather(jnp.asarray(value))).tolist()


def tcp_sockets():
    """(state, local, remote) of every TCP socket this process holds, read from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    states = {"01": "ESTABLISHED", "0A": "LISTEN"}
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/self/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    found.append((states.get(cols[3], cols[3]), decode(cols[1]), decode(cols[2])))
    return found


def decode(hex_address):
    addr, port = hex_address.split(":")
    raw = bytes.fromhex(addr)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # /proc prints each 32-bit word little-endian
    raw = b"".join(words)
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    host = ".".join(map(str, raw)) if len(raw) == 4 else ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{host}:{int(port, 16)}"


if mode == "hello":
    print(f"HELLO {me} {gather([me])}")
    sys.exit(int(os.environ.get(f"EXIT_CODE_{me}", "0")))
elif mode == "die":
    victim, iterations, attempts = map(int, args)
    restart = int(os.environ.get("JDDP_RESTART_COUNT", "0"))
    for i in range(iterations):
        gather([i])
        if i == 3 and me == victim and restart < attempts:
            print(f"KILLING {time.time()}", flush=True)
            os.kill(os.getpid(), 9)
        time.sleep(0.05)
    print(f"DONE {me} attempt {restart}")
elif mode == "end":
    import optax

    victim, how = int(args[0]), args[1]
    dp = jddp.DataParallel(
        lambda p, s, b, r: (jnp.mean((b["x"] @ p["w"]) ** 2), (s, {})), optax.sgd(0.01), mesh=jddp.data_mesh()
    )
    state = dp.init({"w": np.ones((4, 1), np.float32)})
    local = np.ones((2 * jax.local_device_count(), 4), np.float32)
    batch = {"x": jax.make_array_from_process_local_data(jddp.batch_sharding(dp.mesh), local)}
    for step in range(100000):
        state, metrics = dp.step(state, batch)
        float(metrics["loss"])  # waits for the step, as a loop that logs does
        if step == 3 and me == victim:
            print(f"ENDING {time.time()}", flush=True)
            if how == "exit3":
                sys.exit(3)
            if how in ("exit0", "return"):
                break  # falls off the end of the script: exit 0 while the others still train
            if how == "os_exit":
                os._exit(7)
            if how == "raise":
                raise RuntimeError("a check failed on one process")
            if how == "sigkill":
                os.kill(os.getpid(), 9)
            if how == "sigstop":
                os.kill(os.getpid(), 19)
            if how == "gil":
                sum(range(10**12))  # C code that never gives the GIL back
        time.sleep(0.01)
elif mode == "sockets":
    gather([me])
    print("SOCKETS " + json.dumps(tcp_sockets()))
    jddp.barrier("sockets-listed", 60)
elif mode == "barrier":
    # Process 1 never comes to "sync", so process 0's timeout fires however slow either process is.
    if me == 0:
        try:
            jddp.barrier("sync", timeout_s=2)
        except TimeoutError as error:
            print(f"TIMEOUT {error}")
    jddp.barrier("end", timeout_s=120)
elif mode == "diverge":
    import optax

    from jddp.engine import replicas

    replicas.broadcast_from_process_0 = lambda tree: tree  # as if init did not broadcast
    dp = jddp.DataParallel(
        lambda p, s, b, r: (jnp.mean(b["x"] * p["w"]), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh()
    )
    try:
        dp.init({"w": np.full((3,), float(me), np.float32), "b": np.zeros((2,), np.float32)})
    except AssertionError as error:
        print(f"DIVERGED {error}")
elif mode == "preempt":
    step = 0
    while not multihost_utils.reached_preemption_sync_point(step):
        gather([step])
        if step == 5:
            print("READY", flush=True)
        step += 1
        time.sleep(0.02)
    print(f"PREEMPTED {me} at step {step}", flush=True)
    sys.exit(jddp.EXIT_PREEMPTED)
else:
    raise SystemExit(f"unknown mode {mode!r}")
