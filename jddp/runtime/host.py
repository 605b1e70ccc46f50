"""Collectives over the process group for host values: all-gather, all-reduce and broadcast of Python objects
and NumPy arrays (PyTorch's ``all_gather_object``, ``broadcast_object_list`` and ``all_reduce`` on CPU tensors).

For what a script computes on the host: a metric over a process's own files, a vocabulary built on process
0, an early-stop flag. They go through the coordination service's key-value store, not the devices, so that
they take any picklable value, have a time limit, and name the processes that did not arrive, as
``jddp.barrier`` does; a device collective on a dead peer waits forever. Arrays that live on the devices are
reduced faster inside the step (``DataParallel``'s metrics are already exact global means).

Rules, as for any collective: every process makes the same calls in the same order. A process that makes
another call at the same place (``host_broadcast`` where the others ``host_all_gather``), or an all-reduce of
another shape, gets an error on every process naming it. Values are pickled; each may be up to
``MAX_BYTES`` pickled (every value passes through the service on process 0 or the launcher: keep them
small). In a single process every call returns at once. Each call's key is deleted by the next call.

Example (one process: each call returns its own value)::

    >>> import jddp
    >>> jddp.host_all_reduce(3, op="max"), jddp.host_all_gather({"vocab": 10}), jddp.host_broadcast("ok")
    (3, [{'vocab': 10}], 'ok')
"""

from __future__ import annotations

import pickle
from typing import Any, Literal

import numpy as np

from jddp import validate
from jddp.runtime import distributed, jax_internals, progress, watchdog

MAX_BYTES = 16 << 20
OPS = ("sum", "mean", "max", "min")
_PREFIX = "jddp/host"
_calls = 0


class _Refused:
    """What a process sends instead of a value it cannot send, so that every process raises the same error."""

    def __init__(self, reason: str):
        self.reason = reason


@progress.collective_call("jddp.host_all_gather", timed=True)
def host_all_gather(value: Any, *, timeout_s: float = 300.0) -> list[Any]:
    """Every process's ``value``, in process order, on every process.

    Raises:
      TimeoutError: after ``timeout_s``, naming the processes that did not call.
      ValueError: on every process, when one's value does not pickle or exceeds ``MAX_BYTES``.
      RuntimeError: on every process, when one made another host collective at this place.
    """
    return _exchange("host_all_gather", value, timeout_s)


@progress.collective_call("jddp.host_broadcast", timed=True)
def host_broadcast(value: Any, *, timeout_s: float = 300.0) -> Any:
    """Process 0's ``value`` on every process (the others' ``value`` is ignored and not sent).

    Raises:
      TimeoutError: after ``timeout_s``, naming the processes that did not call.
      ValueError: on every process, when process 0's value does not pickle or exceeds ``MAX_BYTES``.
      RuntimeError: on every process, when one made another host collective at this place.
    """
    return _exchange("host_broadcast", value, timeout_s, only_from=0)[0]


@progress.collective_call("jddp.host_all_reduce", timed=True)
def host_all_reduce(value: Any, op: Literal["sum", "mean", "max", "min"] = "sum", *, timeout_s: float = 300.0) -> Any:
    """``op`` over every process's ``value`` (a number or a NumPy array of one shape everywhere), elementwise.

    The result is the same bits on every process (reduced in process order). A Python number comes back as a
    Python number, an array as an array; ``"mean"`` is the sum divided by the process count, in float64 for
    integers.

    Raises:
      ValueError: a value that is not numeric, or ``op`` not one of ``OPS`` (before anything is sent); on every
        process, shapes that differ between processes, naming each process's shape.
      TimeoutError: after ``timeout_s``, naming the processes that did not call.
      RuntimeError: on every process, when one made another host collective at this place.
    """
    if op not in OPS:
        raise ValueError(f"host_all_reduce: op={op!r} must be one of {OPS}.")
    array = np.asarray(value)
    if array.dtype.kind not in "biuf" and not (array.dtype.kind == "V" and validate.goes_to_device(array.dtype)):
        raise ValueError(
            f"host_all_reduce: the value must be a number or a numeric NumPy array, got {type(value).__name__} "
            f"of dtype {array.dtype}; use host_all_gather for other values."
        )
    arrays = [np.asarray(v) for v in _exchange(f"host_all_reduce(op={op!r})", array, timeout_s)]
    shapes = [a.shape for a in arrays]
    if len(set(shapes)) > 1:
        listed = ", ".join(f"process {i}: {s}" for i, s in enumerate(shapes))
        raise ValueError(f"host_all_reduce: every process must give the same shape, got {listed}.")
    stacked = np.stack(arrays)
    if op == "sum":
        result = stacked.sum(axis=0)
    elif op == "mean":
        result = stacked.sum(axis=0, dtype=np.result_type(stacked.dtype, np.float64)) / len(arrays)
        if stacked.dtype.kind == "f" or stacked.dtype.name.startswith(("bfloat", "float")):  # bfloat16, float8
            result = result.astype(stacked.dtype)
    elif op == "max":
        result = stacked.max(axis=0)
    else:
        result = stacked.min(axis=0)
    return result.item() if not isinstance(value, np.ndarray) and result.ndim == 0 else result


