#!/usr/bin/env bash
# Starts or stops the Redis server the store-connector tests use (a CTest fixture).
#   redis_fixture.sh start PORT DIR   -> runs redis-server, returns once it accepts connections
#   redis_fixture.sh stop PORT DIR
set -euo pipefail
action=$1 port=$2 dir=$3
case "$action" in
  start)
    mkdir -p "$dir"
    "$0" stop "$port" "$dir"  # a server left over from an interrupted run
    rm -f "$dir/redis.log"
    # The daemon keeps no descriptor of ours open (a build lock held by the caller would
    # otherwise stay held for as long as the server runs).
    (
      for fd in $(ls /proc/$BASHPID/fd); do
        if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
      done
      exec redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
        --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --daemonize yes
    )
    # Ready when the server says so in its log: follow the log (no polling loop), at
    # most 20 s. tail runs detached from our output so nothing waits for it.
    if ! grep -q -m1 "Ready to accept connections" \
        <(timeout 20 tail -n +1 -F "$dir/redis.log" 2>/dev/null </dev/null); then
      echo "redis-server on port $port did not become ready" >&2
      exit 1
    fi
    ;;
  stop)
    if [ -f "$dir/redis.pid" ]; then
      pid=$(cat "$dir/redis.pid")
      kill "$pid" 2>/dev/null || true
      # Wait for it to exit (and free the port) without polling: tail --pid.
      timeout 10 tail --pid="$pid" -f /dev/null || kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/redis.pid"
    fi
    ;;
  *) echo "usage: $0 start|stop PORT DIR" >&2; exit 2 ;;
esac
