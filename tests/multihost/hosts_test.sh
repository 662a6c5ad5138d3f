#!/usr/bin/env bash
# multihost_hosts: scripts/hosts itself (docs/HOSTS.md).
#   1. `up 2 --rtt-ms 2` makes two hosts that reach each other, and records the RTT.
#   2. The probe between them measures about that RTT, both ways (a loose sanity bound:
#      at least half of it, so the relay does delay; well under 25x it).
#   3. Agents on the two hosts pick tcp under `auto` (not shm: two namespaces are two
#      hosts), and bench transfer moves verified bytes across them, p2p connector too.
#   4. `down` leaves no namespace, veth, relay or state behind.
# Run by CTest as root (label multihost); it never skips.
set -euo pipefail

ecx=${1:?usage: hosts_test.sh ECX_BINARY}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
hosts="$repo/scripts/hosts"
export ECX_BIN=$ecx
work=$(mktemp -d)
trap '"$hosts" down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

fail() { echo "multihost_hosts: FAIL: $*" >&2; exit 1; }
step() { echo "multihost_hosts: $*"; }

step "1. up 2 hosts, RTT 2 ms"
"$hosts" up 2 --rtt-ms 2
[ "$(cat /run/ecx-hosts/rtt_ms)" = 2 ] || fail "rtt_ms state file says $(cat /run/ecx-hosts/rtt_ms)"
for ns in ecx-h1 ecx-h2 ecx-router; do
  ip netns list | grep -q "^$ns\b" || fail "namespace $ns missing"
done
[ "$(ip netns exec ecx-h2 ip -4 -o addr show dev eth0 | awk '{print $4}')" = 10.77.0.2/24 ] ||
  fail "ecx-h2 has no address 10.77.0.2/24"
"$hosts" status

step "2. probe both ways"
for pair in "1 2" "2 1"; do
  # shellcheck disable=SC2086
  out=$("$hosts" probe $pair)
  echo "$out"
  measured=$(sed -n 's/.*measured median \([0-9.]*\) ms.*/\1/p' <<<"$out")
  [ -n "$measured" ] || fail "no measured RTT in: $out"
  python3 -c "import sys; m = float(sys.argv[1]); sys.exit(0 if 1.0 <= m <= 50.0 else 1)" \
    "$measured" || fail "probe $pair measured $measured ms for a configured RTT of 2 ms"
done

step "3. bench transfer from ecx-h1 with its producer on ecx-h2"
ip netns exec ecx-h1 "$ecx" bench transfer --peer-netns ecx-h2 --modes pull,push \
  --sizes 64KiB --batch 1,3 --iters 5 --connectors p2p:pull --requests 3 --items 2 \
  --item-size 64KiB --json "$work/transfer.json"
python3 - "$work/transfer.json" <<'EOF'
import json, sys
out = json.load(open(sys.argv[1]))
def check(ok, what):
    if not ok:
        sys.exit(f"multihost_hosts: FAIL: {what}: {json.dumps(out)[:2000]}")
check(out.get("peer_netns") == "ecx-h2", "peer_netns is not ecx-h2")
check(out.get("auto_backend") == "tcp", "auto did not pick tcp between two hosts")
check(out["results"] and all(r["backend"] == "tcp" for r in out["results"]), "no tcp rows")
check(all(r.get("verified_bytes", 1) > 0 for r in out["results"]), "unverified rows")
conn = out.get("connectors", [])
check(conn and all(not r.get("error") for r in conn), "a connector row failed")
EOF

step "4. down"
relay_pid=$(cat /run/ecx-hosts/relay.pid)
"$hosts" down
# Stopped: gone, or a zombie its new parent has not reaped yet.
state=$(awk '/^State:/ {print $2}' "/proc/$relay_pid/status" 2>/dev/null || true)
[ -z "$state" ] || [ "$state" = Z ] || fail "the relay (pid $relay_pid) still runs after down"
relay_left=$(ip netns list | grep -c '^ecx-' || true)
[ "$relay_left" = 0 ] || fail "namespaces left after down: $(ip netns list)"
ip link show ecx-root >/dev/null 2>&1 && fail "veth ecx-root left after down"
[ ! -e /run/ecx-hosts ] || fail "/run/ecx-hosts left after down"
step "ok"
