"""python bench/python/bench.py: the Python connector against the C++ one, in one run.

Loads requests of 3 x 1600 KiB through ecx.Connector (Python, a consumer over the C++
core), from the same producer process the C++ benchmark uses (`ecx bench connector-peer`),
then runs `ecx bench transfer --connectors p2p:pull` with the same items and requests,
and reports both p50s and their ratio. The Python side times exactly what the C++ side
times: one load call per request; the bytes are checked outside the timed part.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ecx
from ecx._ecx import fill_pattern

ITEM_BYTES = 1600 * 1024
WARMUP = 3


def find_ecx_binary(given: str | None) -> str:
    if given:
        return given
    here = Path(__file__).resolve()
    for root in [Path.cwd(), *here.parents]:
        candidate = root / "build" / "ecx"
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("ecx.bench: no build/ecx found; pass --ecx PATH")


class Producer:
    """`ecx bench connector-peer`: a C++ producer connector driven over stdin."""

    def __init__(self, exe: str, config: dict):
        self.proc = subprocess.Popen([exe, "bench", "connector-peer", "--config", json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().strip()
        if not ready.startswith("ok"):
            raise RuntimeError(f"producer did not start: {ready!r}")

    def command(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        if not reply.startswith("ok"):
            raise RuntimeError(f"producer: {reply}")
        return reply[3:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def python_p50_us(exe: str, items: int, requests: int) -> float:
    tag = f"{os.getpid()}"
    token = f"pybench-{tag}"
    extra = {"pool_bytes": 64 << 20, "load_timeout_ms": 30000, "compat_hash": "bench",
             "mode": "pull", "backend": "auto", "auth_token": token}
    producer = Producer(exe, {"connector": "p2p", "role": "producer",
                              "extra": {**extra, "engine_id": f"pybench-e-{tag}"}})
    consumer = ecx.Connector(json.dumps({
        "connector": "p2p", "role": "consumer",
        "extra": {**extra, "engine_id": f"pybench-pd-{tag}", "failure_policy": "fail"}}))
    shape = [ITEM_BYTES // 4096, 2048]
    expected = np.empty(ITEM_BYTES, dtype=np.uint8)
    samples = []
    try:
        for r in range(requests + WARMUP):
            batch, seeds = [], []
            for i in range(items):
                mm_hash = f"pybench-{tag}-{r}-{i}"
                seed = 1000003 * r + i
                saved = producer.command(f"save {mm_hash} {seed} BF16 {shape[0]},{shape[1]}")
                # Parsed before the timed load, as the C++ benchmark does.
                batch.append(ecx.Item(mm_hash, "BF16", shape, ecx.TransferParams.from_json(saved)))
                seeds.append(seed)
            request_id = f"pybench-{r}"
            t0 = time.perf_counter_ns()
            outcome = consumer.load(request_id, batch, 30000)
            elapsed = time.perf_counter_ns() - t0
            if not outcome["ok"]:
                raise RuntimeError(f"load failed: {outcome['code']} {outcome['message']}")
            for item, seed in zip(batch, seeds):
                fill_pattern(expected, seed)
                if not np.array_equal(consumer.loaded(request_id, item.mm_hash), expected):
                    raise RuntimeError(f"wrong bytes for {item.mm_hash}")
            consumer.request_finished(request_id)
            if r >= WARMUP:
                samples.append(elapsed / 1000)
    finally:
        producer.close()
    return statistics.median(samples)


def cpp_p50_us(exe: str, items: int, requests: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "transfer.json"
        subprocess.run([exe, "bench", "transfer", "--backends", "shm", "--modes", "pull",
                        "--sizes", "64KiB", "--batch", "1", "--iters", "5",
                        "--connectors", "p2p:pull", "--items", str(items),
                        "--item-size", "1600KiB", "--requests", str(requests),
                        "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["connectors"]
    row = next(r for r in rows if r["connector"] == "p2p:pull")
    if row.get("error"):
        raise RuntimeError(f"C++ connector row failed: {row['error']}")
    return float(row["p50_us"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/python/bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--ecx", help="the ecx binary (default: build/ecx of this checkout)")
    ap.add_argument("--items", type=int, default=3)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="alternated Python/C++ rounds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    exe = find_ecx_binary(args.ecx)
    rounds = []
    for _ in range(args.rounds):
        py = python_p50_us(exe, args.items, args.requests)
        cpp = cpp_p50_us(exe, args.items, args.requests)
        rounds.append({"python_p50_us": py, "cpp_p50_us": cpp, "ratio": py / cpp})
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"p2p pull, {args.items} x 1600 KiB per request, {args.requests} requests, "
          f"{args.rounds} alternated rounds")
    print(f"{'round':>5} {'Python p50 (us)':>16} {'C++ p50 (us)':>13} {'ratio':>7}")
    for i, r in enumerate(rounds):
        print(f"{i:>5} {r['python_p50_us']:>16.1f} {r['cpp_p50_us']:>13.1f} {r['ratio']:>6.2f}x")
    print(f"median ratio (Python / C++): {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"items": args.items, "item_bytes": ITEM_BYTES,
                                               "requests": args.requests, "rounds": rounds,
                                               "median_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
