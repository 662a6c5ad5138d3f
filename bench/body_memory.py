#!/usr/bin/env python3
"""How much memory large request bodies cost a service, against its body budget.

Starts an E, a PD and a proxy (`build/ecx serve ...`, loopback) and sends N concurrent
chat requests through the proxy, each holding --images large PNGs (a body of about --mib
MiB). E refuses each image before encoding it (its tokens pass --max-model-len), so what is
measured is what holding, parsing and forwarding the bodies costs. Reports, per service,
the peak RSS (VmHWM) over the one before the burst, as a multiple of the body bytes the
service held at once at most and against --max-buffered-bytes, as JSON on stdout.

    .venv/bin/python bench/body_memory.py --requests 24 --mib 60 --budget-gib 2
"""

import argparse
import base64
import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib


def png_of_noise(width, height, seed):
    """An RGB PNG of pseudo-random pixels (incompressible: its size is its pixels)."""
    rows = bytearray()
    state = seed or 1
    row_bytes = width * 3
    for _ in range(height):
        rows.append(0)  # filter: none
        # xorshift bytes, a row at a time (fast enough for tens of MiB)
        state ^= (state << 13) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 7
        state ^= (state << 17) & 0xFFFFFFFFFFFFFFFF
        rows += (state.to_bytes(8, "little") * (row_bytes // 8 + 1))[:row_bytes]
        rows[-row_bytes] ^= len(rows) & 0xFF
    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(rows), 0)) + chunk(b"IEND", b""))


def start(binary, role, port, flags):
    ec = json.dumps({"connector": "p2p", "extra": {"pool_bytes": "96MiB"}})
    argv = [binary, "serve", role, "--host", "127.0.0.1", "--port", str(port),
            "--ec-config", ec, "--connector", "p2p"] + flags
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    for line in proc.stdout:
        if "listening on" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{role} did not start")


def rss_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="build/ecx")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--mib", type=int, default=60)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=18400)
    args = ap.parse_args()
    budget = int(args.budget_gib * (1 << 30))
    common = ["--max-buffered-bytes", str(budget), "--max-body-bytes", str(96 << 20)]
    secret = base64.b16encode(os.urandom(16)).decode()
    os.environ.setdefault("ECX_AUTH_TOKEN", secret)  # the services' deployment secret
    e = start(args.binary, "encoder", args.port, common + ["--max-model-len", "4096"])
    pd = start(args.binary, "pd", args.port + 1, common)
    proxy = start(args.binary, "proxy", args.port + 2, common + [
        "--encoders", f"http://127.0.0.1:{args.port}", "--pd", f"http://127.0.0.1:{args.port + 1}"])
    procs = {"proxy": proxy, "encoder": e, "pd": pd}
    try:
        # --images PNGs of about --mib / --images MiB each once in base64 (3 bytes a
        # pixel, 4/3 for base64); each below the proxy's 20 MiB limit of one image.
        side = int((args.mib / args.images * (1 << 20) * 3 / 4 / 3) ** 0.5)
        content = [{"type": "text", "text": "Describe:"}]
        for i in range(args.images):
            url = "data:image/png;base64," + base64.b64encode(png_of_noise(side, side, 7 + i)).decode()
            content.append({"type": "image_url", "image_url": {"url": url}})
        body = json.dumps({"model": "ecx-tiny-vl", "max_tokens": 4,
                           "messages": [{"role": "user", "content": content}]}).encode()
        before = {name: rss_kib(p.pid, "VmRSS") for name, p in procs.items()}
        statuses = []
        errors = {}  # the first error answer of each status
        lock = threading.Lock()

        def send():
            req = urllib.request.Request(f"http://127.0.0.1:{args.port + 2}/v1/chat/completions",
                                         data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    status = r.status
            except urllib.error.HTTPError as err:
                status = err.code
                with lock:
                    errors.setdefault(str(status), err.read(300).decode(errors="replace"))
            except Exception as err:  # noqa: BLE001 - reported, not raised
                status = str(err)
            with lock:
                statuses.append(status)

        t0 = time.time()
        threads = [threading.Thread(target=send) for _ in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        wall = time.time() - t0
        report = {"requests": args.requests, "body_mib": round(len(body) / (1 << 20), 1),
                  "budget_gib": args.budget_gib, "wall_s": round(wall, 1),
                  "statuses": {str(s): statuses.count(s) for s in set(statuses)},
                  "errors": errors,
                  "services": {}}
        admitted_at_once = min(args.requests, budget // (4 * len(body)))
        for name, p in procs.items():
            peak = rss_kib(p.pid, "VmHWM")
            grew = (peak - before[name]) * 1024
            report["services"][name] = {
                "rss_before_mib": round(before[name] / 1024),
                "peak_rss_mib": round(peak / 1024),
                "peak_over_budget": round(peak * 1024 / budget, 2),
                # Growth per body byte the budget lets it hold at once (4x charge).
                "growth_per_admitted_body_byte": round(grew / (admitted_at_once * len(body)), 2),
            }
        json.dump(report, sys.stdout, indent=2)
        print()
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
