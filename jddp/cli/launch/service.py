"""Node 0's coordination service, in a process of its own for every attempt (``python -m jddp.runtime.coordinator``):
started, awaited, stopped (in the background when nothing needs it any more), and later attempts' started in
advance and adopted at their restart."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from jddp import net
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import orphans

# The launcher's coordination service: its heartbeat timeout is a backstop only (the processes' watchdogs and
# this launcher end a broken group long before), its shutdown timeout that of jddp.initialize's default.
SERVICE_HEARTBEAT_S = 3600
SERVICE_SHUTDOWN_S = 300
SERVICE_START_TIMEOUT_S = 60.0
SERVICE_READY = b"jddp coordinator: listening on"  # jddp.runtime.coordinator.READY
SERVICE_STOP_SIGNAL = signal.SIGUSR1  # jddp.runtime.coordinator.STOP_SIGNAL
SERVICE_GRACE_S = 10.0  # the service outlives a launcher killed without a word by this long, then ends


@dataclasses.dataclass
class Service:
    """A service's process at ``coordinator``, the event set once it listens, and what it said until then."""

    coordinator: str
    popen: subprocess.Popen[bytes]
    ready: threading.Event
    said: list[bytes]


class ServiceManager:
    """This attempt's service (``current``), and the threads stopping old ones in the background; those of later
    attempts, started in advance (``spawn_local``), are held by their generations (``jddp.cli.launch.spares``)."""

    def __init__(self, config: config_lib.LaunchConfig) -> None:
        self.config = config
        self.current: Service | None = None
        self.reapers: list[threading.Thread] = []  # services stopping in the background, joined at the end

    def start(self, coordinator: str) -> None:
        """Starts the group's coordination service in a process of its own (``await_ready`` waits until it
        listens: the workers start meanwhile, their imports overlapping the service's).

        Raises:
          OSError: the coordinator address is taken.
        """
        net.check_port_free(*net.split_address(coordinator))
        self.current = self.spawn(coordinator)

    def spawn(self, coordinator: str) -> Service:
        """The service's process, the event set once it listens, and what it said until then."""
        argv = [str(self.config.num_processes()), str(SERVICE_HEARTBEAT_S), str(SERVICE_SHUTDOWN_S)]
        # As for process 0's own service: the job's SIGTERM, SIGINT and SIGHUP (scancel, a time limit, a cgroup
        # kill signal every process) are for the workers, which need the service to agree on a step and save; it
        # stops on SERVICE_STOP_SIGNAL from this launcher, or SERVICE_GRACE_S after this launcher is gone.
        argv += ["--parent", str(os.getpid()), "--grace", str(SERVICE_GRACE_S)]
        service = subprocess.Popen(
            [sys.executable, "-u", "-m", "jddp.runtime.coordinator", coordinator, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the launcher only
        )
        orphans.watch(service.pid)  # ends within a second of this launcher's death (SIGKILL too), not SERVICE_GRACE_S
        assert service.stdout is not None
        said: list[bytes] = []
        ready = threading.Event()

        def read(pipe) -> None:
            for line in pipe:
                if not ready.is_set():
                    said.append(line)
                    if line.startswith(SERVICE_READY):
                        ready.set()

        threading.Thread(target=read, args=(service.stdout,), daemon=True).start()
        return Service(coordinator, service, ready, said)

    def await_ready(self) -> None:
        """Waits until the service started by ``start`` (or adopted) listens.

        Raises:
          OSError: the service did not start (with its output).
        """
        service = self.current
        assert service is not None
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while not service.ready.wait(0.05):
            if service.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = b"".join(service.said).decode(errors="replace").strip() or "no output"
                raise OSError(f"the coordination service at {service.coordinator} did not start:\n{text}")

    def stop(self, *, wait: bool = True) -> None:
        """Stops the attempt's service; without ``wait`` in the background (joined when the launcher ends): the next
        attempt's service listens on another port, and nothing needs this one any more."""
        current, self.current = self.current, None
        if current is not None:
            self.end(current, wait=wait)

    def end(self, service: Service, *, wait: bool) -> None:
        """Stops ``service`` (its stop signal, SIGKILL 10 s later); without ``wait`` in the background."""
        popen = service.popen

        def stop() -> None:
            if popen.poll() is None:
                popen.send_signal(SERVICE_STOP_SIGNAL)
                try:
                    popen.wait(10)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait()

        if wait:
            stop()
            return
        reaper = threading.Thread(target=stop, daemon=True)
        reaper.start()
        self.reapers.append(reaper)

    def spawn_local(self) -> Service:
        """A service started in advance for a later attempt, on a fresh free port of loopback (a local run)."""
        return self.spawn(f"127.0.0.1:{net.free_port()}")

    def adopt(self, service: Service | None) -> str | None:
        """The coordinator of ``service`` (started in advance by ``spawn_local``) when it still runs: it becomes this
        attempt's service. None when there is none, or it ended."""
        if service is None:
            return None
        if service.popen.poll() is not None:
            return None
        self.current = service
        return service.coordinator

    def discard(self, service: Service) -> None:
        """Stops a service started in advance that no attempt will use, in the background."""
        self.end(service, wait=False)

    def join(self) -> None:
        """Waits (10 s each at most) for the services stopping in the background."""
        for thread in self.reapers:
            thread.join(timeout=10)
