"""bench/python/peers.py: the NIXL and Mooncake rows of `ecx bench peers`.

Whether the peers run here depends on the machine (their wheels, installed on demand by
`peers.py install`); what never depends on it is the contract: every case gives its rows,
with integer items/item_bytes, and a row either verified every byte it timed or says why
it could not run, and the command exits 0.
"""
import json
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parents[2] / "bench" / "python" / "peers.py"
FIELDS = {"system", "transport", "variant", "items", "item_bytes", "p50_us", "p99_us", "gbps",
          "control_rtts_per_item", "verified_bytes", "error"}
# Every case peers.py runs by default (no --systems): nixl-eccpu (vLLM's ECCPUConnector
# protocol) included, so a system missing from peers.py's default list fails here.
CASES = {(s, t, v) for s in ("nixl", "nixl-2step", "nixl-eccpu") for t in ("shm", "tcp") for v in ("peer", "none")} | \
        {("mooncake", "tcp", "read"), ("mooncake", "tcp", "write")}
# One control round trip per item: nixl-2step's address query, nixl-eccpu's XferReq/XferAck.
RTTS_PER_ITEM = {"nixl-2step": 1, "nixl-eccpu": 1}


def run_peers(python: str, tmp_path: Path, iters: int) -> list[dict]:
    out = tmp_path / "peers.json"
    proc = subprocess.run([python, str(PEERS), "run", "--no-install", "--iters", str(iters),
                           "--sizes", "1x64KiB,2x100000", "--case-timeout", "60", "--json", str(out),
                           "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert {(r["system"], r["transport"], r["variant"]) for r in results} == CASES
    assert len(results) == 2 * len(CASES)
    for r in results:
        assert set(r) == FIELDS, r
        assert type(r["items"]) is int and type(r["item_bytes"]) is int
        assert r["control_rtts_per_item"] == RTTS_PER_ITEM.get(r["system"], 0), r
    return results


def test_every_row_is_verified_or_says_why(tmp_path):
    iters = 3
    for r in run_peers(sys.executable, tmp_path, iters):
        if r["error"] is None:
            assert r["verified_bytes"] == iters * r["items"] * r["item_bytes"], r
            assert r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] and r["gbps"] > 0, r
        else:
            assert isinstance(r["error"], str) and r["error"], r
            assert r["verified_bytes"] == 0 and r["p50_us"] is None, r


def test_a_python_without_the_peers_gets_rows_that_say_so(tmp_path):
    # Debian's python3 has neither wheel: the rows stay, each naming what is missing.
    for r in run_peers("/usr/bin/python3", tmp_path, 2):
        assert "is not installed" in r["error"], r
