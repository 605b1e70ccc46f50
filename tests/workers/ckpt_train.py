"""Worker: trains with a Checkpointer, resuming from it; records which examples each step consumed.

    python tests/workers/ckpt_train.py DIR STEPS [KILL_STEPS]

DIR gets the checkpoints (DIR/ckpt), a log of consumed examples (DIR/consumed.jsonl,
one line per step and attempt, written by process 0) and the final parameters
(DIR/final.npz). KILL_STEPS (comma-separated) makes process 1 (process 0 when
alone) SIGKILL itself after that step in attempt 0, 1, ... ($JDDP_RESTART_COUNT).
TERM_AT=step makes that process send SIGTERM after that step in attempt 0: to itself, or with
TERM_TO=launcher to its parent (``jddp launch``, which forwards it to every process); it then
pauses for TERM_PAUSE seconds (default 0), so that the notice reaches every process while the
run still has steps to go. A process stopped by preemption prints its step before exiting.
PREEMPTION_CHECK_S sets the Checkpointer's ``preemption_check_s`` (default 1).
RAISE_AT=step makes process 0
raise right after that step's ``maybe_save`` in attempt 0 (an unhandled exception while its async save is written).
KILL_HOST_AT=step makes process 1 SIGKILL its launcher and itself after that step in attempt 0 (a lost host).
SNAPSHOT_EVERY sets the steps between in-memory snapshots (default 1); SNAPSHOTS_EVERY_PROCESS=1 makes every
process write its own (as under a launcher other than jddp launch: no $JDDP_LOCAL_RANK).
KILL_ONCE=step:path makes process 1 wait after that step in attempt 0 until the file path exists (the test writes it
when the launcher says its standby processes are ready), then SIGKILL itself.
KILL_LAUNCHER_AT=step makes process 0 SIGKILL its parent (``jddp launch``) after that step, then go on; every
process writes DIR/launch-folder-<process> (the launcher's temporary folder) at its start and DIR/exit-<process>
(its step and exit code) when preemption stops it: its output then leads nowhere.
"""

import json
import os
import signal
import sys
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jddp.checkpoint import preemption  # noqa: E402
from tests import semantic_mutants  # noqa: E402

semantic_mutants.apply_from_env()  # a test's mutant, in this process too

out, steps = sys.argv[1], int(sys.argv[2])
kills = [int(k) for k in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] else []
attempt = int(os.environ.get("JDDP_RESTART_COUNT", "0"))
killer = min(1, jax.process_count() - 1)
term_at = int(os.environ.get("TERM_AT", "-1"))
term_to = os.environ.get("TERM_TO", "self")

rng = np.random.default_rng(0)
source = {
    "x": rng.normal(size=(300, 16)).astype(np.float32),
    "y": rng.integers(0, 4, 300).astype(np.int32),
    "id": np.arange(300, dtype=np.int32),
}


def loss_fn(params, model_state, batch, key):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


if os.environ.get("SNAPSHOTS_EVERY_PROCESS"):
    os.environ.pop("JDDP_LOCAL_RANK", None)
init = np.random.default_rng(1)
params = {
    "w1": init.normal(size=(16, 32)).astype(np.float32) * 0.3,
    "b1": np.zeros(32, np.float32),
    "w2": init.normal(size=(32, 4)).astype(np.float32) * 0.3,
}
dp = jddp.DataParallel(loss_fn, optax.adamw(1e-2), mesh=jddp.data_mesh())
state = dp.init(params)
loader = jddp.data.DataLoader(source, global_batch_size=24, seed=3)
ckpt = jddp.Checkpointer(
    os.path.join(out, "ckpt"),
    save_every=4,
    max_to_keep=2,
    config={"lr": 1e-2},
    preemption_check_s=float(os.environ.get("PREEMPTION_CHECK_S", "1")),
    # deterministic: every step by default (the default is sized by its measured cost)
    snapshot_every=int(os.environ.get("SNAPSHOT_EVERY", "1")),
)
state, loader = ckpt.restore_or_init(state, loader)
step = int(state.step)
kill_launcher_at = int(os.environ.get("KILL_LAUNCHER_AT", "-1"))
kill_once = os.environ["KILL_ONCE"].split(":", 1) if os.environ.get("KILL_ONCE") else None
if os.environ.get("JDDP_LEDGER_NOTE"):
    with open(os.path.join(out, f"launch-folder-{jax.process_index()}"), "w") as f:
        f.write(os.path.dirname(os.environ["JDDP_LEDGER_NOTE"]))
if jax.process_index() == 0:
    print(f"RESUMED at step {step} attempt {attempt} from {ckpt.restored_from}", flush=True)
log = open(os.path.join(out, "consumed.jsonl"), "a") if jax.process_index() == 0 else None
while step < steps:
    for batch in loader:
        ids = np.asarray(multihost_utils.process_allgather(batch["id"], tiled=True))
        mask = np.asarray(multihost_utils.process_allgather(batch["mask"], tiled=True))
        state, metrics = dp.step(state, batch)
        step += 1
        if log:
            log.write(json.dumps({"attempt": attempt, "step": step, "ids": ids[mask > 0].tolist()}) + "\n")
            log.flush()
        if attempt < len(kills) and step == kills[attempt] and jax.process_index() == killer:
            os.kill(os.getpid(), signal.SIGKILL)
        if kill_once and step == int(kill_once[0]) and jax.process_index() == killer and attempt == 0:
            jax.block_until_ready(state)  # the group completed the step: its peers hold it (snapshot_kept)
            while not os.path.exists(kill_once[1]):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == kill_launcher_at and jax.process_index() == 0:
            os.kill(os.getppid(), signal.SIGKILL)
        if step == int(os.environ.get("KILL_HOST_AT", "-1")) and jax.process_index() == killer and attempt == 0:
            os.kill(os.getppid(), signal.SIGKILL)  # the host dies: its launcher, its snapshots' folder, this process
            os.kill(os.getpid(), signal.SIGKILL)
        if step == term_at and jax.process_index() == killer and attempt == 0:
            os.kill(os.getppid() if term_to == "launcher" else os.getpid(), signal.SIGTERM)
            # Until this process's own handler saw it (forwarded by the launcher, or sent to itself): no race.
            if not preemption._SIGTERM.wait(120):
                raise SystemExit("SIGTERM never reached this process")
        try:
            ckpt.maybe_save(state, loader)
        except SystemExit as stop:
            with open(os.path.join(out, f"exit-{jax.process_index()}"), "w") as f:
                f.write(f"{step} {stop.code}")
            print(f"PREEMPTED process {jax.process_index()} at step {step}, exit {stop.code}", flush=True)
            raise
        if step == int(os.environ.get("RAISE_AT", "-1")) and jax.process_index() == 0 and attempt == 0:
            raise RuntimeError(f"a check failed on process 0 after step {step}")
        if step == steps:
            break
ckpt.save(state, loader)
ckpt.close()
if jax.process_index() == 0:
    np.savez(os.path.join(out, "final.npz"), **{k: np.asarray(v) for k, v in state.params.items()})
    print(f"FINISHED step {step}", flush=True)
