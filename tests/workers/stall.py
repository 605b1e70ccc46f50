"""Worker: trains a small MLP for STEPS steps; one process may stall at a chosen step.

    python tests/workers/stall.py OUT STEPS

STALL=data: process STALL_RANK sleeps in its data loading (a batch transform) when it reads the batch of step
STALL_AT, under ``jddp.fit`` (flight records go to fit's log_dir, OUT/log).
STALL=spin: process STALL_RANK spins in a Python loop of its own at step STALL_AT, in a hand-written loop
(``dp.step``; flight records in $JDDP_FLIGHT_DIR).
STALL=pause: every process sleeps PAUSE seconds at step STALL_AT in code of its own (hand-written loop): nobody
waits for anybody, so this is no stall.
STALL=none (default): no stall, under ``jddp.fit``; LOOP=hand runs the hand-written loop instead.
Each process prints ``STALLING <step> <time>`` when it stalls and ``DONE <process> <steps>`` at the end.
"""

import os
import sys
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])
how = os.environ.get("STALL", "none")
stall_rank, stall_at = int(os.environ.get("STALL_RANK", "1")), int(os.environ.get("STALL_AT", "20"))
rank = jax.process_index()
stalls_here = how in ("data", "spin") and rank == stall_rank

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype(np.float32)
y = (x[:, :4].argmax(1) + (x[:, 4] > 1)).astype(np.int32) % 4


def loss_fn(params, model_state, batch, key):
    logits = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


batches_read = 0


def slow_transform(batch, rng):
    """Process STALL_RANK's data loading hangs at the batch of step STALL_AT (a dead file system, say)."""
    global batches_read
    if stalls_here and how == "data" and batches_read == stall_at:
        print(f"STALLING {stall_at} {time.time():.3f}", flush=True)
        time.sleep(3600)
    batches_read += 1
    return batch


def spin_forever():
    """A Python loop of the script's own that never ends (it holds the GIL but for the interpreter's switches)."""
    print(f"STALLING {stall_at} {time.time():.3f}", flush=True)
    n = 0
    while True:
        n += 1


init = np.random.default_rng(1)
params = {
    "w1": init.normal(size=(16, 32)).astype(np.float32) * 0.3,
    "b1": np.zeros(32, np.float32),
    "w2": init.normal(size=(32, 4)).astype(np.float32) * 0.3,
}
dp = jddp.DataParallel(loss_fn, optax.sgd(0.05), mesh=jddp.data_mesh())
state = dp.init(params, rng=3)
train = jddp.data.DataLoader({"x": x, "y": y}, global_batch_size=16, seed=3, batch_transform=slow_transform)

if how in ("spin", "pause") or os.environ.get("LOOP") == "hand":
    step = 0
    while step < steps:
        for batch in train:
            if stalls_here and step == stall_at:
                spin_forever()
            if how == "pause" and step == stall_at:
                time.sleep(float(os.environ.get("PAUSE", "8")))  # an export of its own, say, on every process
            state, metrics = dp.step(state, batch)
            step += 1
            if step % 10 == 0:
                float(metrics["loss"])  # a host read now and then, as a script's logging does
            if step == steps:
                break
    jax.block_until_ready(state)
else:
    jddp.fit(dp, state, train, steps=steps, log_dir=os.path.join(out, "log"), log_every=10, progress=False)
print(f"DONE {rank} {steps}", flush=True)
