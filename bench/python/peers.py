"""The real NIXL and Mooncake engines, measured the way `ecx bench peers` measures ecx.

    python bench/python/peers.py install            # pip-install the pinned peers into this venv
    python bench/python/peers.py check              # what is installed / missing (JSON)
    python bench/python/peers.py run --json FILE    # measure; rows as in docs/results/HISTORY.md §8

(The file runs on its own, without ecx's C++ module, from any checkout's .venv. It is not
part of the ecx wheel: the benchmark harness lives in bench/python/.)

Every case runs two processes (peers_worker.py) started by `run`: a *target* holding
registered DRAM filled with a known pattern, and an *initiator* that moves it and times each
request; the bytes moved are compared with the pattern outside the timed part, every
iteration. Cases:

  nixl        UCX backend, one READ of all the request's items (prepared descriptor lists,
              one transfer handle per request, a notification as vLLM's NIXL connector
              sends), polled with check_xfer_state to DONE. 0 control round trips per item.
  nixl-2step  the seed's protocol on the real API: per item an address query over ZMQ
              (REQ/REP), then a NIXL READ of that item, then waiting for it. 1 per item.
  nixl-eccpu  vLLM's ECCPUConnector protocol on the real API (its session.py/protocol.py, rebuilt
              in peers_worker.py without vLLM): per item one XferReq/XferAck over ZMQ
              DEALER/ROUTER (msgpack; the ack carries the block indices, the producer's NIXL
              metadata and its region's block descriptors), then one NIXL READ of the item's
              8 KiB blocks from a /dev/shm region with a "{session}:{mm_hash}" notification,
              polled to DONE; a request's XferReqs go out together. 1 per item.
  mooncake    Transfer Engine, P2PHANDSHAKE (no etcd), protocol tcp,
              batch_transfer_sync_read / _write of all the request's items. 0 per item.

variant: `peer`/`none` is NIXL's UCX `ucx_error_handling_mode` (peer is its default);
transport: `shm` lets UCX pick (UCX_TLS unset: same host), `tcp` sets UCX_TLS=tcp; Mooncake
rows are `tcp` (its CPU build has no shared-memory transport). A case that cannot run gives
rows with `error` set; `run` never raises for a peer's failure and exits 0.
"""
import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PINS = Path(__file__).with_name("peers_requirements.txt")
# Debian packages the issue names for Mooncake; only those whose libraries engine.so links
# are needed on this machine (ldd decides), the rest are reported, not required.
DEBIAN_PACKAGES = ["libcurl4", "libibverbs1", "rdma-core", "librdmacm1", "libnuma1", "liburing2"]
KIB = 1024
DEFAULT_SIZES = "1x1600KiB,3x1600KiB,1x8MiB"
WORKER = Path(__file__).with_name("peers_worker.py")
ROW_FIELDS = ["system", "transport", "variant", "items", "item_bytes", "p50_us", "p99_us",
              "gbps", "control_rtts_per_item", "verified_bytes", "error"]


# ---------------------------------------------------------------- install / check

def _pins() -> list[tuple[str, str]]:
    if not PINS.is_file():
        raise SystemExit(f"ecx.peers: {PINS} not found; run {Path(__file__).name} from the repository checkout")
    pins = []
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins.append((name, version))
    return pins


def check() -> dict:
    """What the peers need that this interpreter lacks: pins, libraries, Debian packages."""
    from importlib import metadata
    missing = []
    for name, version in _pins():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            missing.append(f"{name}=={version}" + (f" (have {have})" if have else ""))
    unresolved = []
    try:
        import importlib.util
        spec = importlib.util.find_spec("mooncake")
        if spec and spec.submodule_search_locations:
            engine = Path(list(spec.submodule_search_locations)[0]) / "engine.so"
            out = subprocess.run(["ldd", str(engine)], capture_output=True, text=True, timeout=30).stdout
            unresolved = [line.split()[0] for line in out.splitlines() if "not found" in line]
    except Exception as e:  # noqa: BLE001 - a report, not a failure
        unresolved = [f"ldd failed: {e}"]
    absent = []
    for p in DEBIAN_PACKAGES:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
        if "install ok installed" not in r.stdout:
            absent.append(p)
    return {"python": sys.executable, "requirements": str(PINS), "missing_pins": missing,
            "mooncake_unresolved_libraries": unresolved, "debian_packages_absent": absent}


