"""Worker: a training loop of its own (no jddp.fit, no Checkpointer) under ``jddp launch -n 2 --max-restarts 2``.

    python tests/workers/standby_steps.py DIR

Writes DIR/notes: ``READY attempt process pid`` before its first step, ``STEP attempt process pid step`` after each.
Attempt 1's process 1 raises before anything else the first time it runs (DIR/died absent): in the standby process
the launcher started for attempt 1 during attempt 0. Attempt 0's process 1 waits at step 5 until that happened,
then SIGKILLs itself. Attempt 1 waits at step 5 until both processes of attempt 2 (standby processes, never woken:
attempt 1 finishes) said READY, then one second more, and trains to step 30.
"""

import os
import signal
import sys
import time

import jddp

out = sys.argv[1]
attempt = int(os.environ["JDDP_RESTART_COUNT"])
died = os.path.join(out, "died")
if attempt == 1 and os.environ["JDDP_PROCESS_ID"] == "1" and not os.path.exists(died):
    open(died, "w").close()
    raise RuntimeError("STANDBY DIES")

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

rank = jax.process_index()


def note(text: str) -> None:
    with open(os.path.join(out, "notes"), "a") as f:
        f.write(text + "\n")


def wait_for(ready) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        if time.monotonic() > deadline:
            raise SystemExit("waited 120 s")
        time.sleep(0.05)


def loss_fn(params, model_state, batch, key):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2), (model_state, {})


dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
state = dp.init({"w": np.zeros((4, 1), np.float32)})
rng = np.random.default_rng(0)
source = {"x": rng.normal(size=(240, 4)).astype(np.float32), "y": rng.normal(size=(240, 1)).astype(np.float32)}
note(f"READY {attempt} {rank} {os.getpid()}")
for step, batch in enumerate(jddp.data.DataLoader(source, global_batch_size=8, seed=0)):  # 30 steps
    state, _ = dp.step(state, batch)
    note(f"STEP {attempt} {rank} {os.getpid()} {step}")
    if attempt == 0 and rank == 1 and step == 5:
        wait_for(lambda: os.path.exists(died))
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 1 and step == 5:
        wait_for(lambda: all(f"READY 2 {p} " in open(os.path.join(out, "notes")).read() for p in (0, 1)))
        time.sleep(1)
jax.block_until_ready(state)
