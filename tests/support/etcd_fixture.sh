#!/usr/bin/env bash
# Starts or stops the etcd the membership tests use (a CTest fixture): one member on
# loopback, its data in DIR (wiped on start).
#   etcd_fixture.sh start CLIENT_PORT PEER_PORT DIR -> returns once etcd serves clients
#   etcd_fixture.sh start-secure CLIENT_PORT PEER_PORT DIR -> the same over TLS, with
#       authentication on: DIR/ca.pem signs its certificate (for 127.0.0.1), user "ecx"
#       (password in DIR/ecx.password, mode 600) may read and write /ecx-test, and tokens
#       live 2 s (etcd's --auth-token-ttl), so the tests see them expire
#   etcd_fixture.sh stop  CLIENT_PORT PEER_PORT DIR
set -euo pipefail
action=$1 port=$2 peer_port=$3 dir=$4
scheme=http
tls_flags=()
if [ "$action" = start-secure ]; then
  command -v openssl >/dev/null || { echo "openssl not found" >&2; exit 1; }
  mkdir -p "$dir"
  rm -f "$dir"/*.pem "$dir"/*.srl "$dir"/*.csr
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=ecx test CA" \
    -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$dir/server-key.pem" -out "$dir/server.csr" 2>/dev/null
  openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
    -CAcreateserial -days 2 -out "$dir/server.pem" \
    -extfile <(printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n') 2>/dev/null
  scheme=https
  tls_flags=(--cert-file "$dir/server.pem" --key-file "$dir/server-key.pem"
             --auth-token "simple" --auth-token-ttl 2)
  action=start
  secure=1
fi
case "$action" in
  start)
    command -v etcd >/dev/null || { echo "etcd not found (Debian: etcd-server; scripts/deps)" >&2; exit 1; }
    mkdir -p "$dir"
    "$0" stop "$port" "$peer_port" "$dir"  # a server left over from an interrupted run
    rm -rf "$dir/data" "$dir/etcd.log"
    url="$scheme://127.0.0.1:$port"
    # The daemon keeps no descriptor of ours open (a build lock held by the caller would
    # otherwise stay held for as long as the server runs).
    (
      for fd in $(ls /proc/$BASHPID/fd); do
        if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
      done
      exec setsid etcd --name ecx-test --data-dir "$dir/data" \
        --listen-client-urls "$url" --advertise-client-urls "$url" "${tls_flags[@]}" \
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
    if [ "${secure:-0}" = 1 ]; then
      ctl=(etcdctl --endpoints "$url" --cacert "$dir/ca.pem" --dial-timeout 5s)
      password=$(openssl rand -hex 16)
      (umask 077; printf '%s\n' "$password" >"$dir/ecx.password")
      ETCDCTL_API=3 "${ctl[@]}" user add root --new-user-password "$(openssl rand -hex 16)" >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" user add ecx --new-user-password "$password" >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" role add ecx-test >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" role grant-permission ecx-test --prefix=true readwrite /ecx-test/ >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" user grant-role ecx ecx-test >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" role add root >/dev/null 2>&1 || true  # built in on some versions
      ETCDCTL_API=3 "${ctl[@]}" user grant-role root root >/dev/null
      ETCDCTL_API=3 "${ctl[@]}" auth enable >/dev/null
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
