"""pytest plugin of the mutation runs (tools/mutation.sh, pyproject.toml [tool.mutmut]).

mutmut forks each mutant's pytest from its fork server, which catches SIGTERM (killing the
server's other children and exiting 0, which mutmut reads as "survived") and SIGCHLD and
ignores SIGINT. A test process must not inherit that: jddp's Checkpointer leaves a SIGTERM
handler it did not set alone, so the preemption tests would fail for every mutant, and
SIG_IGN would pass on to the processes the tests start. Each pytest session therefore starts
with Python's own handlers.
"""

from __future__ import annotations

import signal


def pytest_configure(config) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
