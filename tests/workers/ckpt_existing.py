"""Worker: a step the directory already holds, saved again in a group, as ``on_existing`` says.

    python tests/workers/ckpt_existing.py DIR SCALE ON_EXISTING

Saves the state (weights all SCALE) at step 0 into DIR with ``Checkpointer(on_existing=ON_EXISTING)``, without
restoring; process 0 prints ``OUTCOME <what happened>`` and the weight DIR holds at step 0 afterwards.
"""

import sys
import warnings

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

out, scale, on_existing = sys.argv[1], float(sys.argv[2]), sys.argv[3]


def loss_fn(params, model_state, batch, key):
    return ((batch["x"] @ params["w"]) ** 2).mean(), (model_state, {})


dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
state = dp.init({"w": np.full((4, 1), scale, np.float32)})
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    with jddp.Checkpointer(out, on_existing=on_existing, snapshots=False) as ckpt:
        try:
            ckpt.save(state, wait=True)
            outcome = "saved"
        except jddp.checkpoint.CheckpointStepExistsError:
            outcome = "refused"
if any(issubclass(w.category, jddp.CheckpointWarning) for w in said):
    outcome += "+warned"
with jddp.Checkpointer(out, read_only=True) as reader:
    got = reader.restore_or_init(dp.init({"w": np.zeros((4, 1), np.float32)}))
if jax.process_index() == 0:
    print("OUTCOME", outcome, float(np.asarray(got.params["w"])[0, 0]), flush=True)
