"""Step metrics packed into one device array, read on the host on first access."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import numpy as np

from jddp.runtime import watchdog


class Metrics(Mapping[str, float]):
    """A read-only mapping of metric names to Python floats.

    The compiled step returns all its metrics as one replicated float32 vector
    (``eval_step``'s vector carries each metric's weight after the values)
    (one output buffer instead of one per metric: measurably cheaper per step on
    CPU). Nothing is copied to the host until a value is read; the first read
    waits for the step and transfers the vector once. It is a pytree whose one
    leaf is the vector, so ``jax.block_until_ready(metrics)`` works.

    Example:
      >>> import jax.numpy as jnp
      >>> m = Metrics(("loss", "accuracy"), jnp.array([0.5, 0.75]))
      >>> m["loss"], dict(m)
      (0.5, {'loss': 0.5, 'accuracy': 0.75})
    """

    def __init__(self, names: tuple[str, ...], packed: jax.Array):
        self.names = tuple(names)
        self.packed = packed
        self._host: dict[str, float] | None = None
        self._weights: dict[str, float] = {}

    def _values(self) -> dict[str, float]:
        if self._host is None:
            with watchdog.waiting():  # the step's output: in a group, it needs every peer
                values = np.asarray(self.packed).tolist()
            self._host = dict(zip(self.names, values[: len(self.names)], strict=True))
            self._weights = dict(zip(self.names, values[len(self.names) :], strict=False))
        return self._host

    @property
    def weights(self) -> dict[str, float]:
        """What each mean of ``eval_step`` averages over (real examples, or the ``Weighted`` weights)."""
        self._values()
        return self._weights

    def __getitem__(self, name: str) -> float:
        try:
            return self._values()[name]
        except KeyError:
            raise KeyError(f"No metric {name!r}; the metrics are {list(self.names)}.") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        if self._host is None and not self.packed.is_fully_replicated:
            return f"Metrics({list(self.names)})"
        return "Metrics(" + ", ".join(f"{k}={v:.6g}" for k, v in self._values().items()) + ")"


jax.tree_util.register_pytree_node(
    Metrics,
    lambda m: ((m.packed,), m.names),
    lambda names, children: Metrics(names, children[0]),
)
