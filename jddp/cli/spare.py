"""Spare workers: processes that import the heavy libraries before a restart needs them, then wait for a role.

A restart's new processes spend most of their start in Python's start and the imports of JAX, Flax, Optax, Orbax,
Grain and jddp (1.7 to 2.2 s of the 2.65 s from a kill to the first step of the restarted group). Under ``jddp
launch --max-restarts N`` (N > 0, and not ``--no-spares``) the launcher keeps one spare per local process, ``python
-u -m jddp.cli.spare FD``, started once the attempt's processes are past their first step (or a few seconds after
they started; at once in an attempt woken from standby), one generation per coming attempt up to ``--standby-depth``
(``jddp.cli.launch.spares``); most are forked, imported already, from the node's zygote (``jddp.cli.zygote``), which
runs ``serve`` in each fork. A spare imports ``HEAVY_MODULES`` and then blocks reading the socket ``FD`` until the
launcher hands it its role, one JSON object: the complete environment of the process (what the launcher would have
started it with: ``JDDP_PROCESS_ID``, ``JDDP_COORDINATOR``, ``JDDP_RESTART_COUNT``, ... ) and what to run. The spare
then replaces ``os.environ`` with it, sets ``sys.argv``, and runs the target as ``python -u script.py args``
(``runpy.run_path``, ``__name__ == "__main__"``, ``sys.path[0]`` the script's directory, symbolic links resolved) or
``python -u -m module args`` (``runpy.run_module`` with ``alter_sys=True``, ``sys.path[0]`` the working directory)
would. Its exit code is the script's.

Nothing that depends on the role happens before it is handed: the imports initialise no JAX backend (so
``jddp.initialize`` still sets the device count and joins the group), the environment the spare starts with is the
launcher's (with its allocator setting, ``GLIBC_TUNABLES``, which glibc reads at a process's start, and with
``--cpu-share`` the spare's share of the cores, pinned from its start as a process's would be), and ``JAX_*``
variables that JAX reads at import come from the launcher's environment, as they would for a process started
after the failure. A spare is bound to one local rank (its cores); the launcher prefixes its lines with that
process's index once handed (before, a spare prints nothing). A spare whose launcher is gone (its end of the
socket closed) exits 0 without running anything.

The launcher's side (``Spare``, ``role``) imports no JAX; only ``main`` does, in the spare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
from typing import Protocol

from jddp.cli import output
from jddp.handoff import ENV_STANDBY_FD, READY, STANDING_BY, receive

__all__ = ["HEAVY_MODULES", "READY", "Spare", "become", "main", "prepare", "role", "serve"]

# What a training script imports (the examples, jddp.fit's loop): each imported when present, skipped when not.
HEAVY_MODULES = (
    "numpy",
    "jax",
    "jax.numpy",
    "jax.experimental.multihost_utils",
    "flax",
    "flax.nnx",
    "flax.linen",
    "optax",
    "orbax.checkpoint",
    "grain",
    "grain.python",
    "yaml",
    "jddp.runtime.distributed",
    "jddp.runtime.mesh",
    "jddp.runtime.host",
    "jddp.engine.parallel",
    "jddp.data.loader",
    "jddp.checkpoint.checkpointer",
    "jddp.models",
    "jddp.config",
    "jddp.logs",
    "jddp.goodput",
    "jddp.loop",
)
HAND_TIMEOUT_S = 5.0  # how long the launcher waits to write a role into a spare's socket before it spawns instead


def role(
    env: dict[str, str], *, module: bool, target: str, args: tuple[str, ...] | list[str], standby: bool = False
) -> bytes:
    """The message that makes a spare process ``env["JDDP_PROCESS_ID"]``: its environment and its command, one line
    of JSON. With ``standby``, the role of a process of the next attempt, that runs its script up to its restore and
    waits there (``jddp.runtime.standby``) for ``wake``'s line on the same socket."""
    message = {"env": env, "module": module, "target": target, "args": list(args), "standby": standby}
    return json.dumps(message).encode() + b"\n"


def wake(env: dict[str, str]) -> bytes:
    """The line that wakes a standby process: the environment variables that hold the failure's moment."""
    return json.dumps({"env": env}).encode() + b"\n"