def _exchange(kind: str, value: Any, timeout_s: float, only_from: int | None = None) -> list[Any]:
    """Every process's ``value`` (or only process ``only_from``'s, first in the list), checked for agreement."""
    number = isinstance(timeout_s, int | float | np.integer | np.floating) and not isinstance(timeout_s, bool)
    if not (number and 0 < timeout_s < float("inf")):  # inf or nan passed `> 0` and reached the coordinator
        raise ValueError(f"{kind}: timeout_s={timeout_s!r} must be a positive number of seconds, finite.")
    client = jax_internals.distributed_client()
    group = distributed.group()
    if client is None or group is None:
        try:  # alone, the value is not sent: refused all the same when it could not be, as in a group
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"{kind}: `value` must be picklable (it is sent to the other processes), got value of type "
                f"{type(value).__name__}: {error}. Send plain data (numbers, strings, arrays, lists, dicts)."
            ) from None
        return [value]
    global _calls
    _calls += 1
    me, n = group.process_id, group.num_processes
    call = f"{_PREFIX}/{_calls}"
    sends = only_from is None or me == only_from
    client.key_value_set_bytes(f"{call}/{me}", _payload(kind, value if sends else None, sends))
    try:
        with watchdog.waiting():
            client.wait_at_barrier(call, int(timeout_s * 1000))
    except Exception as error:  # the coordination service raises a generic runtime error
        arrived = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get_bytes(f"{call}/")}
        missing = sorted(set(range(n)) - arrived)
        raise TimeoutError(
            f"jddp.{kind.split('(')[0]} (host collective call {_calls}) timed out after {timeout_s:g} s on process "
            f"{me}: process(es) {missing} did not call it ({str(error).splitlines()[0]}). Every process must make "
            "the same host collective calls in the same order."
        ) from None
    entries = {int(key.rsplit("/", 1)[1]): data for key, data in client.key_value_dir_get_bytes(f"{call}/")}
    if _calls > 1:  # everyone has read the previous call's values: it passed this call's barrier after reading
        client.key_value_delete(f"{_PREFIX}/{_calls - 1}/{me}")
    received = [pickle.loads(entries[i]) for i in range(n)]
    kinds = [k for k, _ in received]
    if len(set(kinds)) > 1:
        listed = ", ".join(f"process {i}: {k}" for i, k in enumerate(kinds))
        raise RuntimeError(
            f"jddp host collective call {_calls}: the processes made different calls ({listed}). Every process "
            "must make the same host collective calls in the same order."
        )
    for i, (_, v) in enumerate(received):
        if isinstance(v, _Refused):
            raise ValueError(f"jddp.{kind.split('(')[0]}: process {i}'s value {v.reason}.")
    values = [v for _, v in received]
    return [values[only_from]] if only_from is not None else values


def _payload(kind: str, value: Any, sends: bool) -> bytes:
    if not sends:
        return pickle.dumps((kind, None))
    try:
        data = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        return pickle.dumps((kind, _Refused(f"of type {type(value).__name__} does not pickle ({error})")))
    if len(data) > MAX_BYTES:
        reason = f"is {len(data)} bytes pickled, more than MAX_BYTES={MAX_BYTES}; send less, or write it to a file"
        return pickle.dumps((kind, _Refused(reason)))
    return data
