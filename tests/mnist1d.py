"""MNIST-1D for the test workers: the data and the MLP of ``examples/mnist1d``, built the same way.

The data is generated locally by the ``mnist1d`` package as
``examples/mnist1d/train.py:load_data`` generates it, and the model is
``jddp.benchmark.models.mnist1d_mlp`` (the example's MLP), so that the same
arguments give the same arrays and initial parameters as the example.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jddp.benchmark import models


def load_data(num_samples: int, seed: int = 0) -> dict[str, np.ndarray]:
    """MNIST-1D arrays: ``x`` [n, 40] float32, ``y`` [n] int32, and ``x_test``, ``y_test`` (80% / 20% split)."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    data = make_dataset(args)
    return {
        k: np.asarray(data[k], np.float32 if k.startswith("x") else np.int32) for k in ("x", "y", "x_test", "y_test")
    }


def mlp(hidden: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """The example's NNX MLP (40-hidden-hidden-10) as ``(graphdef, params, model_state)``."""
    return models.mnist1d_mlp(hidden, seed)
