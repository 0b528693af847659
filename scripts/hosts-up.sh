#!/usr/bin/env bash
# Bring up two "hosts" as network namespaces hn1 (198.51.100.1) and hn2 (198.51.100.2), each with
# an eth0, joined by a bridge br0 that lives in a third namespace hnsw; the root namespace joins the
# bridge through hbr-host (198.51.100.254). Idempotent: pieces that exist are kept, then every
# address is pinged. scripts/hosts-down.sh STATE_DIR removes it all.
# STATE_DIR only holds logs (apt.log); the namespaces themselves are global to the machine.
set -euo pipefail

TAG=hosts-up
# shellcheck source=scripts/lib.sh
source "$(dirname "$0")/lib.sh"
STATE_DIR=$(state_dir "$@")

# TEST-NET-2 only: the machine's own network uses 192.0.2.0/24.
PREFIX=198.51.100
HOSTS=(hn1 hn2)
SWITCH=hnsw
ROOT_IF=hbr-host # root side of the root <-> bridge pair; its peer in hnsw is hbr-sw

((EUID == 0)) || die "must run as root (network namespaces need CAP_NET_ADMIN)"
command -v ip >/dev/null || die "ip (iproute2) is not installed"

# --- packages --------------------------------------------------------------------------------
if ! command -v ping >/dev/null; then
  install_missing "$STATE_DIR/apt.log" iputils-ping
fi

ns_exists() { [[ -e /run/netns/$1 ]]; }
link_in() { ip -n "$1" link show "$2" >/dev/null 2>&1; } # NS IFNAME

# Every ping must answer; prints the first that does not.
check() {
  local ns addr
  for addr in "$PREFIX.1" "$PREFIX.2"; do
    ping -c1 -W1 -q "$addr" >/dev/null 2>&1 || { echo "root -> $addr"; return 1; }
  done
  ip netns exec hn1 ping -c1 -W1 -q "$PREFIX.2" >/dev/null 2>&1 || { echo "hn1 -> $PREFIX.2"; return 1; }
  ip netns exec hn2 ping -c1 -W1 -q "$PREFIX.1" >/dev/null 2>&1 || { echo "hn2 -> $PREFIX.1"; return 1; }
  ip netns exec hn1 ping -c1 -W1 -q "$PREFIX.254" >/dev/null 2>&1 || { echo "hn1 -> $PREFIX.254"; return 1; }
  return 0
}

all_present() {
  local ns
  for ns in "${HOSTS[@]}" "$SWITCH"; do ns_exists "$ns" || return 1; done
  for ns in "${HOSTS[@]}"; do link_in "$ns" eth0 || return 1; done
  link_in "$SWITCH" br0 && ip link show "$ROOT_IF" >/dev/null 2>&1
}

if all_present; then
  if failed=$(check); then
    step "already up (hn1 $PREFIX.1, hn2 $PREFIX.2, root $PREFIX.254 on $ROOT_IF); all reachable"
    exit 0
  fi
  step "present but $failed does not answer; re-applying the configuration"
fi

# --- the switch: a bridge in its own namespace -------------------------------------------------
# A bridge in the root namespace would drop host-to-host frames (bridge-nf-call-iptables + Docker's
# FORWARD DROP policy); in hnsw no iptables rule applies.
ns_exists "$SWITCH" || ip netns add "$SWITCH"
ip -n "$SWITCH" link set lo up
link_in "$SWITCH" br0 || ip -n "$SWITCH" link add br0 type bridge
ip -n "$SWITCH" link set br0 up

# --- the hosts: eth0 inside each, its peer enslaved to br0 -------------------------------------
i=0
for ns in "${HOSTS[@]}"; do
  i=$((i + 1))
  ns_exists "$ns" || ip netns add "$ns"
  ip -n "$ns" link set lo up
  if ! link_in "$ns" eth0; then
    # Created under a unique name in the root namespace (which has its own eth0), then moved and
    # renamed; a half-made pair from an interrupted run is removed first.
    ip link del "$ns-eth0" 2>/dev/null || true
    ip -n "$SWITCH" link del "$ns-sw" 2>/dev/null || true
    ip link add "$ns-eth0" type veth peer name "$ns-sw"
    ip link set "$ns-sw" netns "$SWITCH"
    ip link set "$ns-eth0" netns "$ns"
    ip -n "$ns" link set "$ns-eth0" name eth0
  fi
  ip -n "$ns" addr replace "$PREFIX.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$SWITCH" link set "$ns-sw" master br0
  ip -n "$SWITCH" link set "$ns-sw" up
done

# --- the root namespace joins the bridge -------------------------------------------------------
if ! ip link show "$ROOT_IF" >/dev/null 2>&1; then
  ip -n "$SWITCH" link del hbr-sw 2>/dev/null || true
  ip link add "$ROOT_IF" type veth peer name hbr-sw
  ip link set hbr-sw netns "$SWITCH"
fi
ip addr replace "$PREFIX.254/24" dev "$ROOT_IF"
ip link set "$ROOT_IF" up
ip -n "$SWITCH" link set hbr-sw master br0
ip -n "$SWITCH" link set hbr-sw up

# --- verify -----------------------------------------------------------------------------------
# A host re-made by this run has a new MAC: neighbour entries for the old one would make the checks
# below fail for tens of seconds.
ip neigh flush dev "$ROOT_IF" 2>/dev/null || true
for ns in "${HOSTS[@]}"; do ip -n "$ns" neigh flush dev eth0 2>/dev/null || true; done
TIMEOUT_S=${HOSTS_UP_TIMEOUT_S:-10}
deadline=$((SECONDS + TIMEOUT_S))
until failed=$(check); do
  ((SECONDS < deadline)) || die "$failed does not answer ping within ${TIMEOUT_S}s"
  sleep 0.2
done
step "up: hn1 $PREFIX.1, hn2 $PREFIX.2 (eth0 in each), root $PREFIX.254 on $ROOT_IF, bridge br0 in $SWITCH"
