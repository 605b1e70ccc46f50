"""Worker: trains the MNIST-1D MLP for a few steps in whatever group it is started in; process 0 saves the parameters.

    python tests/workers/train_mlp.py OUT.npz [steps] [optimizer]

Started alone it uses ``JDDP_LOCAL_DEVICES`` simulated devices; under ``jddp
launch`` it joins the group. The data, the model and the global batches are the
same in every topology (seeded, world-size invariant loader). ``TRAIN_MLP_DATA``
names an ``.npz`` of the data (``data_file`` writes it) to read instead of
generating it again in every process. A test imports ``train`` to run the same
training in its own process on a mesh of its devices.
"""

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jddp
from jddp import models
from tests import mnist1d

NUM_SAMPLES = 1000


def classification_metrics(logits, batch):
    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32), mask)
    return loss, {"accuracy": accuracy}


def data_file(path) -> str:
    """Writes the training data to ``path`` (for ``TRAIN_MLP_DATA``); returns it as a string."""
    data: dict[str, Any] = mnist1d.load_data(num_samples=NUM_SAMPLES, seed=0)
    np.savez(path, **data)
    return str(path)


def load(path: str | None) -> dict[str, np.ndarray]:
    if path is None:
        return mnist1d.load_data(num_samples=NUM_SAMPLES, seed=0)
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def train(mesh, data, steps: int = 20, optimizer: str = "adamw"):
    """``steps`` steps on ``mesh``: the parameters by key path, the last step's metrics and its comm report."""
    graphdef, params, model_state = mnist1d.mlp(hidden=64, seed=0)
    if jax.process_index() != 0:  # other seeds on other processes: init must broadcast process 0's values
        params = jax.tree.map(lambda x: np.asarray(x) + 1.0, params)
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda model, batch, rng: classification_metrics(model(batch["x"]), batch)),
        optax.adamw(3e-3) if optimizer == "adamw" else optax.sgd(0.05, momentum=0.9),
        mesh=mesh,
    )
    state = dp.init(params, model_state, rng=0)
    loader = jddp.data.DataLoader({"x": data["x"], "y": data["y"]}, global_batch_size=64, seed=1, mesh=mesh)
    done, batch, metrics = 0, None, {}
    while done < steps:
        for batch in loader:
            state, metrics = dp.step(state, batch)
            done += 1
            if done == steps:
                break
    dp.assert_replicas_identical(state)
    report = dp.comm_report(state, batch)
    flat: dict[str, Any] = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.leaves_with_path(state.params)}
    return flat, metrics, report


def result_line(mesh, metrics, report) -> str:
    operands = sum(len(c.operands) for c in report.collectives)
    return (
        f"RESULT devices={mesh.devices.size} processes={jax.process_count()} loss={metrics['loss']:.6f} "
        f"allreduce_ops={report.count('all-reduce')} operands={operands}"
    )


if __name__ == "__main__":
    jddp.initialize()
    out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20
    optimizer = sys.argv[3] if len(sys.argv) > 3 else "adamw"
    mesh = jddp.data_mesh()
    flat, metrics, report = train(mesh, load(os.environ.get("TRAIN_MLP_DATA")), steps, optimizer)
    if jax.process_index() == 0:
        np.savez(out, **flat)
        print(result_line(mesh, metrics, report))
