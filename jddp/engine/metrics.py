"""Step metrics packed into one device array, read on the host on first access."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import numpy as np

from jddp.runtime import first_run, watchdog


class Metrics(Mapping[str, float]):
    """A read-only mapping of metric names to Python floats.

    The compiled step returns all its metrics as one replicated float32 vector
    (the steps' vectors carry each metric's weight after the values)
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
            # the step's output: in a group, it needs every peer (and may be the program's first run: gloo's window)
            with watchdog.waiting(), first_run.explained("the step these metrics come from"):
                self._store(np.asarray(self.packed))
        assert self._host is not None
        return self._host

    def _store(self, packed: np.ndarray) -> None:
        values = np.asarray(packed, np.float64).tolist()
        if len(values) < len(self.names):
            raise ValueError(
                f"Metrics: {len(values)} value(s) for the {len(self.names)} names {list(self.names)}; build Metrics "
                "from a vector with one value per name (and, for eval_step's, one weight per mean after them)."
            )
        self._host = dict(zip(self.names, values[: len(self.names)], strict=True))
        self._weights = dict(zip(self.names, values[len(self.names) :], strict=False))

    @property
    def weights(self) -> dict[str, float]:
        """What each mean averages over (real examples, or the ``Weighted`` weights): ``loss`` and the
        ``loss_fn``'s or ``eval_fn``'s metrics; empty for a vector without weights."""
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


