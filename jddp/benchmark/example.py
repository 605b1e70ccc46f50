"""The example of ``jddp bench --model MODULE:FUNCTION`` in docs/guides/benchmarks.md, as a user writes one.

``jddp bench --model jddp.benchmark.example:bench`` runs it; a copy saved as
``mymodel.py`` runs as ``jddp bench --model mymodel:bench`` from its folder.
The guide shows the code between the two ``# ---`` lines, and
tests/test_bench.py checks that it shows this file's code.
"""

# ---
import numpy as np
import optax
from flax import nnx

import jddp
from jddp.benchmark import BenchModel


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1, self.l2 = nnx.Linear(32, 128, rngs=rngs), nnx.Linear(128, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def bench() -> BenchModel:
    graphdef, params, model_state = jddp.models.nnx_split(MLP(nnx.Rngs(0)))

    def loss(model, batch, rng):  # the mean over this device's rows
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def batch(size):  # size: --batch-per-device x the configuration's devices
        rng = np.random.default_rng(0)
        return {"x": rng.normal(size=(size, 32)).astype(np.float32), "y": rng.integers(0, 4, size, dtype=np.int32)}

    return BenchModel(jddp.models.nnx_loss(graphdef, loss), params, batch, optax.sgd(0.1), model_state)


# ---
