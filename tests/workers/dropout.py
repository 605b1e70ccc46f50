"""Worker: dropout training in a group of processes, from the start or resumed from a checkpoint.

    python tests/workers/dropout.py OUT MODE

MODE ``train``: the NNX dropout model (``tests.dropout_models``) trains 20 steps from its initial state; MODE
``resume``: restores the checkpoint in OUT/ckpt (saved at step 10 by another device layout) and trains steps 10 to
20. Process 0 writes OUT/dropout-MODE.json with the losses.
"""

import json
import sys

import jddp

jddp.initialize()

import jax  # noqa: E402

from tests import dropout_models  # noqa: E402

out, mode = sys.argv[1], sys.argv[2]
mesh = jddp.data_mesh()
sharding = jddp.runtime.batch_sharding(mesh)
loss_fn, params, state = dropout_models.nnx_model()
dp = dropout_models.make_dp(loss_fn, mesh)
train = dp.init(params, model_state=state, rng=0)
batches = [
    {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in b.items()}
    for b in dropout_models.host_batches(20)
]
if mode == "resume":
    with jddp.Checkpointer(f"{out}/ckpt") as ckpt:
        train = ckpt.restore_or_init(train)
    batches = batches[int(train.step) :]
_, losses = dropout_models.train(dp, train, batches)
if jddp.process_index() == 0:
    with open(f"{out}/dropout-{mode}.json", "w") as f:
        json.dump({"losses": losses, "devices": jax.device_count(), "processes": jax.process_count()}, f)
