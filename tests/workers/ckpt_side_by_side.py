"""Worker: two Checkpointers of one run (the epoch checkpoint and the best model, two directories) save at every
step.

    python tests/workers/ckpt_side_by_side.py DIR STEPS

DIR/epoch and DIR/best get the checkpoints; process 0 prints ``SAVED <steps>`` with the last steps of each once both
are closed.
"""

import os
import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])


def loss_fn(params, model_state, batch, key):
    loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    return loss, (model_state, {})


rng = np.random.default_rng(0)
dp = jddp.DataParallel(loss_fn, optax.sgd(1e-2), mesh=jddp.data_mesh())
state = dp.init({"w": rng.normal(size=(8, 1)).astype(np.float32)})
source = {"x": rng.normal(size=(64, 8)).astype(np.float32), "y": rng.normal(size=(64, 1)).astype(np.float32)}
loader = jddp.data.DataLoader(source, global_batch_size=8, seed=0)
epoch = jddp.Checkpointer(os.path.join(out, "epoch"), save_every=1, max_to_keep=2, snapshots=False)
best = jddp.Checkpointer(os.path.join(out, "best"), max_to_keep=1, snapshots=False)
step = 0
while step < steps:
    for batch in loader:
        state, metrics = dp.step(state, batch)
        step += 1
        epoch.maybe_save(state, loader)
        best.save(state, loader)  # back to back with the epoch checkpoint's async save, every step
        if step == steps:
            break
epoch.close()
best.close()
if jax.process_index() == 0:
    print("SAVED", epoch.all_steps(), best.all_steps(), flush=True)
