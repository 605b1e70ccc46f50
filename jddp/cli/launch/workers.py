"""This node's processes of one attempt: starting one (``spawn``, its output copied after its prefix), and the group
(``WorkerGroup``): polling their exits, waking on a ``pidfd``, signalling their sessions, stopping them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import subprocess
import sys
import threading
import time

from jddp.cli import output
from jddp.cli import spare as spare_lib
from jddp.cli.launch import environment, orphans

FLUSH_SIGNAL = signal.SIGUSR2  # jddp.runtime.flush.FLUSH_SIGNAL: the processes write out their buffers and exit


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


@dataclasses.dataclass
class Worker:
    process_id: int
    popen: spare_lib.Process
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)
    code: int | None = None
    ended: float | None = None  # monotonic time its exit was seen
    ended_at: float | None = None  # the same as wall time, for the summary
    unresponsive: bool = False  # still running when the group had failed: the launcher killed it
    stopped_for_restart: bool = False  # still running when another failed and a restart followed: killed at once
    from_spare: str = ""  # "handed": a spare took this role (jddp.cli.spare); "forked": one forked for it now
    # (jddp.cli.zygote); "woken": it stood by in it
    pidfd: int | None = None  # readable once it ended: the launcher wakes at once (pidfd)


def spawn(
    out: output.Output,
    argv: list[str],
    env: dict[str, str],
    cores: list[int] | None,
    prefix: output.Prefix,
    pass_fds=(),
) -> tuple[subprocess.Popen[bytes], list[threading.Thread], int]:
    """Starts a process (a worker or a spare) in a session of its own, its output copied to ours after
    ``prefix``; returns it, the readers of its output and the number of its pipe for Python's stdout. The session
    ends when this launcher dies, however it dies (``jddp.cli.launch.orphans``)."""
    # Python's stdout gets a pipe of its own (jddp.initialize() moves sys.stdout there), apart from fd 1,
    # where C++ (gloo) writes: see jddp.cli.output.
    python_read, python_write = os.pipe()
    env[environment.ENV_STDOUT_FD] = str(python_write)
    try:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=(python_write, *pass_fds),
        )
    finally:
        os.close(python_write)
    orphans.watch(popen.pid)  # its session ends within a second of this launcher's death, SIGKILL included
    if cores is not None:  # before its interpreter starts threads: they inherit the mask
        with contextlib.suppress(OSError):
            os.sched_setaffinity(popen.pid, cores)
    pipes = (
        (popen.stdout, sys.stdout, True),
        (os.fdopen(python_read, "rb", buffering=0), sys.stdout, False),
        (popen.stderr, sys.stderr, False),
    )
    readers = []
    for pipe, target, native in pipes:
        reader = threading.Thread(target=out.pump, args=(pipe, target, prefix), kwargs={"native": native}, daemon=True)
        reader.start()
        readers.append(reader)
    return popen, readers, python_write


class WorkerGroup:
    """The processes of this node's current attempt, and the output readers of those stopped before it."""

    def __init__(self, out: output.Output, flush_grace: float = 1.0) -> None:
        self.output = out
        self.flush_grace = flush_grace  # --flush-grace: between FLUSH_SIGNAL and SIGKILL (``kill``)
        self.workers: list[Worker] = []
        self.draining: list[threading.Thread] = []  # output readers of a stopped group, joined at the end

    def poll(self) -> None:
        for w in self.workers:
            if w.code is None:
                w.code = w.popen.poll()
                if w.code is not None:
                    w.ended, w.ended_at = time.monotonic(), time.time()

    def signal_all(self, signum: int) -> None:
        """Signals each process's whole session (its own children too, even after it exited)."""
        for w in self.workers:
            try:
                os.killpg(w.popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(w.code is not None for w in self.workers):
                return True
            self.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
        return False

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds``, or less: until a running process ends (its pidfd), so an exit is seen at once."""
        fds = [w.pidfd for w in self.workers if w.code is None and w.pidfd is not None]
        if not fds:
            time.sleep(seconds)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(seconds * 1000)

    def kill(self) -> None:
        """Ends every process still running: ``FLUSH_SIGNAL`` (each flushes its files, logs and stdout and exits:
        ``jddp.runtime.flush``), then SIGKILL to those still running ``flush_grace`` seconds later (a process stopped,
        holding the GIL, or whose flush hangs); returns once they ended (30 s at most after the SIGKILL)."""
        self.poll()
        if all(w.code is not None for w in self.workers):
            return
        self.signal_all(FLUSH_SIGNAL)
        self.wait_all(self.flush_grace)
        self.signal_all(signal.SIGKILL)
        self.wait_all(30)

    def stop_all(self, grace: float) -> None:
        """SIGTERM, then after ``grace`` seconds the flush signal and SIGKILL (``kill``), to every process still
        running."""
        self.poll()
        for w in self.workers:
            w.unresponsive = w.code is None
        self.signal_all(signal.SIGTERM)
        if not self.wait_all(grace):
            self.kill()
        self.finish_output()

    def stop_for_restart(self) -> None:
        """A restart follows: the others' end can tell nothing the launcher does not know already, and waiting for
        them to notice (the peer timeout) is downtime. The flush signal, then SIGKILL (``kill``), not SIGTERM: a
        SIGTERM is a preemption, whose save needs the process that is gone. A kill never damages a published
        checkpoint; a save in flight is cleaned up when the next attempt opens the directory."""
        self.poll()
        for w in self.workers:
            w.stopped_for_restart = w.code is None
        self.kill()
        self.finish_output(wait=False)

    def stop_after_signal(self, signum: int, timeout: float) -> None:
        """After a signal to the launcher (forwarded already): ``timeout`` seconds to end, then SIGKILL."""
        self.output.say(f"got {signal.Signals(signum).name}; forwarded it to every process")
        self.signal_all(signum)  # processes started while the signal arrived get it too
        if not self.wait_all(timeout):
            self.output.say(f"processes still running {timeout:g} s after the signal: SIGKILL")
            self.kill()
        self.finish_output()

    def stop_silent(self, silent: set[int], by: str) -> None:
        """Stops at once the processes of this node that a survivor found silent for the peer timeout (SIGKILL:
        stopped or holding the GIL, a silent process acts on no SIGTERM), instead of waiting for them first."""
        self.poll()
        for w in self.workers:
            if w.process_id in silent and w.code is None:
                w.unresponsive = True
                self.output.say(f"process {w.process_id} was found silent by {by}: stopping it (SIGKILL)")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.popen.pid, signal.SIGKILL)

    def finish_output(self, *, wait: bool = True) -> None:
        """Ends what is left of the group and copies the rest of its output; without ``wait`` the copying goes on
        while the launcher goes on (a restart need not wait for it), joined when the launcher ends."""
        self.signal_all(signal.SIGKILL)  # leftovers of exited processes would hold the pipes open
        for w in self.workers:
            if wait:
                for reader in w.readers:
                    reader.join(timeout=5)
            else:
                self.draining += w.readers

    def close(self) -> None:
        """Closes the processes' pidfds (the launcher ends)."""
        for w in self.workers:
            if w.pidfd is not None:
                os.close(w.pidfd)
                w.pidfd = None
