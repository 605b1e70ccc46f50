#!/usr/bin/env bash
# netns_hosts.sh: several "hosts" on one Linux machine, for jddp's multi-host tests (tests/test_two_hosts.py,
# through tests/netns_bed.py).
#
# It builds HOSTS network namespaces (2 by default), ${NS_PREFIX}-a, ${NS_PREFIX}-b, ${NS_PREFIX}-c, ..., each
# with one interface veth0 holding the private address 10.231.${NET_ID}.k (k = 1 in -a, 2 in -b, 3 in -c, ...).
# The other end of every veth0 is a port (port-a, port-b, ...) of the bridge br0 in one more namespace,
# ${NS_PREFIX}-sw (the switch), so every host reaches every other one. lo is up in each host, IPv6 is off and
# there is no default route, so a process in a host reaches only its own loopback and the other hosts. Nothing
# is added to the root namespace: each veth pair is created inside the switch with its peer already in its host,
# so no link, address or route ever appears outside.
#
# Why: on one machine every process shares one network, so a multi-host bug that depends on which
# address a process advertises stays hidden. In these namespaces, as on many real hosts, the hostname
# maps to 127.0.0.1 (/etc/hosts), so gloo, left to resolve its own hostname, advertises 127.0.0.1 and
# the peers connect to themselves. jddp.initialize must tell gloo its own address (the one it reaches
# the coordinator from); the tests prove that it does.
#
# Usage (as root: 'ip netns' needs CAP_SYS_ADMIN and CAP_NET_ADMIN). HOST is a letter: a, b, c, ...
#   netns_hosts.sh setup            (re)create the hosts and the switch; tears down old ones first
#   netns_hosts.sh teardown         SIGKILL the processes inside every host of NS_PREFIX (a to z, whatever
#                                   HOSTS is) and the switch (by PID), then delete the namespaces
#   netns_hosts.sh status           the namespaces, their processes and addresses, the switch's ports
#   netns_hosts.sh unplug HOST      pull HOST's cable: its switch port goes down. HOST's veth0 stays up with
#                                   its address and route (NO-CARRIER); packets to and from HOST are dropped
#                                   without an error, as on a real network partition
#   netns_hosts.sh plug HOST        put the cable back (the port up again)
#   netns_hosts.sh kill HOST        SIGKILL every process inside HOST (until none is left); the namespace and
#                                   its network stay, ready for a new process
#   netns_hosts.sh sandbox CMD...   setup, then CMD, all inside
#                                   unshare --mount --pid --fork --kill-child --mount-proc --net
#                                   with a private tmpfs on /run/netns. When that process tree dies,
#                                   even from SIGKILL, its processes, namespaces and veths go with it.
#                                   CMD gets HOSTS, NETNS_A, NETNS_B, ... (names), ADDR_A, ADDR_B, ...
#                                   (addresses), the lists NETNS_ALL and ADDR_ALL (space-separated, in
#                                   host order), NETNS_SWITCH, and NETNS_HOSTS (this script's path, for
#                                   "$NETNS_HOSTS" unplug/plug/kill HOST inside the sandbox).
#
# Knobs (environment): HOSTS=2 (the number of hosts, 2-26),
#                      NS_PREFIX=jddp (namespace names, 1-12 of [A-Za-z0-9_-]),
#                      NET_ID=0 (the subnet 10.231.${NET_ID}.0/24, 0-255).
set -euo pipefail

HOSTS=${HOSTS:-2}
NS_PREFIX=${NS_PREFIX:-jddp}
NET_ID=${NET_ID:-0}
LETTERS=(a b c d e f g h i j k l m n o p q r s t u v w x y z)
NSW=${NS_PREFIX}-sw
IF=veth0
BR=br0
SELF=$(readlink -f "$0")

die() {
  echo "netns_hosts.sh: $*" >&2
  exit 1
}

preflight() {
  [ "$(id -u)" = 0 ] || die "must run as root ('ip netns' needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
  command -v ip >/dev/null || die "'ip' not found (install iproute2)"
  [[ $NS_PREFIX =~ ^[A-Za-z0-9_-]{1,12}$ ]] || die "NS_PREFIX='$NS_PREFIX' must be 1-12 of [A-Za-z0-9_-]"
  [[ $NET_ID =~ ^(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])$ ]] || die "NET_ID='$NET_ID' must be 0..255"
  [[ $HOSTS =~ ^([2-9]|1[0-9]|2[0-6])$ ]] || die "HOSTS='$HOSTS' must be 2..26 (one host per letter a..z)"
}

ns_exists() { [ -e "/run/netns/$1" ]; }
host_ns() { echo "${NS_PREFIX}-$1"; }                 # a letter -> its namespace
host_ip() { echo "10.231.${NET_ID}.$(($1 + 1))"; } # a host's index (0 for a) -> its address

# The letter HOST names one of this bed's HOSTS hosts, and it exists: dies saying what is expected otherwise.
check_host() {
  local letters="${LETTERS[*]:0:HOSTS}"
  [[ " $letters " == *" ${1:-} "* ]] || die "HOST='${1:-}' must be one of: $letters (HOSTS=$HOSTS)"
  ns_exists "$(host_ns "$1")" || die "host $1 ($(host_ns "$1")) does not exist: run setup (or sandbox) first"
}