class _venv_lock:
    """scripts/deps' lock on the project venv (<repo>/.venv), so that installing the peers never
    races a rebuild of the venv; a no-op for any other environment."""

    def __init__(self, timeout_s: float):
        import hashlib
        prefix = Path(sys.prefix)
        self.path = None
        if prefix.name == ".venv":
            digest = hashlib.sha256((str(prefix.parent) + "\n").encode()).hexdigest()[:16]
            self.path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ecx-venv-{digest}.lock"
        self.timeout_s = timeout_s

    def __enter__(self):
        import fcntl
        if self.path is None:
            return self
        self.file = open(self.path, "a")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.path} still held after {self.timeout_s:.0f} s (scripts/deps?)")
                time.sleep(0.2)

    def __exit__(self, *exc):
        if self.path is not None:
            self.file.close()


def install() -> str | None:
    """pip-installs the pinned closure (--no-deps) into this interpreter's environment when a
    pin is missing. Returns None, or why the peers cannot be installed."""
    if not check()["missing_pins"]:
        return None
    cmd = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
           "-q", "--no-deps", "-r", str(PINS)]
    print("ecx.peers: " + " ".join(cmd), file=sys.stderr)
    try:
        with _venv_lock(600):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except TimeoutError as e:
        return str(e)
    except subprocess.TimeoutExpired:
        return "pip install of the peers timed out after 900 s"
    if r.returncode != 0:
        return "pip install of the peers failed: " + _tail(r.stderr + r.stdout)
    left = check()["missing_pins"]
    return f"still missing after pip install: {', '.join(left)}" if left else None


def _tail(text: str, n: int = 400) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return " | ".join(lines[-4:])[-n:] if lines else ""


# ---------------------------------------------------------------- orchestration (`run`)

def _die_with_parent() -> None:
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_children: list[subprocess.Popen] = []


def _kill_children() -> None:
    for p in _children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    _children.clear()


def _spawn(role: str, config: dict, env: dict, log: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(WORKER), role, json.dumps(config)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log, "w"),
                         env=env, text=True, preexec_fn=_die_with_parent)
    _children.append(p)
    return p


