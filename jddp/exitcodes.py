"""Exit codes with a meaning for ``jddp launch`` and cluster schedulers.

This module imports nothing, so the launcher can use it without JAX.

* ``EXIT_PEER_LOST`` (69, ``EX_UNAVAILABLE``): this process stopped because
  another process of the group died, hung or failed. It is a consequence, not a
  cause: the launcher's summary names the process that failed first.
* ``EXIT_STALLED`` (70): the group stopped making progress while alive (a
  process stuck in its data loading, a loop of its own, a file system): every
  process wrote a flight record and printed the process that is behind
  (``jddp.runtime.progress``). The launcher restarts on it, as on any failure.
* ``EXIT_PREEMPTED`` (75, ``EX_TEMPFAIL``): the run received SIGTERM, every
  process agreed on a step, the checkpoint of that step is complete, and the
  run stopped. Running the same command again resumes it. ``jddp launch`` does
  not restart on this code; it exits with it, so that a scheduler can requeue.
* A negative code ``-N`` (as ``subprocess`` reports it) or ``128 + N`` (as a
  shell reports it) means the process was killed by signal ``N``; ``SIGABRT``
  (``-6``/``134``) comes from a fatal error inside XLA or the coordination
  service, which usually also means a peer died.
"""

from __future__ import annotations

import signal

EXIT_PEER_LOST = 69
EXIT_STALLED = 70
EXIT_PREEMPTED = 75


def describe(code: int) -> str:
    """A short human description of a process exit code.

    >>> describe(0), describe(-9), describe(69)
    ('exited normally', 'killed by SIGKILL', 'stopped after losing a peer (exit 69)')
    """
    if code == 0:
        return "exited normally"
    if code == EXIT_PEER_LOST:
        return f"stopped after losing a peer (exit {code})"
    if code == EXIT_STALLED:
        return f"stopped: the group stalled (exit {code}; see the flight records)"
    if code == EXIT_PREEMPTED:
        return f"saved and stopped on preemption (exit {code})"
    signum = -code if code < 0 else code - 128 if 128 < code < 160 else None
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if signum == signal.SIGABRT:
            return f"aborted ({name}): a fatal error in XLA, usually a lost peer"
        return f"killed by {name}"
    return f"failed with exit code {code}"


def is_peer_failure(code: int) -> bool:
    """True for exits that are a consequence of another process failing."""
    return code in (EXIT_PEER_LOST, -signal.SIGABRT, 128 + signal.SIGABRT)
