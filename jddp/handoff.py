"""The socket between the launcher and its spare and standby processes (``jddp.cli.spare``,
``jddp.runtime.standby``): its messages, one line each, and the spare's end's read.

At the bottom of the layers because both ends use it: the launcher (which imports no JAX) and a standby process's
runtime (which may not import the command line's layer). Imports no JAX.
"""

from __future__ import annotations

import json
import socket

__all__ = ["ENV_STANDBY_FD", "READY", "STANDING_BY"]  # `receive`: the two ends only, no public API

READY = b"ready\n"  # a spare's one message to its launcher: imported, waiting for its role
STANDING_BY = b"standby\n"  # a standby process's next (jddp.runtime.standby): ready, waiting for the failure
ENV_STANDBY_FD = "JDDP_STANDBY_FD"  # a standby process's socket to its launcher


def receive(channel: socket.socket) -> dict | None:
    """Blocks until the launcher sends its line (a role, or a standby's wake); None when the launcher closed the
    socket without one.

    Read to its end of line, never to the socket's end: a launcher that closes its end with the spare's ``READY``
    unread resets the connection (Linux, ``AF_UNIX``), and a read past the role would see that reset.
    """
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = channel.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return None  # the launcher is gone, or ended this spare's wait
        data += chunk
    return json.loads(data)
