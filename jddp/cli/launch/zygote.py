"""The launcher's side of the zygote (``jddp.cli.zygote``): one process of this node that has imported what a spare
imports, and forks spares that are imported from their first instant.

``SparePool`` starts it when the first generation of spares is wanted (the first attempt past its first step, or
a restart with nothing behind it), waits for its imports (``pending``: as long as spares of their own would import,
with one importing process instead of one per local process), and asks it for each spare once it is ready; where it
cannot serve (``usable``), or should it not get ready, spares are started as processes of their own as before. A
restart that finds no spare for a process forks one and hands it the role at once (``Launcher.start_one``): its
processes skip Python's start and the imports.

A forked spare is the zygote's child, not the launcher's: ``Forked`` is the launcher's handle on it, used as a
``subprocess.Popen`` is (``pid``, ``poll``, ``wait``, ``returncode``, signals), its exit code as the zygote reports
it. A spare whose zygote died before it could report its end is taken as killed (``-SIGKILL``): nobody else can
know its code.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from jddp.cli import output
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import orphans
from jddp.handoff import READY

FORK_TIMEOUT_S = 5.0  # a zygote that does not answer a request within this is ended; spares are started instead
REAP_WAIT_S = 1.0  # how long an ended spare's code is waited for from its zygote
# How long spares wait for the zygote's imports before they are started as processes of their own: its imports take
# 1.4 to 1.9 s on a quiet 2-core VM (29 Nov 2026), what a spare started instead would spend, with one process more.
READY_WAIT_S = 60.0


def usable(config: config_lib.LaunchConfig) -> bool:
    """Whether forked spares serve this run: spares of the XLA transport, without ``--cpu-share`` over several
    processes (each process's thread settings are in its environment before its imports: a fork has its zygote's)."""
    return config.spares and config.transport == "xla" and not (config.cpu_share and config.nprocs > 1)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (not ended, not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[:1]
    except (OSError, IndexError):
        return False
    return state not in ([b"Z"], [b"X"])


class Forked:
    """A spare forked by the zygote, as the launcher uses a ``subprocess.Popen``."""

    args = "python -m jddp.cli.zygote (a forked spare)"

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._zygote.code(self.pid)
            if code is None and not _running(self.pid):  # ended: the zygote reaps it and says its code
                code = self._zygote.code(self.pid, REAP_WAIT_S)
                if code is None:  # its zygote died first: nobody can know
                    code = -signal.SIGKILL
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process and the launcher's end of its socket (``jddp.cli.zygote``'s protocol)."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._ready = threading.Event()
        self._forked: queue.Queue[dict] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        self._lock = threading.Lock()  # one request at a time
        self._started_at = 0.0

    def start(self, env: dict[str, str]) -> None:
        """Starts the zygote in a session of its own (its output is the launcher's: it prints only a failure)."""
        ours, theirs = socket.socketpair()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-u", "-m", "jddp.cli.zygote", str(theirs.fileno())],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        orphans.watch(self.popen.pid)  # ended within a second of this launcher's death, as every process it starts
        self._started_at = time.monotonic()
        self._control = ours
        threading.Thread(target=self._read, args=(ours,), daemon=True).start()

    def _read(self, control: socket.socket) -> None:
        buffer = b""
        while True:
            try:
                chunk = control.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line + b"\n" == READY:
                    self._ready.set()
                    continue
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if "exited" in message:
                        with self._ended:
                            self._codes[int(message["exited"])] = int(message["code"])
                            self._ended.notify_all()
                    elif "forked" in message:
                        self._forked.put(message)
        self._ready.clear()
        with self._ended:
            self._ended.notify_all()

    def ready(self) -> bool:
        """Whether the zygote runs and has finished its imports (never blocks)."""
        return self._ready.is_set() and self.popen is not None and self.popen.poll() is None

    def pending(self) -> bool:
        """Whether the zygote still imports, started less than ``READY_WAIT_S`` ago (spares wait for it)."""
        running = self.popen is not None and self.popen.poll() is None
        return running and not self._ready.is_set() and time.monotonic() - self._started_at < READY_WAIT_S

    def code(self, pid: int, timeout: float = 0.0) -> int | None:
        """The exit code of forked spare ``pid`` once the zygote reported it (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._ended:
            while pid not in self._codes and (left := deadline - time.monotonic()) > 0 and self.ready():
                self._ended.wait(left)
            return self._codes.get(pid)

    def fork(
        self, out: output.Output, cores: list[int] | None, prefix: output.Prefix
    ) -> tuple[Forked, list[threading.Thread], int, socket.socket] | None:
        """A spare forked now: its handle, the readers of its output (copied to ours after ``prefix``, as
        ``workers.spawn`` copies a process's), the number of its pipe for Python's stdout, the launcher's end of its
        socket. None when the zygote is not ready (or stopped answering: it is ended)."""
        if not self.ready() or self._control is None:
            return None
        ours, theirs = socket.socketpair()
        pipes = [os.pipe() for _ in range(3)]  # fd 1, fd 2, Python's stdout
        request = json.dumps({"cores": cores}).encode()
        with self._lock:
            try:
                socket.send_fds(self._control, [request], [theirs.fileno(), *(w for _, w in pipes)])
                answer = self._forked.get(timeout=FORK_TIMEOUT_S)
            except (OSError, queue.Empty):
                answer = None
            finally:
                theirs.close()
                for _, w in pipes:
                    os.close(w)
        if answer is None:
            ours.close()
            for r, _ in pipes:
                os.close(r)
            self.close()
            return None
        forked = Forked(int(answer["forked"]), self)
        orphans.watch(forked.pid)
        readers = []
        targets = ((sys.stdout, True), (sys.stderr, False), (sys.stdout, False))  # as workers.spawn copies them
        for (r, _), (target, native) in zip(pipes, targets, strict=True):
            pipe = os.fdopen(r, "rb", buffering=0)
            kwargs = {"native": native}
            reader = threading.Thread(target=out.pump, args=(pipe, target, prefix), kwargs=kwargs, daemon=True)
            reader.start()
            readers.append(reader)
        return forked, readers, int(answer["stdout_fd"]), ours

    def close(self) -> None:
        """Ends the zygote (its forked spares live on, each ended as a spare is)."""
        self._ready.clear()
        if self._control is not None:
            with contextlib.suppress(OSError):
                self._control.shutdown(socket.SHUT_RDWR)
            self._control.close()
            self._control = None
        if self.popen is not None:
            try:
                self.popen.wait(2)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