class RunningMeans:
    """Means of step metrics over many steps, exact like one big batch: each mean weighted by what it averaged
    over in its step (real examples, or a ``Weighted`` loss's or metric's weight, e.g. tokens).

    ``add`` keeps the step's ``Metrics`` on the device (no wait); ``compute`` reads every pending step in one
    transfer. A step skipped as non-finite (``nonfinite`` 1) is left out of the means and counted in
    ``nonfinite``; a step without a real example weighs nothing. ``jddp.fit`` keeps one per logging window and one
    per epoch; a hand-written loop can do the same (Flax's ``nnx.MultiMetric`` in jddp's terms).

    Example:
      >>> import jax.numpy as jnp
      >>> means = RunningMeans()
      >>> means.add(Metrics(("loss", "examples"), jnp.array([1.0, 30.0])))
      >>> means.add(Metrics(("loss", "examples"), jnp.array([3.0, 10.0])))
      >>> means.compute()
      {'loss': 1.5, 'examples': 40.0, 'steps': 2}
    """

    def __init__(self, parent: RunningMeans | None = None):
        """``parent``: another ``RunningMeans`` that counts every step this one reads (a window's epoch)."""
        if parent is not None and not isinstance(parent, RunningMeans):
            raise TypeError(f"`parent` must be a RunningMeans or None, got {type(parent).__name__}.")
        self.parent = parent
        self.reset()

    def reset(self) -> None:
        self._pending: list[Metrics] = []
        self._sums: dict[str, float] = {}
        self._totals: dict[str, float] = {}  # per metric, the weights summed
        self._examples = 0.0
        self._steps = self._skipped = 0
        self.last: dict[str, float] = {}

    def add(self, metrics: Metrics) -> None:
        """Counts one step's metrics (read later, by ``compute``)."""
        if not isinstance(metrics, Metrics):
            raise TypeError(
                f"`metrics` must be the jddp.Metrics that `DataParallel.step` returned (kept on the device until "
                f"`compute`), got {type(metrics).__name__}."
            )
        if "examples" not in metrics.names:
            raise ValueError(f"RunningMeans needs the step's `examples`, got metrics {list(metrics.names)}.")
        self._pending.append(metrics)

    def compute(self) -> dict[str, float]:
        """The example-weighted mean of every metric over the steps added since ``reset``, with ``examples``
        (their sum), ``steps``, and ``nonfinite`` (steps skipped) where the step reports it."""
        if self._pending:
            with watchdog.waiting():  # the steps' outputs: in a group, they need every peer
                rows = jax.device_get([m.packed for m in self._pending])
            self._take(rows)
        out = {k: v / self._totals[k] if self._totals.get(k, 0) > 0 else 0.0 for k, v in self._sums.items()}
        out.update(examples=self._examples, steps=self._steps)
        if self._skipped or "nonfinite" in self.last:
            out["nonfinite"] = self._skipped
        return out

    def _take(self, rows: list) -> None:
        """The pending steps' metrics, read: counted."""
        for m, row in zip(self._pending, rows, strict=True):
            m._store(row)  # read once: dict(m) no longer waits
            self._absorb(dict(m), m._weights)
        self._pending = []

    def _detached(self, parent: RunningMeans | None = None) -> RunningMeans:
        """A copy that shares nothing this one changes later: its pending steps are new ``Metrics`` of the same
        device values (never donated), read when the copy is."""
        copy = RunningMeans(parent)
        copy._pending = [Metrics(m.names, m.packed) for m in self._pending]
        copy._sums, copy._totals, copy.last = dict(self._sums), dict(self._totals), dict(self.last)
        copy._examples, copy._steps, copy._skipped = self._examples, self._steps, self._skipped
        return copy

    def _read_detached(self) -> None:
        """A detached copy's pending steps read, from any thread (the main thread's watchdog state untouched)."""
        if self._pending:
            self._take(jax.device_get([m.packed for m in self._pending]))

    def get_state_later(self):
        """``get_state`` without waiting for the pending steps: a function that returns what ``get_state`` returns
        now, to call later from another thread (``jddp.Checkpointer``'s in-memory snapshots do: reading the metrics
        of every step would make the loop wait for each step)."""
        copy = self._detached()

        def state() -> dict:
            copy._read_detached()
            return copy.get_state()

        return state

    def get_state(self) -> dict:
        """The sums so far (pending steps read first), JSON-able: for a checkpoint, so that a resumed run's means
        equal an uninterrupted run's (``Checkpointer.save(..., extra=...)``; ``jddp.fit`` does this)."""
        self.compute()
        return {
            "sums": dict(self._sums),
            "totals": dict(self._totals),
            "examples": self._examples,
            "steps": self._steps,
            "skipped": self._skipped,
            "last": dict(self.last),
        }

    def set_state(self, state: dict) -> None:
        """Continues from ``get_state``'s sums (the parent is not touched: it restores its own).

        Raises:
          TypeError: if ``state`` is not a mapping of ``get_state``'s keys and values (nothing changed then).
        """
        try:
            sums = {str(k): float(v) for k, v in state["sums"].items()}
            examples = float(state["examples"])
            # A state saved before the per-metric weights: every mean was weighted by the examples.
            totals = {str(k): float(v) for k, v in state.get("totals", dict.fromkeys(sums, examples)).items()}
            steps, skipped = _count(state["steps"]), _count(state["skipped"])
            last = {str(k): float(v) for k, v in state["last"].items()}
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise TypeError(
                "`state` must be the dict that `RunningMeans.get_state` returned (keys 'sums', 'totals', "
                f"'examples', 'steps', 'skipped', 'last'), got {type(state).__name__} ({error!r:.80})."
            ) from None
        self.reset()
        self._sums, self._examples, self._totals = sums, examples, totals
        self._steps, self._skipped, self.last = steps, skipped, last

    def _absorb(self, row: dict[str, float], weights: dict[str, float]) -> None:
        if self.parent is not None:
            self.parent._absorb(row, weights)
        self.last = row
        self._steps += 1
        if row.get("nonfinite", 0.0) > 0:
            self._skipped += 1
            return
        examples = row["examples"]
        self._examples += examples
        for k, v in row.items():
            if k not in ("examples", "nonfinite"):
                weight = weights.get(k, examples)  # grad_norm, and vectors without weights: the examples
                self._sums[k] = self._sums.get(k, 0.0) + v * weight
                self._totals[k] = self._totals.get(k, 0.0) + weight


def _count(value) -> int:
    """A step count from a saved state: an int, or a float holding one (JSON)."""
    if isinstance(value, bool) or float(value) != int(value) or value < 0:
        raise ValueError(f"a count must be a whole number >= 0, got {value!r}")
    return int(value)
