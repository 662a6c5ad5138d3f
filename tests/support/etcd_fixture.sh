#!/usr/bin/env bash
# Starts or stops the etcd the membership tests use (a CTest fixture): one member on
# loopback, its data in DIR (wiped on start).
#   etcd_fixture.sh start CLIENT_PORT PEER_PORT DIR -> returns once etcd serves clients
#   etcd_fixture.sh stop  CLIENT_PORT PEER_PORT DIR
set -euo pipefail
action=$1 port=$2 peer_port=$3 dir=$4
case "$action" in
  start)
    command -v etcd >/dev/null || { echo "etcd not found (Debian: etcd-server; scripts/deps)" >&2; exit 1; }
    mkdir -p "$dir"
    "$0" stop "$port" "$peer_port" "$dir"  # a server left over from an interrupted run
    rm -rf "$dir/data" "$dir/etcd.log"
    # The daemon keeps no descriptor of ours open (a build lock held by the caller would
    # otherwise stay held for as long as the server runs).
    (
      for fd in $(ls /proc/$BASHPID/fd); do
        if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
      done
      exec setsid etcd --name ecx-test --data-dir "$dir/data" \
        --listen-client-urls "http://127.0.0.1:$port" \
        --advertise-client-urls "http://127.0.0.1:$port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
        --initial-cluster "ecx-test=http://127.0.0.1:$peer_port" \
        </dev/null >"$dir/etcd.log" 2>&1 &
      echo $! >"$dir/etcd.pid"
    )
    # Ready when etcd says so in its log: follow the log (no polling loop), at most 20 s.
    if ! grep -q -m1 "ready to serve client requests" \
        <(timeout 20 tail -n +1 -F "$dir/etcd.log" 2>/dev/null </dev/null); then
      echo "etcd on port $port did not become ready:" >&2
      tail -n 20 "$dir/etcd.log" >&2 || true
      exit 1
    fi
    ;;
  stop)
    if [ -f "$dir/etcd.pid" ]; then
      pid=$(cat "$dir/etcd.pid")
      kill "$pid" 2>/dev/null || true
      # Wait for it to exit (and free the ports) without polling: tail --pid.
      timeout 10 tail --pid="$pid" -f /dev/null || kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/etcd.pid"
    fi
    ;;
  *) echo "usage: $0 start|stop CLIENT_PORT PEER_PORT DIR" >&2; exit 2 ;;
esac