class Process(Protocol):
    """What the launcher uses of a process it started: a ``subprocess.Popen``, or a spare forked by the zygote
    (``jddp.cli.launch.zygote.Forked``)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None, /) -> int: ...

    def send_signal(self, sig: int, /) -> None: ...

    def kill(self) -> None: ...


@dataclasses.dataclass
class Spare:
    """The launcher's handle on one spare: its process, its output readers, its prefix, its end of the socket."""

    local_rank: int
    popen: Process
    channel: socket.socket
    prefix: output.Prefix
    readers: list[threading.Thread]
    stdout_fd: int  # the number of the spare's pipe for Python's stdout (JDDP_STDOUT_FD in its role)
    said_ready: bool = False
    standby: bool = False  # handed a standby role (its socket open): wake() makes it the process it stands by as
    said_standing_by: bool = False

    def ready(self) -> bool:
        """Whether the spare has said it finished its imports (never blocks)."""
        if not self.said_ready:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                self.said_ready = self.channel.recv(len(READY), socket.MSG_DONTWAIT) == READY
        return self.said_ready

    def hand(self, message: bytes, process_id: int, *, standby: bool = False) -> bool:
        """Hands the spare its role (``role``); returns False, the spare ended, when it is dead or does not take it
        within ``HAND_TIMEOUT_S`` (the launcher then starts the process as usual). With ``standby`` (a ``role``
        made with ``standby=True``) the socket stays open for ``wake``, and the process's output is held until
        then (``output.Prefix.held``)."""
        if self.popen.poll() is not None:
            self.discard()
            return False
        self.prefix.value = f"[{process_id}] ".encode()
        if standby:
            self.prefix.held = []
        try:
            self.channel.settimeout(HAND_TIMEOUT_S)
            self.channel.sendall(message)
            if not standby:
                self.channel.shutdown(socket.SHUT_WR)  # the end of the role: the spare reads to here
        except OSError:
            self.discard()
            return False
        finally:
            if not standby:
                self.channel.close()
            elif self.channel.fileno() >= 0:
                # Blocking again, without a timeout: with one, CPython waits for data up to the timeout before
                # each recv, MSG_DONTWAIT or not, and standing_by() held the launcher's watch (a failure seen
                # only when the standby processes stood by, up to HAND_TIMEOUT_S per poll).
                self.channel.settimeout(None)
        self.standby = standby
        return True

    def standing_by(self) -> bool:
        """Whether a standby process has said it waits before its restore (``jddp.runtime.standby``); never blocks."""
        if self.standby and self.ready() and not self.said_standing_by:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                self.said_standing_by = self.channel.recv(len(STANDING_BY), socket.MSG_DONTWAIT) == STANDING_BY
        return self.said_standing_by and self.popen.poll() is None

    def wake(self, message: bytes, out: output.Output) -> None:
        """Sends a standby process the failure's moment (``wake``), then releases its held output (one that ended
        meanwhile is found by the launcher's watch, as any process that ends)."""
        try:
            self.channel.settimeout(HAND_TIMEOUT_S)
            self.channel.sendall(message)
        except OSError:
            pass
        finally:
            self.channel.close()
        out.release(self.prefix)

    def discard(self) -> None:
        """Ends a spare that was not handed a role, or a standby process not woken (SIGKILL, its whole session); a
        standby's held output is dropped."""
        self.channel.close()
        self.prefix.held = []  # whatever it says from here on is dropped too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, 9)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


# ----------------------------------------------------------------------------------------- in the spare


def prepare(modules: tuple[str, ...] = HEAVY_MODULES) -> list[str]:
    """Imports ``modules`` (those installed); returns the ones imported."""
    imported = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        imported.append(name)
    return imported


def become(given: dict) -> None:
    """Runs the role's target in this process as ``python -u [-m] target args`` would, in the role's environment.

    Raises:
      SystemExit: the script's exit (or any exception the script raises, as Python would see it).
    """
    os.environ.clear()
    os.environ.update(given["env"])
    target, args = given["target"], given["args"]
    sys.argv = [target, *args]
    if given["module"]:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m jddp.cli.spare FD (started by jddp launch)", file=sys.stderr)
        return 2
    channel = socket.socket(fileno=int(argv[0]))
    prepare()
    return serve(channel)


def serve(channel: socket.socket) -> int:
    """A spare's life once imported (here, or forked by ``jddp.cli.zygote``): says ``READY`` on ``channel``, waits
    for its role, becomes it (the script's exit is this process's)."""
    with contextlib.suppress(OSError):
        channel.sendall(READY)
    given = receive(channel)
    if given is None:  # the launcher ended, or needs this spare no more
        channel.close()
        return 0
    if given.get("standby"):  # the socket stays open: the script waits on it before its restore
        given["env"][ENV_STANDBY_FD] = str(channel.detach())
    else:
        channel.close()
    become(given)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
