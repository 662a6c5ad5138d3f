#!/usr/bin/env bash
# Starts encoder + pd + proxy, then runs tests/serve/openai_client.mjs (the npm `openai`
# package, installed here on first use) against the proxy.
#   openai_client_test.sh ECX_BINARY SOURCE_DIR WORK_DIR
set -euo pipefail
bin=$1 src=$2 work=$3
mkdir -p "$work"
if [ ! -d "$work/node_modules/openai" ]; then
  (cd "$work" && timeout 300 npm install --no-audit --no-fund --silent openai@4)
fi
cp "$src/openai_client.mjs" "$work/"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# start ROLE OUTFILE ARGS...: runs a service on a free port; prints its URL once it listens.
start() {
  local role=$1 out=$2; shift 2
  "$bin" serve "$role" --port 0 --ec-config '{"connector":"p2p","extra":{"pool_bytes":"64MiB"}}' "$@" >"$out" 2>"$out.err" &
  pids+=($!)
  local line
  line=$(grep -m1 "listening on" <(timeout 60 tail -n +1 -F "$out" 2>/dev/null </dev/null)) || {
    echo "$role did not start:" >&2; cat "$out.err" >&2; exit 1; }
  echo "${line##* }"
}
e=$(start encoder "$work/e.out")
pd=$(start pd "$work/pd.out")
proxy=$(start proxy "$work/proxy.out" --encoders "$e" --pd "$pd")
node "$work/openai_client.mjs" "$proxy/v1" "$src/../data/sample.png"
echo "openai client test: 1 passed, 0 failed"
