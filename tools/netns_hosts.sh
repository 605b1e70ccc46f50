#!/usr/bin/env bash
# netns_hosts.sh: two "hosts" on one Linux machine, for jddp's multi-host test (tests/test_two_hosts.py).
#
# It builds two network namespaces, ${NS_PREFIX}-a and ${NS_PREFIX}-b, joined by one veth pair named
# veth0 at both ends, with the private addresses 10.231.${NET_ID}.1 (in -a) and .2 (in -b). lo is up
# in each, IPv6 is off, and there is no default route, so a process in one namespace reaches only its
# own loopback and the other namespace. Nothing is added to the root namespace: the veth pair is
# created inside -a with its peer already in -b, so no link, address or route ever appears outside.
#
# Why: on one machine every process shares one network, so a multi-host bug that depends on which
# address a process advertises stays hidden. In these namespaces, as on many real hosts, the hostname
# maps to 127.0.0.1 (/etc/hosts), so gloo, left to resolve its own hostname, advertises 127.0.0.1 and
# the peers connect to themselves. jddp.initialize must tell gloo its own address (the one it reaches
# the coordinator from); the test proves that it does.
#
# Usage (as root: 'ip netns' needs CAP_SYS_ADMIN and CAP_NET_ADMIN):
#   netns_hosts.sh setup            (re)create the namespaces; tears down an old pair first
#   netns_hosts.sh teardown         SIGKILL the processes inside them (by PID), then delete them
#   netns_hosts.sh status           the namespaces, their processes and addresses
#   netns_hosts.sh sandbox CMD...   setup, then CMD, all inside
#                                   unshare --mount --pid --fork --kill-child --mount-proc --net
#                                   with a private tmpfs on /run/netns. When that process tree dies,
#                                   even from SIGKILL, its processes, namespaces and veth go with it.
#                                   CMD gets NETNS_A, NETNS_B (names) and ADDR_A, ADDR_B (addresses).
#
# Knobs (environment): NS_PREFIX=jddp (namespace names, 1-12 of [A-Za-z0-9_-]),
#                      NET_ID=0 (the subnet 10.231.${NET_ID}.0/24, 0-255).
set -euo pipefail

NS_PREFIX=${NS_PREFIX:-jddp}
NET_ID=${NET_ID:-0}
NSA=${NS_PREFIX}-a
NSB=${NS_PREFIX}-b
IF=veth0
IPA=10.231.${NET_ID}.1
IPB=10.231.${NET_ID}.2
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
}

ns_exists() { [ -e "/run/netns/$1" ]; }

teardown() {
  local ns pids
  for ns in "$NSA" "$NSB"; do
    ns_exists "$ns" || continue
    # A process left inside would keep the namespace and its veth alive after the name is gone.
    pids=$(ip netns pids "$ns")
    if [ -n "$pids" ]; then
      # shellcheck disable=SC2086
      kill -9 $pids 2>/dev/null || true
      for _ in $(seq 50); do
        [ -z "$(ip netns pids "$ns")" ] && break
        sleep 0.1
      done
    fi
    # Deleting a namespace destroys its end of the veth; the kernel removes the peer too.
    ip netns del "$ns" || die "could not delete namespace $ns"
  done
}

setup() {
  local ns f
  teardown
  ip netns add "$NSA" || die "could not create namespace $NSA"
  ip netns add "$NSB" || die "could not create namespace $NSB"
  ip -n "$NSA" link add "$IF" type veth peer name "$IF" netns "$NSB" || die "could not create the veth pair"
  ip -n "$NSA" addr add "$IPA/24" dev "$IF"
  ip -n "$NSB" addr add "$IPB/24" dev "$IF"
  for ns in "$NSA" "$NSB"; do
    # IPv4 only: no link-local addresses or neighbour discovery (the file is absent if IPv6 is disabled).
    for f in /proc/sys/net/ipv6/conf/{all,default}/disable_ipv6; do
      ip netns exec "$ns" sh -c "[ ! -e $f ] || echo 1 > $f"
    done
    # lo must be up: packets to a namespace's own 10.231.x.y go through lo, and the coordinator talks
    # to itself. With lo down the process on the coordinator's host cannot register.
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$IF" up
    [ -z "$(ip -n "$ns" route show default)" ] || die "unexpected default route in $ns"
  done
  echo "netns_hosts.sh: $NSA ($IF $IPA) <-> $NSB ($IF $IPB)"
}

status() {
  local ns
  for ns in "$NSA" "$NSB"; do
    if ns_exists "$ns"; then
      echo "== $ns, processes: $(ip netns pids "$ns" | tr '\n' ' ')"
      ip -n "$ns" -br addr
    else
      echo "== $ns: absent"
    fi
  done
}

sandbox() {
  [ $# -gt 0 ] || die "sandbox needs a command: netns_hosts.sh sandbox CMD [ARG...]"
  command -v unshare >/dev/null || die "'unshare' not found (install util-linux)"
  exec unshare --mount --pid --fork --kill-child --mount-proc --net bash "$SELF" _inside "$@"
}

inside() { # the sandbox's PID 1: a private /run/netns, the two hosts, then CMD
  [ $$ = 1 ] || die "_inside is for 'sandbox' only (it mounts over /run/netns)"
  mkdir -p /run/netns
  mount -t tmpfs netns-private /run/netns || die "could not mount a private tmpfs on /run/netns"
  setup >&2
  export NETNS_A=$NSA NETNS_B=$NSB ADDR_A=$IPA ADDR_B=$IPB
  "$@"
}

cmd=${1:-}
[ $# -eq 0 ] || shift
case "$cmd" in
  setup | teardown | status)
    preflight
    "$cmd"
    ;;
  sandbox)
    preflight
    sandbox "$@"
    ;;
  _inside)
    preflight
    inside "$@"
    ;;
  *) die "unknown command '$cmd' (setup | teardown | status | sandbox CMD...)" ;;
esac
