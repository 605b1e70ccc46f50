"""The hand-written training loop (no ``jddp.fit``) that ``benchmarks/standby_compile.py`` kills and times.

    python benchmarks/hand_loop.py DIR [--no-ahead]

A 64-512-512-512-10 MLP with AdamW, ``DataParallel``, a ``DataLoader`` over 4,096 synthetic examples (global batch
64) and a ``Checkpointer`` (a save every 10 steps, a snapshot in memory every step), 60 steps. ``--no-ahead`` turns
off what a standby process compiles before it stands by (``jddp.engine.ahead``): the benchmark's "after" arm.
Every process writes ``DIR/times-<attempt>-<process>.json`` after its first step: when its attempt began
(``JDDP_ATTEMPT_START``: a woken standby process's wake), when its restore returned and its first step ended, and
the compilations JAX counted around that step. ``KILL_ONCE=step:path``: process 1 of attempt 0 waits after that
step until the file exists (the benchmark writes it when the launcher says its standby processes stand by), writes
``DIR/killed`` (the time) and SIGKILLs itself.
"""

import json
import os
import signal
import sys
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jddp.engine import ahead  # noqa: E402

STEPS, WIDTH = 60, 512
out = sys.argv[1]
if "--no-ahead" in sys.argv[2:]:
    ahead.remember = lambda *args, **kwargs: None  # the "after" arm: the step compiles after the wake
attempt = int(os.environ.get("JDDP_RESTART_COUNT", "0"))
rank = jax.process_index()
kill_once = os.environ["KILL_ONCE"].split(":", 1) if os.environ.get("KILL_ONCE") else None
events: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: events.append(event) if event.startswith("/jax/core/compile/") else None
)

rng = np.random.default_rng(0)
source = {"x": rng.normal(size=(4096, 64)).astype(np.float32), "y": rng.integers(0, 10, 4096).astype(np.int32)}


def loss_fn(params, model_state, batch, key):
    h = batch["x"]
    for i in range(3):
        h = jax.nn.relu(h @ params[f"w{i}"] + params[f"b{i}"])
    logits = h @ params["out"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


init = np.random.default_rng(1)
sizes = [64, WIDTH, WIDTH, WIDTH]
params = {f"w{i}": init.normal(size=(sizes[i], sizes[i + 1])).astype(np.float32) / np.sqrt(sizes[i]) for i in range(3)}
params |= {f"b{i}": np.zeros(WIDTH, np.float32) for i in range(3)}
params["out"] = (init.normal(size=(WIDTH, 10)) / np.sqrt(WIDTH)).astype(np.float32)
dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=jddp.data_mesh())
state = dp.init(params)
loader = jddp.data.DataLoader(source, global_batch_size=64, seed=0)
ckpt = jddp.Checkpointer(os.path.join(out, "ckpt"), save_every=10, max_to_keep=2, snapshot_every=1)
state, loader = ckpt.restore_or_init(state, loader)
restored_at, restored = time.time(), int(state.step)
step, first = restored, True
while step < STEPS:
    for batch in loader:
        before = len(events)
        state, metrics = dp.step(state, batch)
        if first:
            jax.block_until_ready(state)
            times = {"attempt_start": float(os.environ.get("JDDP_ATTEMPT_START", "nan")), "restored": restored_at}
            times |= {"first_step": time.time(), "restored_step": restored, "compiles": len(events) - before}
            with open(os.path.join(out, f"times-{attempt}-{rank}.json"), "w") as f:
                json.dump(times, f)
            first = False
        step += 1
        if kill_once and step == int(kill_once[0]) and rank == 1 and attempt == 0:
            while not os.path.exists(kill_once[1]):
                time.sleep(0.02)
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.maybe_save(state, loader)
        if step == STEPS:
            break
ckpt.save(state, loader)
ckpt.close()
