#!/usr/bin/env python3
"""ecx across hosts: E x2 and PD x2 on test hosts of their own (network namespaces made by
scripts/hosts), the proxy and etcd on others, membership through etcd.

  1. A request is served through p2p over the backend named (--backend tcp|ucx): every
     item loaded from an encoder on another host (none recomputed), and the PDs' agents
     connected with that backend.
  2. One E is killed (SIGKILL) under load: no request hangs; each one succeeds (the PD
     recomputes, or the proxy re-routes) or ends in a clean 5xx within its deadline. The
     time from the kill to the proxy no longer listing the E is measured (lease TTL).
  3. A new E starts on another host, joins through etcd, and receives requests.
  4. Nothing is left pinned on the survivors (/metrics).

Run by CTest as root (multihost_epd_tcp, multihost_epd_ucx); it never skips. Only the
standard library: it runs before and without the project's venv.
"""
import argparse
import base64
import concurrent.futures
import json
import os
import secrets
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TTL_S = 3  # leases renewed every second; a busy machine must not lose one
HOSTS = 7  # etcd, proxy, E1, E2, PD1, PD2, the E that joins later


def log(msg):
    print(f"[multihost {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg):
    raise AssertionError(msg)


def png_data_url(seed, size=224):
    """A deterministic RGB PNG, different for every seed."""
    rows = bytearray()
    for y in range(size):
        rows.append(0)
        for x in range(size):
            rows += bytes(((x * 7 + seed * 13) & 255, (y * 5 + seed * 31) & 255,
                           ((x ^ y) + seed * 57) & 255))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = (b"\x89PNG\r\n\x1a\n" +
           chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)) +
           chunk(b"IDAT", zlib.compress(bytes(rows), 6)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_body(seeds, max_tokens=4):
    content = [{"type": "text", "text": "describe"}]
    content += [{"type": "image_url", "image_url": {"url": png_data_url(s)}} for s in seeds]
    return json.dumps({"model": "ecx-tiny-vl", "max_tokens": max_tokens, "ignore_eos": True,
                       "messages": [{"role": "user", "content": content}]}).encode()


def http(url, body=None, timeout=10):
    """(status, text); status 0 with the error text when no answer came."""
    req = urllib.request.Request(url, data=body, method="POST" if body else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except Exception as e:  # refused, reset, timed out
        return 0, f"{type(e).__name__}: {e}"


def metric(url, name, labels=None, required=False):
    """Sum of the series of `name` (with `labels` in their label set) in url/metrics;
    with `required`, a metric that is not there at all fails."""
    status, text = http(url + "/metrics", timeout=5)
    if status != 200:
        fail(f"{url}/metrics answered {status}: {text[:200]}")
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key != name and not key.startswith(name + "{"):
            continue
        if labels and labels not in key:
            continue
        total += float(value)
        found = True
    if required and not found:
        fail(f"{url}/metrics has no {name}{'{' + labels + '}' if labels else ''}")
    return total


def wait_until(what, predicate, timeout_s, interval_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    fail(f"timed out after {timeout_s} s waiting for {what}")


def host_address(netns):
    out = subprocess.run(["ip", "-n", netns, "-4", "-o", "addr", "show", "scope", "global"],
                         check=True, capture_output=True, text=True, timeout=10).stdout
    for line in out.splitlines():
        if " inet " in line:
            return line.split(" inet ")[1].split("/")[0]
    fail(f"{netns} has no IPv4 address")


class Stack:
    """The processes of one run, all stopped (and the hosts torn down) at the end."""

    def __init__(self, ecx, backend, work):
        self.ecx, self.backend, self.work = ecx, backend, work
        self.procs = {}  # name -> Popen
        self.urls = {}   # name -> http://HOST:PORT
        self.etcd_url = None

    def spawn(self, name, netns, argv, ready):
        """Starts argv in netns; waits (60 s at most) for a stdout line containing ready.
        A thread copies its output to NAME.log, so it never blocks on a full pipe."""
        logf = open(os.path.join(self.work, name + ".log"), "w")
        p = subprocess.Popen(["ip", "netns", "exec", netns] + argv, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.procs[name] = p
        lines = queue.Queue()

        def copy():
            for line in p.stdout:
                logf.write(line)
                logf.flush()
                lines.put(line)
            lines.put(None)  # EOF

        threading.Thread(target=copy, daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                fail(f"{name}: no '{ready}' line within 60 s (see {logf.name})")
            if line is None:
                fail(f"{name} exited before it was ready (see {logf.name})")
            if ready in line:
                return line.strip()

    def start_etcd(self, netns):
        addr = host_address(netns)
        self.etcd_url = f"http://{addr}:2379"
        logf = open(os.path.join(self.work, "etcd.log"), "w")
        self.procs["etcd"] = subprocess.Popen(
            ["ip", "netns", "exec", netns, "etcd", "--name", "multihost",
             "--data-dir", os.path.join(self.work, "etcd"),
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", "http://127.0.0.1:2380",
             "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "multihost=http://127.0.0.1:2380"],
            stdout=logf, stderr=logf)
        wait_until("etcd health", lambda: http(self.etcd_url + "/health")[0] == 200, 20, 0.1)
        log(f"etcd on {netns} at {self.etcd_url}")

    def start_service(self, name, role, netns):
        addr = host_address(netns)
        extra = {"tcp_host": addr, "pool_bytes": "256MiB"}
        if self.backend == "ucx":
            extra.update({"ucx": True, "ucx_tls": "tcp"})
        argv = [self.ecx, "serve", role, "--host", addr, "--port", "0", "--log-level", "info",
                "--ec-config", json.dumps({"connector": "p2p", "extra": extra}),
                "--etcd", self.etcd_url, "--etcd-ttl", str(TTL_S)]
        line = self.spawn(name, netns, argv, " listening on http://")
        self.urls[name] = line.split(" listening on ")[1].split()[0]
        log(f"{name} ({role}) on {netns} at {self.urls[name]}")

    def start_proxy(self, netns):
        addr = host_address(netns)
        argv = [self.ecx, "serve", "proxy", "--host", addr, "--port", "0", "--log-level", "info",
                "--connector", "p2p", "--etcd", self.etcd_url]
        line = self.spawn("proxy", netns, argv, " listening on http://")
        self.urls["proxy"] = line.split(" listening on ")[1].split()[0]
        log(f"proxy on {netns} at {self.urls['proxy']}")

    def upstreams(self):
        status, text = http(self.urls["proxy"] + "/v1/upstreams", timeout=5)
        if status != 200:
            fail(f"/v1/upstreams answered {status}: {text[:200]}")
        return json.loads(text)["upstreams"]

    def listed(self, name):
        return any(u["url"] == self.urls[name] for u in self.upstreams())

    def exited(self, but=()):
        """'NAME: how it ended' for each process that is no longer running, but those named."""
        out = []
        for name, p in self.procs.items():
            code = p.poll()
            if name in but or code is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            out.append(f"{name}: {how}")
        return out

    def stop(self):
        for name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def chat(stack, seeds, timeout=60):
    status, text = http(stack.urls["proxy"] + "/v1/chat/completions", chat_body(seeds),
                        timeout=timeout)
    answer = None
    if status == 200:
        answer = json.loads(text)
    return status, text, answer


def recomputed(answer):
    return int(answer.get("ecx_timings", {}).get("items_recomputed", 0))


def step_served(stack):
    for i in range(4):
        seeds = [1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i]
        status, text, answer = chat(stack, seeds)
        if status != 200:
            fail(f"request {i}: HTTP {status}: {text[:300]}")
        if recomputed(answer) != 0:
            fail(f"request {i}: {recomputed(answer)} items recomputed; expected all loaded "
                 f"over p2p: {answer.get('ecx_timings')}")
    connects = {b: sum(metric(stack.urls[pd], "ecx_transfer_connects_total", f'backend="{b}"')
                       for pd in ("pd1", "pd2")) for b in ("shm", "tcp", "ucx")}
    log(f"step 1: 4 requests x 3 images served, none recomputed; PD connects {connects}")
    if connects[stack.backend] < 1 or connects["shm"] != 0:
        fail(f"expected the PDs to reach the encoders over {stack.backend} (and never shm "
             f"across hosts), got {connects}")


def step_kill_under_load(stack):
    outcomes = {"ok": 0, "recomputed_items": 0, "5xx": 0}
    seeds = iter(range(2000, 100000, 2))
    deadline_s = 60

    def one():
        s = next(seeds)
        t0 = time.monotonic()
        status, text, answer = chat(stack, [s, s + 1], timeout=deadline_s)
        return status, text, answer, time.monotonic() - t0

    def e1_busy():
        return any(u["url"] == stack.urls["e1"] and u["in_flight"] > 0
                   for u in stack.upstreams())

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        # Under load: the kill lands while the proxy has encodes in flight on e1.
        futures = [pool.submit(one) for _ in range(12)]
        wait_until("an encode in flight on e1", e1_busy, 30, 0.002)
        victim = stack.procs["e1"]
        victim.kill()
        killed_at = time.monotonic()
        log("step 2: e1 killed (SIGKILL) under load")
        futures += [pool.submit(one) for _ in range(18)]
        gone_at = wait_until("the proxy to stop listing e1", lambda: (
            time.monotonic() if not stack.listed("e1") else None), TTL_S + 10)
        removal_s = gone_at - killed_at
        for f in futures:
            status, text, answer, took = f.result(timeout=deadline_s + 30)
            if status == 200:
                outcomes["ok"] += 1
                outcomes["recomputed_items"] += recomputed(answer)
            elif 500 <= status < 600:
                outcomes["5xx"] += 1
                json.loads(text)  # a clean error is JSON
            else:
                fail(f"a request under the kill ended with {status} after {took:.1f} s: "
                     f"{text[:300]}")
    # A peer's death ends its transfers, never another service.
    dead = stack.exited(but=("e1",))
    if dead:
        fail(f"after e1's death under load: {', '.join(dead)}")
    log(f"step 2: {len(futures)} requests: {outcomes}; e1 left the proxy's set "
        f"{removal_s * 1000:.0f} ms after its death (lease TTL {TTL_S} s)")
    print(json.dumps({"metric": "membership_removal_ms", "value": round(removal_s * 1000),
                      "ttl_s": TTL_S, "backend": stack.backend}), flush=True)
    # The functional bound (the lease ends, the watch tells the proxy); the figure itself
    # is reported above, and in docs/BENCHMARKS.md.
    if removal_s > TTL_S + 5:
        fail(f"e1 still listed {removal_s:.1f} s after its death")


def step_join(stack, netns):
    started = time.monotonic()
    stack.start_service("e3", "encoder", netns)
    wait_until("the proxy to list e3", lambda: stack.listed("e3"), 10)
    log(f"step 3: e3 listed {1000 * (time.monotonic() - started):.0f} ms after it was "
        "started (includes its start)")
    for i in range(40):
        status, text, _ = chat(stack, [50000 + i])
        if status != 200:
            fail(f"request to reach e3: HTTP {status}: {text[:300]}")
        if metric(stack.urls["e3"], "ecx_encode_requests_total") > 0:
            log(f"step 3: e3 received requests after {i + 1} requests")
            return
    fail("e3 received none of 40 requests with new images")


def step_nothing_pinned(stack):
    def pins():
        return {name: metric(stack.urls[name], "ecx_pool_pins", required=True)
                for name in ("e2", "e3")} | {
            name: metric(stack.urls[name], "ecx_cache_pins", required=True)
            for name in ("pd1", "pd2")}
    left = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = pins()
        if not any(left.values()):
            break
        time.sleep(0.2)
    if any(left.values()):
        fail(f"pins left on the survivors: {left}")
    log(f"step 4: nothing pinned on the survivors: {left}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ecx", required=True, help="the ecx binary")
    ap.add_argument("--backend", choices=["tcp", "ucx"], default="tcp")
    ap.add_argument("--rtt-ms", default="1")
    args = ap.parse_args()
    hosts = os.path.join(ROOT, "scripts", "hosts")
    work = tempfile.mkdtemp(prefix="ecx-multihost-")
    os.environ["ECX_AUTH_TOKEN"] = secrets.token_hex(32)  # the deployment's secret
    os.environ["ECX_BIN"] = os.path.abspath(args.ecx)  # the relay scripts/hosts starts
    # A service that faults prints its stack into its log (UCX's crash handler, which ecx
    # otherwise leaves out: src/transfer/ucp_library.h). Seen once in ~30 runs: pd1 ended
    # without a line when e1 was killed, over ucx.
    os.environ.setdefault("UCX_HANDLE_ERRORS", "bt")
    subprocess.run([hosts, "up", str(HOSTS), "--rtt-ms", args.rtt_ms], check=True, timeout=120)
    stack = Stack(os.path.abspath(args.ecx), args.backend, work)
    try:
        stack.start_etcd("ecx-h1")
        stack.start_service("e1", "encoder", "ecx-h3")
        stack.start_service("e2", "encoder", "ecx-h4")
        stack.start_service("pd1", "pd", "ecx-h5")
        stack.start_service("pd2", "pd", "ecx-h6")
        stack.start_proxy("ecx-h2")
        wait_until("the proxy to list 2 E and 2 PD",
                   lambda: len(stack.upstreams()) == 4, 10)
        step_served(stack)
        step_kill_under_load(stack)
        step_join(stack, "ecx-h7")
        step_nothing_pinned(stack)
        log("passed")
    except AssertionError as e:
        dead = stack.exited(but=("e1",))
        log(f"FAILED: {e} (logs in {work})" + (f"; exited: {', '.join(dead)}" if dead else ""))
        return 1
    finally:
        stack.stop()
        subprocess.run([hosts, "down"], timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
