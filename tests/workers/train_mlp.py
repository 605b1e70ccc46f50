"""Worker: trains the MNIST-1D MLP for a few steps in whatever group it is started in; process 0 saves the parameters.

    python tests/workers/train_mlp.py OUT.npz [steps] [optimizer]

Started alone it uses ``JDDP_LOCAL_DEVICES`` simulated devices; under ``jddp
launch`` it joins the group. The data, the model and the global batches are the
same in every topology (seeded, world-size invariant loader).
"""

import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jddp import models  # noqa: E402
from tests import mnist1d  # noqa: E402


def classification_metrics(logits, batch):
    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32), mask)
    return loss, {"accuracy": accuracy}


out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
optimizer = sys.argv[3] if len(sys.argv) > 3 else "adamw"
data = mnist1d.load_data(num_samples=1000, seed=0)
graphdef, params, model_state = mnist1d.mlp(hidden=64, seed=0)
if jax.process_index() != 0:  # other seeds on other processes: init must broadcast process 0's values
    params = jax.tree.map(lambda x: np.asarray(x) + 1.0, params)
dp = jddp.DataParallel(
    models.nnx_loss(graphdef, lambda model, batch, rng: classification_metrics(model(batch["x"]), batch)),
    optax.adamw(3e-3) if optimizer == "adamw" else optax.sgd(0.05, momentum=0.9),
    mesh=jddp.data_mesh(),
)
state = dp.init(params, model_state, rng=0)
loader = jddp.data.DataLoader({"x": data["x"], "y": data["y"]}, global_batch_size=64, seed=1)
done = 0
while done < steps:
    for batch in loader:
        state, metrics = dp.step(state, batch)
        done += 1
        if done == steps:
            break
dp.assert_replicas_identical(state)
report = dp.comm_report(state, batch)
operands = sum(len(c.operands) for c in report.collectives)
if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.leaves_with_path(state.params)}
    np.savez(out, **flat)
    print(
        f"RESULT devices={jax.device_count()} processes={jax.process_count()} loss={metrics['loss']:.6f} "
        f"allreduce_ops={report.count('all-reduce')} operands={operands}"
    )