# SIGKILLs every process inside namespace $1, again until none is left (a process can fork meanwhile).
kill_all_in() {
  local ns=$1 pids
  for _ in $(seq 50); do
    pids=$(ip netns pids "$ns")
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  die "processes still inside $ns after 5 s of SIGKILL: $(ip netns pids "$ns" | tr '\n' ' ')"
}

teardown() {
  local ns letter
  for letter in "${LETTERS[@]}" sw; do
    ns=${NS_PREFIX}-$letter
    ns_exists "$ns" || continue
    # A process left inside would keep the namespace and its veth alive after the name is gone.
    kill_all_in "$ns"
    # Deleting a namespace destroys its ends of the veths; the kernel removes the peers too.
    ip netns del "$ns" || die "could not delete namespace $ns"
  done
}

# IPv4 only in namespace $1: no link-local addresses or neighbour discovery (absent if IPv6 is disabled).
no_ipv6() {
  local f
  for f in /proc/sys/net/ipv6/conf/{all,default}/disable_ipv6; do
    ip netns exec "$1" sh -c "[ ! -e $f ] || echo 1 > $f"
  done
}

setup() {
  local k letter ns ip summary=()
  teardown
  ip netns add "$NSW" || die "could not create namespace $NSW"
  no_ipv6 "$NSW"
  # No STP: a port forwards as soon as it is up (with STP on, it would listen and learn for 2 forward delays).
  ip -n "$NSW" link add "$BR" type bridge stp_state 0 forward_delay 0 || die "could not create the bridge"
  ip -n "$NSW" link set "$BR" up
  for ((k = 0; k < HOSTS; k++)); do
    letter=${LETTERS[k]} ns=$(host_ns "${LETTERS[k]}") ip=$(host_ip "$k")
    ip netns add "$ns" || die "could not create namespace $ns"
    no_ipv6 "$ns"
    ip -n "$NSW" link add "port-$letter" type veth peer name "$IF" netns "$ns" ||
      die "could not create the veth pair of host $letter"
    ip -n "$NSW" link set "port-$letter" master "$BR"
    ip -n "$NSW" link set "port-$letter" up
    ip -n "$ns" addr add "$ip/24" dev "$IF"
    # lo must be up: packets to a namespace's own 10.231.x.y go through lo, and the coordinator talks
    # to itself. With lo down the process on the coordinator's host cannot register.
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$IF" up
    [ -z "$(ip -n "$ns" route show default)" ] || die "unexpected default route in $ns"
    summary+=("$ns ($IF $ip)")
  done
  echo "netns_hosts.sh: ${summary[*]}, joined by $BR in $NSW"
}

status() {
  local letter ns found=0
  for letter in "${LETTERS[@]}" sw; do
    ns=${NS_PREFIX}-$letter
    ns_exists "$ns" || continue
    found=1
    echo "== $ns, processes: $(ip netns pids "$ns" | tr '\n' ' ')"
    ip -n "$ns" -br addr
  done
  [ $found = 1 ] || echo "== no namespace of prefix $NS_PREFIX"
}

port() { # unplug/plug: the switch port of host $2 down/up
  check_host "${2:-}"
  ip -n "$NSW" link set "port-$2" "$1" || die "could not set port-$2 $1 in $NSW"
}

sandbox() {
  [ $# -gt 0 ] || die "sandbox needs a command: netns_hosts.sh sandbox CMD [ARG...]"
  command -v unshare >/dev/null || die "'unshare' not found (install util-linux)"
  exec unshare --mount --pid --fork --kill-child --mount-proc --net bash "$SELF" _inside "$@"
}

inside() { # the sandbox's PID 1: a private /run/netns, the hosts, then CMD
  local k letter names=() addrs=()
  [ $$ = 1 ] || die "_inside is for 'sandbox' only (it mounts over /run/netns)"
  mkdir -p /run/netns
  mount -t tmpfs netns-private /run/netns || die "could not mount a private tmpfs on /run/netns"
  # A private /dev/shm too: the launchers inside sweep the snapshot directories there of launchers they cannot see
  # (this sandbox's own PID namespace), which would include those of the processes outside it
  mount -t tmpfs shm-private /dev/shm || die "could not mount a private tmpfs on /dev/shm"
  setup >&2
  for ((k = 0; k < HOSTS; k++)); do
    letter=${LETTERS[k]}
    names+=("$(host_ns "$letter")")
    addrs+=("$(host_ip "$k")")
    export "NETNS_${letter^^}=${names[k]}" "ADDR_${letter^^}=${addrs[k]}"
  done
  export HOSTS NS_PREFIX NET_ID NETNS_ALL="${names[*]}" ADDR_ALL="${addrs[*]}" NETNS_SWITCH=$NSW NETNS_HOSTS=$SELF
  "$@"
}

cmd=${1:-}
[ $# -eq 0 ] || shift
case "$cmd" in
  setup | teardown | status)
    preflight
    "$cmd"
    ;;
  unplug | plug)
    preflight
    [ "$cmd" = unplug ] && state=down || state=up
    port "$state" "$@"
    ;;
  kill)
    preflight
    check_host "${1:-}"
    kill_all_in "$(host_ns "$1")"
    ;;
  sandbox)
    preflight
    sandbox "$@"
    ;;
  _inside)
    preflight
    inside "$@"
    ;;
  *) die "unknown command '$cmd' (setup | teardown | status | unplug HOST | plug HOST | kill HOST | sandbox CMD...)" ;;
esac
