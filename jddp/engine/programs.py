"""The compiled programs of a ``DataParallel``: its step and eval ``jit(shard_map(...))`` programs over the mesh, and
the ZeRO-1 step program of each optimizer-state layout that meets it."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp import runtime
from jddp.engine import checks, zero
from jddp.engine import step as step_lib
from jddp.runtime import state as state_lib

DATA = runtime.DATA_AXIS


class Programs:
    """The programs of one engine: ``step`` and ``eval`` compiled at construction, a ZeRO-1 step per layout on demand.

    Args:
      device: the per-device step and evaluation (``jddp.engine.step.DeviceStep``).
      mesh: the engine's mesh, with a ``"data"`` axis.
      optimizer: the engine's optimizer (loss scaling included).
      options: the engine's ``checks.Options``.
      rep, batch: the replicated sharding and the batch's sharding over ``"data"``.
    """

    def __init__(
        self,
        device: step_lib.DeviceStep,
        mesh: Mesh,
        optimizer: optax.GradientTransformation,
        options: checks.Options,
        *,
        rep: jax.sharding.Sharding,
        batch: jax.sharding.Sharding,
    ):
        self.device, self.mesh, self.optimizer, self.options = device, mesh, optimizer, options
        self.num_devices = mesh.shape[DATA]
        self.rep, self.batch = rep, batch
        self.step = self._compile(device.local_step, donate=options.donate)
        self.eval = self._compile(device.local_eval, donate=False, out_state=False)
        # ZeRO-1: the step program of each optimizer-state layout seen (one, unless states of several models
        # meet this object), and the last one, found by identity: states from `step` carry the same tuple.
        self._sharded: dict[tuple, Any] = {}
        self._last: tuple[Any, Any] = (object(), None) if options.shard_optimizer else (None, self.step)

    def _compile(self, fn, *, donate: bool, out_state: bool = True):
        # Programs take (step, params, opt_state, model_state), the rng key data
        # and the batch; the key is not donated nor returned (it never changes),
        # and the metrics come back packed in one vector: fewer buffers per call.
        out_specs = (P(), P()) if out_state else P()
        # check_vma=False: the user's code runs with pmap's semantics, as under plain jit (``jddp.engine.varying``).
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), P(), P(DATA)), out_specs=out_specs, check_vma=False)
        out_shardings = (self.rep, self.rep) if out_state else self.rep
        return jax.jit(
            mapped,
            in_shardings=(self.rep, self.rep, self.batch),
            out_shardings=out_shardings,
            donate_argnums=(0,) if donate else (),
        )

    def for_state(self, state: state_lib.TrainState):
        """The step program for ``state``'s optimizer layout, checked against the engine's the first time."""
        layout = state.opt_layout
        if layout is self._last[0]:
            return self._last[1]
        if not self.options.shard_optimizer:
            if layout is not None:
                raise ValueError(
                    "`state` holds sharded optimizer state (from a DataParallel with shard_optimizer=True), but this "
                    "DataParallel keeps it replicated. Use the same engine, or save the state with a "
                    "jddp.Checkpointer and restore it into this engine's `init` state: checkpoints move between them."
                )
            program = self.step
        else:
            program = self._sharded.get(layout)  # pyright: ignore[reportArgumentType]
            if program is None:
                expected = zero.opt_layouts(self.optimizer, state.params, self.num_devices)
                if layout != expected:
                    raise ValueError(self.layout_error(layout, expected, state))
                treedef = jax.tree.structure(state.opt_state)
                program = zero.step_program(self.device, self.mesh, expected, treedef, donate=self.options.donate)
                self._sharded[expected] = program
        self._last = (layout, program)
        return program

    def layout_error(self, layout, expected, state) -> str:
        if layout is None and any(not x.is_fully_replicated for x in jax.tree.leaves(state.opt_state)):
            return (
                "`state.opt_state` is split over the devices, but `state.opt_layout` is None: a TrainState built "
                "field by field drops it. Make new states with `state.replace(params=...)`, which keeps it."
            )
        if layout is None:
            return (
                "`state` holds replicated optimizer state (from a DataParallel with shard_optimizer=False), but this "
                "DataParallel shards it (shard_optimizer=True). Use the same engine, or save the state with a "
                "jddp.Checkpointer and restore it into this engine's `init` state: checkpoints move between them."
            )
        differ = next((i for i, (a, b) in enumerate(zip(layout, expected, strict=False)) if a != b), None)
        where = "" if differ is None else f" (leaf {differ}: {layout[differ]} here, {expected[differ]} expected)"
        return (
            f"`state.opt_state` is laid out for another model or device count{where}; this DataParallel splits it "
            f"over {self.num_devices} devices. Build the state with this object's `init`, or restore a checkpoint "
            "into it: a jddp.Checkpointer restores sharded state onto any device count."
        )
