"""Worker for the subset-collective tests: ``python tests/workers/alone.py CALL [OUT_DIR]``.

Two processes train with ``DataParallel`` (each step's loss read, as a loop that logs does). At step 3 process 0
makes the collective ``CALL`` alone, the DDP habit ``if jax.process_index() == 0: checkpointer.save(...)``, while
process 1 goes on stepping. Printed first: ``ALONE <time>``. ``CALLS`` maps each name of
``jddp.runtime.progress.COLLECTIVE_CALLS`` (and ``jit``, a plain jitted collective of the script's own) to the call;
a name without an entry is a ``KeyError`` here.
"""

import os
import sys
import tempfile
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

me = jax.process_index()
call = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="jddp-alone-")

mesh = jddp.data_mesh()
dp = jddp.DataParallel(lambda p, s, b, r: (jnp.mean((b["x"] @ p["w"]) ** 2), (s, {})), optax.sgd(0.01), mesh=mesh)
state = dp.init({"w": np.ones((4, 1), np.float32)})
local = np.ones((2 * jax.local_device_count(), 4), np.float32)
batch = {"x": jax.make_array_from_process_local_data(jddp.batch_sharding(mesh), local)}
ckpt = jddp.Checkpointer(os.path.join(out, "ckpt"), save_every=None) if call.startswith("Checkpointer") else None


def checkpointer() -> jddp.Checkpointer:
    assert ckpt is not None, "the Checkpointer cases open one on every process first"
    return ckpt


if call == "Checkpointer.restore_or_init":
    checkpointer().save(state, wait=True)  # by every process: the restore alone then has a step to agree on


def plain_jit():
    total = jax.jit(lambda x: jnp.sum(x), out_shardings=jddp.replicated(mesh))(batch["x"])
    return float(total)


CALLS = {
    "DataParallel.init": lambda: dp.init({"w": np.ones((4, 1), np.float32)}),
    "DataParallel.step": lambda: float(dp.step(state, batch)[1]["loss"]),
    "DataParallel.eval_step": lambda: float(dp.eval_step(state, batch)["loss"]),
    "DataParallel.evaluate": lambda: dp.evaluate(state, [batch]),
    "DataParallel.check_replicas": lambda: dp.check_replicas(state),
    "data_parallel.check_replicas": lambda: jddp.data_parallel(lambda s, b: s, batch_argnums=1).check_replicas(state),
    "Checkpointer.save": lambda: checkpointer().save(state, wait=True),
    "Checkpointer.maybe_save": lambda: checkpointer().maybe_save(state),
    "Checkpointer.restore_or_init": lambda: checkpointer().restore_or_init(state),
    "Checkpointer()": lambda: jddp.Checkpointer(os.path.join(out, "other")),
    "jddp.barrier": lambda: jddp.barrier("alone"),
    "jddp.host_all_gather": lambda: jddp.host_all_gather(me),
    "jddp.host_broadcast": lambda: jddp.host_broadcast(me),
    "jddp.host_all_reduce": lambda: jddp.host_all_reduce(me),
    "jit": plain_jit,
}

for step in range(100000):
    if step == 3 and me == 0:
        print(f"ALONE {time.time()}", flush=True)
        CALLS[call]()
    state, metrics = dp.step(state, batch)
    float(metrics["loss"])
    time.sleep(0.01)
