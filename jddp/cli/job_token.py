"""The job token: only the job's own launchers join its rendezvous and send it reports.

Node 0's launcher listens at the coordinator's port + 1 (``jddp.cli.reports``, ``jddp.cli.launch.rendezvous``).
Without a check, anything that reaches that port would be admitted: a stray launcher pointed at the same address
would become a node and receive the model and the data, a stray report could end a run. So every connection there
is answered with a challenge (16 random bytes), and the first line it sends must carry
``HMAC-SHA256(token, challenge + line)``; node 0 compares with ``hmac.compare_digest``, refuses the rest naming
their address, and the refused launcher exits 1 saying how to fix it. The token itself never crosses the network.

Where the token comes from (``resolve``), first found first:

1. ``$JDDP_JOB_TOKEN`` (at least ``MIN_CHARS`` characters): the same value on every node, e.g. from the job
   script (``export JDDP_JOB_TOKEN=$(python -c "import secrets; print(secrets.token_hex(32))")`` before ``srun``);
2. ``--job-token-file PATH``: the file's first line (readable by its owner only: mode 600);
3. a scheduler's job, ``$SLURM_JOB_ID``: ``HMAC(user secret, "slurm:" + job id)``, where the user secret is
   ``$XDG_CONFIG_HOME/jddp/job-secret`` (``~/.config/jddp/job-secret``; made, mode 600, on first use). Every node
   of the job derives the same token where the home directory is shared, as on most clusters; another user's job,
   or another job of yours, has another;
4. one node: a fresh random token for the run;
5. several nodes, no scheduler: ``HMAC(user secret, "coordinator:" + address)``: another user's launcher is refused,
   but not one of your own pointed at the same address (set ``$JDDP_JOB_TOKEN`` per job for that).

Every process of the run gets the token as ``$JDDP_JOB_TOKEN``.

What it does not cover: JAX's coordination service (node 0's ``--coordinator`` port) accepts any process that
connects with a valid process id; it listens only on the coordinator's address (``coordinator_bind_address``), and
the processes' gloo connections are likewise unauthenticated. Keep both ports on the cluster's private network.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket

from jddp import envvars

ENV = "JDDP_JOB_TOKEN"
MIN_CHARS = 16
SECRET_NAME = "job-secret"
FIX = (
    "Give every launcher of the run the same token: export JDDP_JOB_TOKEN=<the same secret of 16 or more characters> "
    "(or --job-token-file PATH) on every node"
)


def secret_path() -> str:
    """The user secret's file: ``$XDG_CONFIG_HOME/jddp/job-secret``, else ``~/.config/jddp/job-secret``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "jddp", SECRET_NAME)


def user_secret() -> bytes:
    """The user secret (``secret_path``), made with mode 600 on first use (atomically: several launchers of one job
    may start at once on a shared home directory; the first link wins, the others read it).

    Raises:
      ValueError: it cannot be made or read (naming the path and the fix).
    """
    path = secret_path()
    try:
        with open(path, "rb") as f:
            return f.read().strip()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"the job token's user secret {path} cannot be read ({e.strerror}): {FIX}.") from None
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        temporary = f"{path}.{socket.gethostname()}.{os.getpid()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
        os.remove(temporary)
        with open(path, "rb") as f:
            return f.read().strip()
    except OSError as e:
        raise ValueError(f"the job token's user secret {path} cannot be made ({e.strerror}): {FIX}.") from None


def from_file(path: str) -> bytes:
    """The token in ``path`` (its first line).

    Raises:
      ValueError: the file cannot be read, others may read it, or the token is shorter than ``MIN_CHARS``.
    """
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            token = f.readline().strip()
    except OSError as e:
        raise ValueError(f"--job-token-file={path!r} cannot be read ({e.strerror}): name a file that holds the "
                         "job's token on its first line.") from None  # fmt: skip
    if mode & 0o077:
        raise ValueError(f"--job-token-file={path!r} may be read by others (mode {mode & 0o777:o}): chmod 600 {path}.")
    if len(token) < MIN_CHARS:
        raise ValueError(
            f"--job-token-file={path!r} holds {len(token)} characters; a job token needs at least {MIN_CHARS}: "
            "write e.g. python -c 'import secrets; print(secrets.token_hex(32))' into it."
        )
    return token


def resolve(*, nnodes: int, coordinator: str | None, token_file: str | None = None) -> tuple[bytes, str]:
    """The run's token and where it came from (see the module docstring).

    Raises:
      ValueError: ``$JDDP_JOB_TOKEN`` or the token file is not usable, or the user secret cannot be made.
    """
    text = envvars.get(ENV)
    if text:
        if len(text) < MIN_CHARS:
            raise ValueError(
                f"${ENV} holds {len(text)} characters; a job token needs at least {MIN_CHARS}: "
                f"export {ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') on every node."
            )
        return text.encode(), f"${ENV}"
    if token_file is not None:
        return from_file(token_file), f"--job-token-file {token_file}"
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    if job:
        return derive(user_secret(), f"slurm:{job}"), f"SLURM job {job} and {secret_path()}"
    if nnodes == 1:
        return secrets.token_hex(32).encode(), "generated for this run"
    return derive(user_secret(), f"coordinator:{coordinator}"), f"the coordinator's address and {secret_path()}"


def derive(secret: bytes, what: str) -> bytes:
    return hmac.new(secret, what.encode(), hashlib.sha256).hexdigest().encode()


def prove(token: bytes, nonce: bytes, line: bytes) -> str:
    """``HMAC-SHA256(token, nonce + line)``: what a connection's first line carries as ``mac``."""
    return hmac.new(token, nonce + line, hashlib.sha256).hexdigest()


def verify(token: bytes, nonce: bytes, line: bytes, mac: object) -> bool:
    """Whether ``mac`` proves ``line`` under ``token`` for the challenge ``nonce`` (constant time)."""
    return isinstance(mac, str) and hmac.compare_digest(prove(token, nonce, line), mac)
