"""Reaching the coordinator before JAX's client does: its port answers, and what answers is a gRPC server.

Otherwise JAX's client waits out its whole timeout and then aborts the process from C++ (exit 134, "the distributed
service detected fatal errors").
"""

from __future__ import annotations

import contextlib
import socket
import time

from jddp.runtime import join_settings


def wait_reachable(host: str, port: int, deadline: float, process_id: int, num_processes: int) -> None:
    last_error = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))) as c:
                _check_speaks_grpc(c, host, port)
                return
        except NotCoordinatorError:
            raise
        except OSError as e:
            last_error = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"jddp.initialize: process {process_id} of {num_processes} could not reach the coordinator at "
                f"{host}:{port} within the initialisation timeout ({last_error}). Is process 0 running, and is the "
                f"address right? Raise the timeout with init_timeout_s= or {join_settings.ENV_INIT_TIMEOUT}."
            )
        time.sleep(0.2)


# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (JAX's coordination service)
# answers with a SETTINGS frame of its own (type 4 on stream 0) at once.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_ANSWER_S = 15.0


class NotCoordinatorError(ConnectionError):
    """Another program, not JAX's coordination service, answers at the coordinator address."""


def _check_speaks_grpc(connection: socket.socket, host: str, port: int) -> None:
    """Raises ``ConnectionError`` naming the address if another program, not the coordinator, answers there.

    Otherwise JAX's client waits out its whole timeout and then aborts the process from C++ (exit 134, "the
    distributed service detected fatal errors").
    """
    answer = b""
    try:
        connection.settimeout(_H2_ANSWER_S)
        connection.sendall(_H2_PREFACE)
        while len(answer) < 9:
            chunk = connection.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
    except OSError:
        pass
    if len(answer) == 9 and answer[3] == 4 and answer[5:9] == bytes(4):
        return
    with contextlib.suppress(OSError):
        connection.settimeout(0.5)
        answer += connection.recv(64)  # more of it, for the message
    said = answer.decode("latin-1").splitlines()[0][:60] if answer else "nothing"
    raise NotCoordinatorError(
        f"jddp.initialize: the coordinator address {host}:{port} is answered by another program, not JAX's "
        f"coordination service (it answered {said!r} to an HTTP/2 greeting). Another program listens on that port: "
        "start the group on a free port (`jddp launch` picks one when --coordinator is left out), or stop that "
        "program."
    )
