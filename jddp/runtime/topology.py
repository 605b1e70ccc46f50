"""The one line that says where a run runs: ``jddp: 8 devices (cpu), 1 process x 8 local devices``.

Every run, in a group or alone, prints it once on process 0 (to stderr): at ``initialize`` in a group, else at the
first ``data_mesh()`` or ``fit``.
"""

from __future__ import annotations

import sys

_announced = False  # the topology line was printed (or is not this process's to print)


def topology_line() -> str:
    """``jddp: 8 devices (cpu), 1 process x 8 local devices``: the devices, the platform, the processes and each
    one's devices (starts the JAX backend); on an accelerator also the devices of the process that prints it."""
    import jax

    from jddp import envvars

    return describe(
        jax.device_count(),
        jax.default_backend(),
        jax.process_count(),
        [d.id for d in jax.local_devices()],
        envvars.get("JDDP_DEVICES"),
    )


def describe(count: int, platform: str, processes: int, local_ids: list[int], owned: tuple[str, ...] | None) -> str:
    """The topology line of these facts (``topology_line`` reads them from JAX): on an accelerator it names the
    devices of this process, by JAX's ids and, under ``jddp launch``, by the driver's (``$JDDP_DEVICES``).

    Example:
      >>> describe(8, "cpu", 1, list(range(8)), None)
      'jddp: 8 devices (cpu), 1 process x 8 local devices'
      >>> describe(16, "gpu", 16, [3], ("3",))
      'jddp: 16 devices (gpu), 16 processes x 1 local device; process 0 holds device 3 (driver id 3)'
    """
    local = len(local_ids)
    line = (
        f"jddp: {count} device{'s' if count != 1 else ''} ({platform}), {processes} "
        f"process{'es' if processes != 1 else ''} x {local} local device{'s' if local != 1 else ''}"
    )
    if platform == "cpu":
        return line
    held = f"device{'s' if local != 1 else ''} {','.join(map(str, local_ids))}"
    driver = f" (driver id{'s' if owned and len(owned) != 1 else ''} {','.join(owned)})" if owned else ""
    return f"{line}; process 0 holds {held}{driver}"


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
