"""The network-namespace test bed: a bash body run over 2 or more "hosts" on this machine.

``tools/netns_hosts.sh sandbox`` builds the hosts (namespaces ``jddpt-a``, ``jddpt-b``, ... with the addresses
10.231.0.1, .2, ..., joined by a bridge) inside ``unshare --net --pid --mount --fork --kill-child``, so nothing
outlives the test, even if it is killed, and tests running at the same time each have their own bed. Needs root,
``unshare`` and ``ip``; ``SKIP`` skips a test otherwise.

``run`` runs ``PRELUDE`` and then the test's body in the sandbox. The body gets the sandbox's variables
(``NETNS_A``, ``ADDR_A``, ..., ``NETNS_ALL``, ``ADDR_ALL``: see the script's header), ``$python`` (this
interpreter), ``$logs`` (a fresh folder, whose ``*.log`` files ``run`` returns), the test's arguments as
``"$@"``, and these functions:

- ``netns HOST`` / ``addr HOST``: the namespace / the address of host ``HOST`` (a letter), e.g.
  ``ip netns exec "$(netns b)" CMD`` runs ``CMD`` on host b.
- ``launcher HOST NAME ARG...``: ``python -m jddp.launch ARG...`` inside host ``HOST`` (a letter) in the
  background, its output in ``$logs/NAME.log``, its PID in ``${pid[NAME]}``. A host that comes back is a new
  launcher on it: ``launcher b host1-back ARG...`` (a new ``NAME`` keeps the first launcher's log; the same one
  would overwrite it).
- ``reap NAME...``: waits for those launchers, sets ``${code[NAME]}`` to their exit statuses, says them on
  stderr; status 0 when every one exited with 0.
- ``wait_for NAME REGEX [SECONDS]``: waits until a line of ``$logs/NAME.log`` matches the extended regular
  expression (``grep -E``); status 1, said on stderr, after ``SECONDS`` (120) without one.
- ``until_ SECONDS CMD...``: runs ``CMD`` every 0.2 s until it succeeds; status 1, said on stderr, after
  ``SECONDS``. ``step_at_least ROUND STEP FILE``: whether a line "<round> <step>" of ``FILE`` (fit_train.py's
  steps file) has both at least those.
- ``kill_host HOST``: SIGKILLs every process inside ``HOST`` (its launcher and its workers), until none is left.
- ``unplug HOST`` / ``plug HOST``: pulls ``HOST``'s cable / puts it back (its bridge port down / up: packets to
  and from it are dropped, no error).

The body's exit status is the test's verdict: ``run`` fails, showing the sandbox's stderr and every log, when it
is not 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import multiprocess

SCRIPT = multiprocess.ROOT / "tools" / "netns_hosts.sh"

PRELUDE = r"""
python=$1 logs=$2; shift 2
declare -A pid code
netns() {
  local v="NETNS_${1^^}"
  [ -n "${!v:-}" ] || { echo "no host '$1' in this bed of $HOSTS hosts" >&2; return 2; }
  echo "${!v}"
}
addr() {
  local v="ADDR_${1^^}"
  [ -n "${!v:-}" ] || { echo "no host '$1' in this bed of $HOSTS hosts" >&2; return 2; }
  echo "${!v}"
}
launcher() {
  local ns name=$2
  ns=$(netns "$1") || return 2
  shift 2
  ip netns exec "$ns" "$python" -m jddp.launch "$@" > "$logs/$name.log" 2>&1 &
  pid[$name]=$!
}
reap() {
  local name status=0
  for name; do
    wait "${pid[$name]}" && code[$name]=0 || code[$name]=$?
    echo "launcher $name exited with ${code[$name]}" >&2
    [ "${code[$name]}" = 0 ] || status=1
  done
  return $status
}
wait_for() {
  local name=$1 pattern=$2 seconds=${3:-120} i
  for ((i = 0; i < seconds * 5; i++)); do
    grep -Eq -- "$pattern" "$logs/$name.log" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "wait_for: no line matching '$pattern' in $name.log after $seconds s" >&2
  return 1
}
step_at_least() { awk -v r="$1" -v s="$2" '($1 >= r && $2 >= s) {found = 1} END {exit !found}' "$3" 2>/dev/null; }
until_() {
  local i
  for ((i = 0; i < $1 * 5; i++)); do "${@:2}" && return 0; sleep 0.2; done
  echo "gave up: ${*:2}" >&2
  return 1
}
kill_host() { "$NETNS_HOSTS" kill "$1"; }
unplug() { "$NETNS_HOSTS" unplug "$1"; }
plug() { "$NETNS_HOSTS" plug "$1"; }
"""


def usable() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


SKIP = pytest.mark.skipif(not usable(), reason="needs root, unshare and ip (iproute2) to build network namespaces")


def run(
    tmp_path: Path, body: str, *args: str, hosts: int = 2, timeout: float = 300, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Runs ``PRELUDE`` + ``body`` in a sandbox of ``hosts`` hosts, with ``args`` as its ``"$@"`` and ``env`` added
    to its environment (the workers inherit it); returns ``{name: text}`` of ``$logs/name.log``, or fails showing
    the sandbox's stderr and every log when the body exits with another status than 0 or outlives ``timeout``."""
    logs = tmp_path / "netns-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir()
    command = ["bash", str(SCRIPT), "sandbox", "bash", "-c", PRELUDE + body, "bed", sys.executable, str(logs), *args]
    # A broken test bed fails at initialisation; 60 s (not 120) lets two attempts fail within the default timeout.
    variables = {"NS_PREFIX": "jddpt", "NET_ID": "0", "JDDP_INIT_TIMEOUT": "60", **(env or {}), "HOSTS": str(hosts)}
    environment = multiprocess.environment(**variables)
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
        outcome, stderr = f"exit {done.returncode}", done.stderr
    except subprocess.TimeoutExpired as e:
        outcome = f"timed out after {timeout:g} s"
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
    found = {p.stem: p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))}
    if outcome != "exit 0":
        shown = "".join(f"\n--- {name} ---\n{text}" for name, text in found.items()) or "\n(no log)"
        pytest.fail(f"sandbox {outcome}:\n{stderr}{shown}")
    return found
