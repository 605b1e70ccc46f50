"""Two roles on one checkpoint directory, each a process of its own (tests/test_checkpoint_access.py).

    python ckpt_access.py train DIR STEPS     # saves a 16 MB state asynchronously at every step
    python ckpt_access.py evaluate DIR N      # restores the newest step read-only N times meanwhile

The trainer's parameters at step k are all equal to k (SGD with a constant gradient of -1), so a
restore is a complete step exactly when every element equals the restored step.
"""

from __future__ import annotations

import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
import optax

import jddp

SIZE = 4 << 20  # float32 elements: 16 MiB


def loss_fn(params, model_state, batch, key):
    return -jnp.sum(params["w"]) + 0.0 * jnp.sum(batch["x"]), (model_state, {})


def main() -> None:
    role, directory, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    warnings.simplefilter("error", jddp.CheckpointWarning)  # a damaged or torn step fails the run
    dp = jddp.DataParallel(loss_fn, optax.sgd(1.0), mesh=jddp.data_mesh())
    state = dp.init({"w": np.zeros(SIZE, np.float32)})
    if role == "train":
        batch = {"x": np.ones((1, 1), np.float32)}
        with jddp.Checkpointer(directory, max_to_keep=2) as ckpt:
            print("trainer holds the lease", flush=True)
            for _ in range(count):
                state, _ = dp.step(state, batch)
                ckpt.save(state)  # async: returns while the previous ones may still be written
            ckpt.wait()
            print("trainer saved", int(state.step), "published", ckpt.all_steps(), flush=True)
        return
    with jddp.Checkpointer(directory, read_only=True) as probe:
        while not probe.all_steps():
            time.sleep(0.05)
    try:
        jddp.Checkpointer(directory)
        print("second writer ACCEPTED", flush=True)
    except jddp.CheckpointLeaseError as error:
        print("second writer refused:", str(error).split(":")[0], flush=True)
    reader = jddp.Checkpointer(directory, read_only=True)
    seen = []
    for _ in range(count):
        restored = reader.restore_or_init(state)
        step = int(restored.step)
        w = np.asarray(restored.params["w"])
        complete = step > 0 and bool(np.all(w == step))
        print("restored", step, "complete" if complete else "TORN", flush=True)
        seen.append(step)
    reader.close()
    print("distinct steps", len(set(seen)), flush=True)


if __name__ == "__main__":
    main()
