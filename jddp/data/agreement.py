"""At a loader's first batch: the processes of a group built their loaders the same way (one all-gather)."""

from __future__ import annotations

import json

import jax
import numpy as np

from jddp.data import buckets
from jddp.data import sampler as sampler_lib
from jddp.runtime import dispatch, first_run, watchdog

# Room for one process's loader settings as JSON in the all-gather that compares them (with buckets' boundaries).
_SETTINGS_BYTES = 2048


def agree(sampler: sampler_lib.DistributedBatchSampler) -> None:
    """At a loader's first batch in a group: every process built its loader the same way, or a ``ValueError``.

    One all-gather of each process's settings (as JSON). Processes that disagree would read overlapping
    slices of different orders: examples duplicated and dropped without an error (``seed=process_index()``
    duplicates and drops 14 of 64 per epoch).
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    s = sampler
    mine = {
        "dataset size": s.dataset_size,
        "global_batch_size": s.global_batch_size,
        "padded_batch_size": s.padded_batch_size,
        "seed": s.seed,
        "shuffle": s.shuffle,
        "drop_last": s.drop_last,
        "position": s.position,
    }
    if isinstance(s, buckets.BucketedBatchSampler):  # the lengths decide which examples form each batch
        mine["buckets"] = buckets.settings(s.buckets, s.lengths)
    text = json.dumps(mine).encode()[:_SETTINGS_BYTES]
    row = np.zeros(_SETTINGS_BYTES, np.uint8)
    row[: len(text)] = np.frombuffer(text, np.uint8)
    dispatch.DISPATCHER.drain()  # no other program with collectives in flight
    first_run.meet_once(first_run.GLOBAL_DEVICES, "the data loaders' agreement")  # gloo's window opens with all
    with watchdog.waiting():
        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), _SETTINGS_BYTES)
    every = [json.loads(bytes(r).rstrip(b"\0")) for r in rows]
    for key in mine:
        values = [e.get(key) for e in every]
        if len({json.dumps(v) for v in values}) > 1:
            listed = ", ".join(f"{v!r} on process {i}" for i, v in enumerate(values))
            hint = (
                " Do not derive the seed from the process index: the loader already gives each process its "
                "own slice of one global order."
                if key == "seed"
                else ""
            )
            raise ValueError(
                f"The DataLoaders of this run's processes differ in {key}: {listed}. Every process must build "
                "its loader with the same source size, global_batch_size, max_per_device_batch_size, seed, "
                "shuffle, drop_last and buckets (and the same lengths), and restore the same position, or examples "
                f"are duplicated and dropped.{hint}"
            )
