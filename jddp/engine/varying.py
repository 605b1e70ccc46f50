"""Values inside ``shard_map`` that vary over the data axis: casting to varying once, and model state to average."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jddp import runtime
from jddp.runtime import jax_internals

DATA = runtime.DATA_AXIS


def varying(x):
    """``x`` cast to varying over ``"data"`` (no-op when it already is)."""
    return x if DATA in jax_internals.varying_axes(x) else lax.pcast(x, DATA, to="varying")


def split_varying(tree):
    """Splits a pytree's leaves into (all leaves, varying float leaves, rebuild)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_paths]
    idx = []
    for i, (path, x) in enumerate(with_paths):
        if DATA not in jax_internals.varying_axes(x):
            continue
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"Model state leaf model_state{jax.tree_util.keystr(path)} (dtype={x.dtype}) differs across devices "
                "and is not a float, so it cannot be averaged; compute it from replicated values."
            )
        idx.append(i)

    def rebuild(all_leaves, averaged):
        out = list(all_leaves)
        for i, x in zip(idx, averaged, strict=True):
            out[i] = x.astype(all_leaves[i].dtype)
        return jax.tree.unflatten(treedef, out)

    return leaves, [leaves[i] for i in idx], rebuild
