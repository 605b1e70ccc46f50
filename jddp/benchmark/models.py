"""The models of jddp's benchmarks, their synthetic batches, and the hand-written step jddp is measured against.

``jddp bench``, ``benchmarks/`` and the PyTorch twins in ``benchmarks/peers``
take their models from here. JAX, optax and Flax are imported inside the
functions only, so that the parent process of ``jddp bench`` (which reads
``MODELS``) imports no JAX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MODELS = ("mlp", "cnn")
FEATURES, CLASSES = 40, 10
HIDDEN = 256
CHANNELS, KERNEL = 32, 5
# benchmarks/peers only: an MNIST-sized MLP, 784-1024-1024-10 (1.86 M parameters, 7.5 MB of float32 gradients).
WIDE = "mlp784"
WIDE_FEATURES, WIDE_HIDDEN = 784, 1024


def features(model: str) -> int:
    """The input width of ``model``."""
    return WIDE_FEATURES if model == WIDE else FEATURES


def init_params(model: str, seed: int = 0) -> dict:
    """NumPy parameters of the benchmark models (the PyTorch twins in benchmarks/peers load these).

    ``mlp``: dense 40-256-256-10 with ReLU. ``cnn``: three 1-D convolutions
    (32 channels, kernel 5, same padding, ReLU; weights ``(out, in, kernel)``
    as in PyTorch) over the 40 features, then dense 1280-10. Dense weights are
    ``(in, out)``. ``mlp784`` (benchmarks/peers): dense 784-1024-1024-10 with ReLU.
    """
    import numpy as np

    rng = np.random.default_rng(seed)

    def dense(a: int, b: int) -> dict:
        return {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}

    def conv(cin: int) -> dict:
        w = rng.normal(size=(CHANNELS, cin, KERNEL)) / np.sqrt(cin * KERNEL)
        return {"w": w.astype(np.float32), "b": np.zeros(CHANNELS, np.float32)}

    if model == "mlp":
        return {"l0": dense(FEATURES, HIDDEN), "l1": dense(HIDDEN, HIDDEN), "l2": dense(HIDDEN, CLASSES)}
    if model == WIDE:
        w, h = WIDE_FEATURES, WIDE_HIDDEN
        return {"l0": dense(w, h), "l1": dense(h, h), "l2": dense(h, CLASSES)}
    return {"c0": conv(1), "c1": conv(CHANNELS), "c2": conv(CHANNELS), "out": dense(CHANNELS * FEATURES, CLASSES)}


def forward(model: str, params: dict, x):
    """Logits ``(batch, 10)`` of ``x`` ``(batch, features(model))`` in JAX."""
    import jax
    from jax import lax

    if model in ("mlp", WIDE):
        for i in range(3):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"][None, :]
            x = jax.nn.relu(x) if i < 2 else x
        return x
    h = x[:, None, :]
    for name in ("c0", "c1", "c2"):
        pad = [(KERNEL // 2, KERNEL // 2)]
        h = lax.conv_general_dilated(h, params[name]["w"], (1,), pad, dimension_numbers=("NCH", "OIH", "NCH"))
        h = jax.nn.relu(h + params[name]["b"][None, :, None])
    return h.reshape(h.shape[0], -1) @ params["out"]["w"] + params["out"]["b"][None, :]


def mean_loss(model: str, params: dict, batch: dict):
    """Mean softmax cross-entropy of ``forward`` over ``batch`` (``x``, integer labels ``y``)."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(forward(model, params, batch["x"]), batch["y"]).mean()


def synthetic_batches(steps: int, global_batch: int, seed: int = 1, width: int = FEATURES) -> list[dict]:
    """``steps`` global batches of MNIST-1D shape: ``x`` float32 ``(global_batch, width)``, ``y`` int32 labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(global_batch, width)).astype(np.float32),
         "y": rng.integers(0, CLASSES, global_batch).astype(np.int32)}
        for _ in range(steps)
    ]  # fmt: skip


def mnist1d_mlp(hidden: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """The MNIST-1D example's NNX MLP (40-hidden-hidden-10, ReLU) as ``(graphdef, params, model_state)``.

    Built as ``examples/mnist1d/train.py``'s ``make_model`` builds its ``mlp``
    (the same layers, in the same order, from ``nnx.Rngs(seed)``), so that
    the same ``hidden`` and ``seed`` give the same initial parameters.
    """
    from flax import nnx

    from jddp import models

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(FEATURES, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.l3 = nnx.Linear(hidden, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    return models.nnx_split(MLP(nnx.Rngs(seed)))


def reference_step(loss: Callable, optimizer: Any, mesh: Any, *, reduce: bool = True) -> Callable:
    """The hand-written data-parallel step jddp is measured against: ``jit(shard_map)`` with one ``pmean``.

    What a careful JAX user writes: on each device, ``value_and_grad`` of
    ``loss`` on the device's slice of the batch, taken at the parameters cast
    to varying over the mesh axis (differentiating the replicated parameters
    would sum the gradients over devices already), then one ``lax.pmean`` of the
    loss and the gradients, then the optax update.

    Args:
      loss: ``loss(params, batch) -> scalar``, the mean over the device's slice.
      optimizer: the ``optax.GradientTransformation`` to update with.
      mesh: a mesh with one axis; the batch's leading axis is sharded over it.
      reduce: ``False`` leaves out the ``pmean`` (no collective at all), so each
        device updates with its own gradient: the computation and the update
        alone (``jddp bench``'s ``local`` program).

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted:
      ``params`` and ``opt_state`` replicated over ``mesh`` and donated;
      ``batch`` with its leading axis sharded over the mesh axis.
    """
    import jax
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    (axis,) = mesh.axis_names

    def local_step(params, opt_state, batch):
        at = jax.tree.map(lambda x: lax.pcast(x, axis, to="varying"), params) if reduce else params
        value, grads = jax.value_and_grad(loss)(at, batch)
        if reduce:
            value, grads = lax.pmean((value, grads), axis)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    mapped = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P(axis)), out_specs=P(), check_vma=reduce)
    return jax.jit(mapped, donate_argnums=(0, 1))
