"""The one line that says where a run runs: ``jddp: 8 devices (cpu), 1 process x 8 local devices``.

Every run, in a group or alone, prints it once on process 0 (to stderr): at ``initialize`` in a group, else at the
first ``data_mesh()`` or ``fit``.
"""

from __future__ import annotations

import sys

_announced = False  # the topology line was printed (or is not this process's to print)


def topology_line() -> str:
    """``jddp: 8 devices (cpu), 1 process x 8 local devices``: the devices, the platform, the processes and each
    one's devices (starts the JAX backend)."""
    import jax

    n, processes, local = jax.device_count(), jax.process_count(), jax.local_device_count()
    return (
        f"jddp: {n} device{'s' if n != 1 else ''} ({jax.default_backend()}), {processes} "
        f"process{'es' if processes != 1 else ''} x {local} local device{'s' if local != 1 else ''}"
    )


def announce_topology() -> None:
    """Prints ``topology_line()`` to stderr on the main process, once per process: called by ``initialize`` (in a
    group), by the first ``data_mesh()`` and by ``fit``, so that every run says where it runs, also a script that
    never calls ``initialize``."""
    global _announced
    if _announced:
        return
    _announced = True
    import jax

    if jax.process_index() == 0:
        print(topology_line(), file=sys.stderr, flush=True)