def _readline(p: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline().strip() if ready else ""


def _exit_reason(p: subprocess.Popen, log: Path) -> str:
    rc = p.poll()
    how = "still running" if rc is None else (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited {rc}")
    return f"{how}; stderr: {_tail(log.read_text(errors='replace'))}"


def _case_env(system: str, transport: str) -> dict:
    env = dict(os.environ)
    env.setdefault("GLOG_minloglevel", "1")  # Mooncake's per-transfer INFO lines
    if system.startswith("nixl"):
        if transport == "tcp":
            env["UCX_TLS"] = "tcp"
        else:
            env.pop("UCX_TLS", None)  # UCX's own choice on one host: shared memory where it can
        env.setdefault("UCX_PROTO_INFO", "y")  # logs the protocol UCX picks: see _ucx_paths
    return env


def _ucx_paths(log: Path) -> dict:
    """The UCX transports towards the target, from UCX_PROTO_INFO's tables in the initiator's
    log: the READ (e.g. "zero-copy cma/memory", "software emulation tcp/lo") and the active
    messages NIXL's notifications ride on (e.g. "short tcp/lo" under error mode peer)."""
    titles = {"ucx_read_path": "remote memory read by ucp_get", "ucx_am_path": "active message by ucp_am_send* from"}
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    found, remote = {}, False
    for i, line in enumerate(lines):
        if " cfg#" in line:
            remote = "intra-node" in line or "inter-node" in line
        for key, title in titles.items():
            if remote and key not in found and title in line:
                for row in lines[i + 1:i + 12]:
                    cells = [c.strip() for c in row.split("|")[1:-1]]
                    if len(cells) == 3 and cells[0] != "Range" and cells[2]:
                        found[key] = f"{cells[1]} {cells[2]}"
                        break
    return found


def _unavailable(system: str) -> str | None:
    """Why `system` cannot run with this interpreter, before starting anything."""
    import importlib.util
    module = "mooncake" if system == "mooncake" else "nixl_cu12"
    for name in (module, "zmq", "numpy") + (("msgpack",) if system == "nixl-eccpu" else ()):
        if importlib.util.find_spec(name) is None:
            return (f"Python module {name} is not installed in {sys.executable}: run "
                    f"`{sys.executable} {Path(__file__).resolve()} install`")
    if system == "mooncake":
        unresolved = check()["mooncake_unresolved_libraries"]
        if unresolved:
            return f"mooncake engine.so cannot load, libraries not found: {', '.join(unresolved)}"
    return None


# Control round trips before an item's data moves: nixl-2step's address query, nixl-eccpu's
# XferReq/XferAck (one per item; a request's go out together, but each item has its own).
CONTROL_RTTS_PER_ITEM = {"nixl-2step": 1, "nixl-eccpu": 1}


def _error_rows(system, transport, variant, sizes, error: str) -> list[dict]:
    return [{"system": system, "transport": transport, "variant": variant, "items": int(i), "item_bytes": int(b),
             "p50_us": None, "p99_us": None, "gbps": None,
             "control_rtts_per_item": CONTROL_RTTS_PER_ITEM.get(system, 0),
             "verified_bytes": 0, "error": error} for i, b in sizes]


def _region_bytes(system: str, sizes) -> int:
    """The registered region on each side: room for the largest request, items laid out as
    peers_worker._extents lays them (4 KiB slots; whole 8 KiB EC blocks for nixl-eccpu)."""
    align = 8192 if system == "nixl-eccpu" else 4096  # peers_worker.EC_BLOCK_BYTES, SLOT_ALIGN
    return max(items * ((b + align - 1) // align * align) for items, b in sizes)


def run_case(system: str, transport: str, variant: str, sizes, iters: int, timeout_s: float,
             log_dir: Path, nixl_initiator_progress_thread: bool = True) -> tuple[list[dict], dict]:
    """Rows for every size of one case, and what was learnt about it (the UCX data path)."""
    base = {"system": system, "transport": transport, "variant": variant}
    region = _region_bytes(system, sizes)
    rows = {}
    stem = f"{system}-{transport}-{variant}"
    env = _case_env(system, transport)
    error = None
    try:
        target_log, init_log = log_dir / f"{stem}.target.log", log_dir / f"{stem}.initiator.log"
        target = _spawn("target", {**base, "region_bytes": region, "lifetime_s": timeout_s + 30}, env, target_log)
        ready = _readline(target, 60)
        if not ready.startswith("ready "):
            raise RuntimeError(f"target did not start: {_exit_reason(target, target_log)}")
        cfg = {**base, "region_bytes": region, "port": int(ready.split()[1]), "sizes": sizes, "iters": iters,
               "nixl_initiator_progress_thread": nixl_initiator_progress_thread}
        initiator = _spawn("initiator", cfg, env, init_log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = _readline(initiator, max(0.0, deadline - time.monotonic()))
            if line.startswith("row "):
                r = json.loads(line[4:])
                rows[(r["items"], r["item_bytes"])] = r
            elif not line and initiator.poll() is not None:
                break
        if initiator.poll() is None:
            error = f"timed out after {timeout_s:g} s; initiator log {init_log}"
        elif len(rows) < len(sizes):
            error = f"initiator {_exit_reason(initiator, init_log)}"
        try:
            target.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    except Exception as e:  # noqa: BLE001 - a row says why
        error = f"{type(e).__name__}: {e}"
    finally:
        _kill_children()
    out = []
    for (items, item_bytes), row in zip(sizes, _error_rows(system, transport, variant, sizes, None)):
        r = rows.get((items, item_bytes), {"error": error or "no result"})
        row.update({k: v for k, v in r.items() if k in ROW_FIELDS and k not in ("items", "item_bytes")})
        if row["error"]:
            row.update(p50_us=None, p99_us=None, gbps=None, verified_bytes=0)
        out.append(row)
    info = {**base, "logs": [str(log_dir / f"{stem}.target.log"), str(log_dir / f"{stem}.initiator.log")]}
    if system.startswith("nixl"):
        info.update(_ucx_paths(log_dir / f"{stem}.initiator.log"))
        info["UCX_TLS"] = env.get("UCX_TLS")
        info["initiator_progress_thread"] = nixl_initiator_progress_thread
    return out, info


CASES = [(s, t, v) for s in ("nixl", "nixl-2step", "nixl-eccpu") for t in ("shm", "tcp") for v in ("peer", "none")] + \
        [("mooncake", "tcp", v) for v in ("read", "write")]


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    """"1x1600KiB,3x1600KiB,1x8MiB" -> [(1, 1638400), (3, 1638400), (1, 8388608)]."""
    units = {"KiB": KIB, "MiB": KIB * KIB, "B": 1, "": 1}
    out = []
    for part in text.split(","):
        items, size = part.strip().split("x", 1)
        unit = next(u for u in units if size.endswith(u))
        out.append((int(items), int(size[: len(size) - len(unit)]) * units[unit]))
    return out


def run(args) -> dict:
    sizes = _parse_sizes(args.sizes)
    systems = set(args.systems.split(","))
    transports = set(args.transports.split(","))
    cases = [c for c in CASES if c[0] in systems and c[1] in transports]
    setup_error = None if args.no_install else install()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ecx-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results, cases_info = [], []
    for system, transport, variant in cases:
        print(f"ecx.peers: {system} {transport} {variant} ...", file=sys.stderr, flush=True)
        error = setup_error or _unavailable(system)
        if error:
            rows, info = _error_rows(system, transport, variant, sizes, error), {}
        else:
            rows, info = run_case(system, transport, variant, sizes, args.iters, args.case_timeout, log_dir,
                                  args.nixl_initiator_progress_thread == "on")
        results.extend(rows)
        if info:
            cases_info.append(info)
    return {"results": results, "cases": cases_info, "versions": _versions(), "logs": str(log_dir)}


def _versions() -> dict:
    from importlib import metadata
    out = {}
    for name in ("nixl-cu12", "mooncake-transfer-engine-non-cuda", "pyzmq", "numpy", "msgpack"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _print_table(results: list[dict]) -> None:
    print(f"{'system':<11}{'transport':<10}{'variant':<8}{'items':>6}{'item_bytes':>11}{'p50_us':>10}"
          f"{'p99_us':>10}{'GB/s':>8}{'rtt/item':>9}  error", file=sys.stderr)
    for r in results:
        f = lambda v, w, d=1: f"{v:>{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
        print(f"{r['system']:<11}{r['transport']:<10}{r['variant']:<8}{r['items']:>6}{r['item_bytes']:>11}"
              f"{f(r['p50_us'], 10)}{f(r['p99_us'], 10)}{f(r['gbps'], 8, 2)}{r['control_rtts_per_item']:>9}"
              f"  {r['error'] or ''}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ecx.peers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="pip-install the pinned peers (--no-deps) into this venv")
    sub.add_parser("check", help="print what is installed and missing, as JSON")
    r = sub.add_parser("run", help="measure the peers; JSON rows on --json (default stdout)")
    r.add_argument("--json", help="write {\"results\": [...]} here")
    r.add_argument("--sizes", default=DEFAULT_SIZES, help=f"ITEMSxSIZE list (default {DEFAULT_SIZES})")
    r.add_argument("--iters", type=int, default=100, help="timed requests per row (warm-up: iters/10, at least 2)")
    r.add_argument("--systems", default="nixl,nixl-2step,nixl-eccpu,mooncake")
    r.add_argument("--transports", default="shm,tcp")
    r.add_argument("--case-timeout", type=float, default=180.0, help="seconds for one case, all its sizes")
    r.add_argument("--no-install", action="store_true", help="do not pip-install missing pins")
    r.add_argument("--nixl-initiator-progress-thread", choices=["on", "off"], default="on",
                   help="NIXL's progress thread in the initiator (default on: NIXL's and vLLM's setting; "
                        "off lets the polling thread alone drive UCX, which wins on a 2-core machine)")
    r.add_argument("--log-dir", help="children's stderr logs (default: a new temp dir)")
    args = parser.parse_args(argv)

    if args.command == "check":
        print(json.dumps(check(), indent=2))
        return 0
    if args.command == "install":
        error = install()
        report = check()
        print(json.dumps(report, indent=2))
        if error:
            print(f"ecx.peers: {error}", file=sys.stderr)
        return 1 if error or report["mooncake_unresolved_libraries"] else 0

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: (_kill_children(), sys.exit(128 + s)))
    try:
        report = run(args)
    finally:
        _kill_children()
    # "results" is the contract (docs/results/HISTORY.md §8); "peers" says what ran: versions, the UCX data
    # path each NIXL case took, where the children's logs are.
    text = json.dumps({"results": report["results"],
                       "peers": {"versions": report["versions"], "cases": report["cases"],
                                 "python": sys.executable}}, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    _print_table(report["results"])
    print(f"ecx.peers: children's logs in {report['logs']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
