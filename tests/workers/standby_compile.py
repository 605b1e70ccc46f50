"""Worker: a hand-written loop (``DataParallel``, ``DataLoader``, ``Checkpointer``; no ``jddp.fit``) whose first
step after its restore is watched for compilations, under ``jddp launch -n 2``.

    python tests/workers/standby_compile.py DIR

Trains 20 steps. Every process writes DIR/notes: ``FIRST attempt process restored_step compilations``, the
compilations counted (JAX's ``/jax/core/compile/`` events: tracing, lowering, compiling) around its first step
after the restore. KILL_ONCE=step:path makes process 1 wait after that step in attempt 0 until the file path exists
(the test writes it when the launcher says its standby processes stand by), then SIGKILL itself. Process 0 writes
the final parameters to DIR/final.npz. BREAK_IN_STANDBY=1 makes the loss fail to trace in a standby process (the
compilation before standing by fails there, and only there).
"""

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

from jddp.runtime import standby  # noqa: E402

STEPS = 20
out = sys.argv[1]
attempt = int(os.environ.get("JDDP_RESTART_COUNT", "0"))
rank = jax.process_index()
kill_once = os.environ["KILL_ONCE"].split(":", 1) if os.environ.get("KILL_ONCE") else None
events: list[str] = []


def listener(event: str, duration_secs: float, **kwargs) -> None:
    if event.startswith("/jax/core/compile/"):
        events.append(event)


jax.monitoring.register_event_duration_secs_listener(listener)

rng = np.random.default_rng(0)
source = {"x": rng.normal(size=(240, 16)).astype(np.float32), "y": rng.integers(0, 4, 240).astype(np.int32)}


def loss_fn(params, model_state, batch, key):
    if os.environ.get("BREAK_IN_STANDBY") == "1" and standby.active():
        raise RuntimeError("COMPILE FAILS IN STANDBY")
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


init = np.random.default_rng(1)
params = {
    "w1": init.normal(size=(16, 32)).astype(np.float32) * 0.3,
    "w2": init.normal(size=(32, 4)).astype(np.float32) * 0.3,
}
dp = jddp.DataParallel(loss_fn, optax.adamw(1e-2), mesh=jddp.data_mesh())
state = dp.init(params)
loader = jddp.data.DataLoader(source, global_batch_size=24, seed=3)
ckpt = jddp.Checkpointer(os.path.join(out, "ckpt"), save_every=4, max_to_keep=2, snapshot_every=1)
state, loader = ckpt.restore_or_init(state, loader)
step = restored = int(state.step)
first = True
while step < STEPS:
    for batch in loader:
        before = len(events)
        state, metrics = dp.step(state, batch)
        if first:
            jax.block_until_ready(state)
            with open(os.path.join(out, "notes"), "a") as f:
                f.write(f"FIRST {attempt} {rank} {restored} {len(events) - before}\n")
            first = False
        step += 1
        if kill_once and step == int(kill_once[0]) and rank == 1 and attempt == 0:
            while not os.path.exists(kill_once[1]):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(state, loader)
        if step == STEPS:
            break
ckpt.save(state, loader)
ckpt.close()
if rank == 0:
    np.savez(os.path.join(out, "final.npz"), **{k: np.asarray(v) for k, v in state.params.items()})
