"""The two processes of one `ecx bench peers` case (python/ecx/peers.py starts them):

    python peers_worker.py target    CONFIG_JSON   registered DRAM with a known pattern
    python peers_worker.py initiator CONFIG_JSON   moves it, times each request, verifies it

The target answers over ZMQ REQ/REP (tcp://127.0.0.1): "meta" (where its memory is, and
NIXL's agent metadata), "addr" (nixl-2step's per-item address query), "verify" (Mooncake
writes: compare what arrived, then clear it) and "bye". Each process writes its protocol
lines ("ready PORT", "row {json}") to the stdout it was started with; everything else,
NIXL's logs included, goes to stderr (the case's log file). Standalone: imports nothing
from ecx, so it runs by path from any venv that has the peers' wheels.
"""
import json
import math
import mmap
import os
import sys
import time

SLOT_ALIGN = 4096
REQUEST_TIMEOUT_S = 10.0  # one request (or one control message) never waits longer
NOTIF = b"ecx-peers-read"  # sent after each READ, as vLLM's NIXL connector tells the producer


def _pattern(nbytes: int):
    import numpy as np
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(0x00EC0FFEE0DDF00D)
    return words.view(np.uint8)[:nbytes]


class Buffer:
    """Page-aligned anonymous memory seen as a numpy uint8 array."""

    def __init__(self, nbytes: int):
        import numpy as np
        self._map = mmap.mmap(-1, nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = self.array.ctypes.data
        self.nbytes = nbytes


def _slot(item_bytes: int) -> int:
    return (item_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _extents(items: int, item_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each item: item i at i * slot, the same offsets on both sides."""
    return [(i * _slot(item_bytes), item_bytes) for i in range(items)]


_protocol = sys.stdout  # a child's line-protocol stream to `run` (main() separates it from logs)


def _say(line: str) -> None:
    _protocol.write(line + "\n")
    _protocol.flush()


def _zmq_socket(kind):
    import zmq
    ctx = zmq.Context.instance()
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, int(REQUEST_TIMEOUT_S * 1000))
    s.setsockopt(zmq.SNDTIMEO, int(REQUEST_TIMEOUT_S * 1000))
    return s


def _new_nixl_agent(name: str, error_mode: str, progress_thread: bool = True):
    """NIXL's defaults (a progress thread, as vLLM's NIXL connectors run it), UCX backend."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": error_mode})
    return agent


def _new_mooncake_engine():
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) returned {rc}")
    return engine


# ---------------------------------------------------------------- target process

def target_main(config: dict) -> None:
    """Holds `region_bytes` of registered DRAM (the pattern, or zeros for writes) and answers
    the initiator over ZMQ REQ/REP until `bye` or its lifetime runs out."""
    import zmq
    system, variant = config["system"], config["variant"]
    buf = Buffer(config["region_bytes"])
    expected = _pattern(buf.nbytes)
    if variant != "write":
        buf.array[:] = expected
    sock = _zmq_socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    meta = {"base": buf.addr, "bytes": buf.nbytes}
    agent = engine = None  # the engine lives as long as this function: it serves the reads
    if system.startswith("nixl"):
        agent = _new_nixl_agent(f"ecx-peers-target-{os.getpid()}", variant)
        agent.register_memory([(buf.addr, buf.nbytes, 0, "")], "DRAM")
        blob = agent.get_agent_metadata()
    else:
        engine = _new_mooncake_engine()
        if engine.register_memory(buf.addr, buf.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")
        meta["segment"] = f"127.0.0.1:{engine.get_rpc_port()}"
        blob = b""
    _say(f"ready {port}")
    deadline = time.monotonic() + config["lifetime_s"]
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    notifs = 0
    while time.monotonic() < deadline:
        if not poller.poll(5):
            if agent is not None:
                notifs += sum(len(v) for v in agent.get_new_notifs().values())
            continue
        request = json.loads(sock.recv())
        op = request["op"]
        if op == "meta":
            sock.send_multipart([json.dumps(meta).encode(), blob])
        elif op == "addr":  # nixl-2step: the seed's per-item address query
            sock.send(json.dumps({"addr": buf.addr + request["offset"], "len": request["len"]}).encode())
        elif op == "verify":  # mooncake write: compare what arrived, then clear it
            bad = [[o, n] for o, n in request["extents"]
                   if not (buf.array[o:o + n] == expected[o:o + n]).all()]
            for o, n in request["extents"]:
                buf.array[o:o + n] = 0
            sock.send(json.dumps({"bad": bad}).encode())
        elif op == "bye":
            sock.send(json.dumps({"notifs": notifs}).encode())
            break
        else:
            sock.send(json.dumps({"error": f"unknown op {op}"}).encode())


# ---------------------------------------------------------------- initiator process

class Control:
    """The initiator's ZMQ REQ socket to the target; every call bounded by REQUEST_TIMEOUT_S."""

    def __init__(self, port: int):
        import zmq
        self.sock = _zmq_socket(zmq.REQ)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def call(self, message: dict) -> list[bytes]:
        import zmq
        try:
            self.sock.send(json.dumps(message).encode())
            return self.sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(f"target did not answer {message['op']!r} within {REQUEST_TIMEOUT_S} s")

    def json(self, message: dict) -> dict:
        return json.loads(self.call(message)[0])


def _wait_nixl(agent, handle, what: str) -> None:
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError(f"{what}: check_xfer_state returned ERR")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not DONE after {REQUEST_TIMEOUT_S} s (state {state})")
        os.sched_yield()  # two cores: let the progress threads (ours, the target's) run


class NixlInitiator:
    def __init__(self, config: dict, control: Control, local: Buffer):
        self.agent = _new_nixl_agent(f"ecx-peers-initiator-{os.getpid()}", config["variant"],
                                     config.get("nixl_initiator_progress_thread", True))
        self.agent.register_memory([(local.addr, local.nbytes, 0, "")], "DRAM")
        meta_json, blob = control.call({"op": "meta"})
        self.remote_base = json.loads(meta_json)["base"]
        self.remote = self.agent.add_remote_agent(blob)
        self.agent.make_connection(self.remote)
        self.control, self.local, self.two_step = control, local, config["system"] == "nixl-2step"
        self.prepped = {}

    def prepare(self, extents):
        if self.two_step:
            return
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.local.addr + o, n, 0) for o, n in extents], "DRAM")
        remote = self.agent.prep_xfer_dlist(self.remote, [(self.remote_base + o, n, 0) for o, n in extents], "DRAM")
        self.prepped = {"local": local, "remote": remote, "indices": list(range(len(extents)))}

    def request(self, extents, _iteration: int) -> None:
        if not self.two_step:
            p = self.prepped
            handle = self.agent.make_prepped_xfer("READ", p["local"], p["indices"], p["remote"], p["indices"],
                                                  NOTIF)
            self._post_and_wait(handle, "READ")
            return
        for i, (offset, length) in enumerate(extents):  # the seed: query, read, wait; per item
            where = self.control.json({"op": "addr", "offset": offset, "len": length})
            local = self.agent.get_xfer_descs([(self.local.addr + offset, length, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(where["addr"], where["len"], 0)], "DRAM")
            handle = self.agent.initialize_xfer("READ", local, remote, self.remote, NOTIF)
            self._post_and_wait(handle, f"READ of item {i}")

    def _post_and_wait(self, handle, what: str) -> None:
        try:
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError(f"{what}: transfer() returned ERR")
            _wait_nixl(self.agent, handle, what)  # must reach DONE, or the target is never notified
        finally:
            self._release(handle)

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a handle still in flight; the process ends soon
            pass


class MooncakeInitiator:
    def __init__(self, config: dict, control: Control, local: Buffer):
        self.engine = _new_mooncake_engine()
        if self.engine.register_memory(local.addr, local.nbytes) != 0:
            raise RuntimeError("TransferEngine.register_memory failed")
        meta = json.loads(control.call({"op": "meta"})[0])
        self.segment, self.remote_base = meta["segment"], meta["base"]
        self.local, self.write = local, config["variant"] == "write"

    def prepare(self, extents):
        pass

    def request(self, extents, _iteration: int) -> None:
        local = [self.local.addr + o for o, _ in extents]
        remote = [self.remote_base + o for o, _ in extents]
        lengths = [n for _, n in extents]
        call = self.engine.batch_transfer_sync_write if self.write else self.engine.batch_transfer_sync_read
        rc = call(self.segment, local, remote, lengths)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_{'write' if self.write else 'read'} to {self.segment} returned {rc}")


def _summary(samples_ns: list[int], bytes_per_request: int) -> dict:
    s = sorted(samples_ns)
    pct = lambda p: s[min(len(s) - 1, math.ceil(p * len(s)) - 1)] / 1000.0  # noqa: E731 - as bench_stats.cc
    total_s = sum(s) / 1e9
    return {"p50_us": round(pct(0.50), 1), "p99_us": round(pct(0.99), 1),
            "gbps": round(bytes_per_request * len(s) / total_s / 1e9, 6) if total_s > 0 else 0.0}


def initiator_main(config: dict) -> None:
    """Runs every size of one (system, transport, variant); prints `row {json}` per size."""
    sizes, iters = config["sizes"], config["iters"]
    warmup = max(2, iters // 10)
    local = Buffer(config["region_bytes"])
    expected = _pattern(local.nbytes)
    write = config["variant"] == "write"
    if write:
        local.array[:] = expected
    control = Control(config["port"])
    peer = None
    try:
        peer = (MooncakeInitiator if config["system"] == "mooncake" else NixlInitiator)(config, control, local)
        for items, item_bytes in sizes:
            row = {"items": items, "item_bytes": item_bytes}
            try:
                extents = _extents(items, item_bytes)
                peer.prepare(extents)
                samples, verified = [], 0
                for it in range(warmup + iters):
                    if not write:
                        for o, n in extents:
                            local.array[o:o + n] = 0
                    t0 = time.perf_counter_ns()
                    peer.request(extents, it)
                    elapsed = time.perf_counter_ns() - t0
                    if write:
                        bad = control.json({"op": "verify", "extents": extents})["bad"]
                    else:
                        bad = [[o, n] for o, n in extents if not (local.array[o:o + n] == expected[o:o + n]).all()]
                    if bad:
                        raise RuntimeError(f"iteration {it}: bytes differ from the pattern at (offset, len) {bad}")
                    if it >= warmup:
                        samples.append(elapsed)
                        verified += items * item_bytes
                row.update(_summary(samples, items * item_bytes), verified_bytes=verified, error=None)
            except Exception as e:  # noqa: BLE001 - the row says why
                row["error"] = f"{type(e).__name__}: {e}"
            _say("row " + json.dumps(row))
    finally:
        try:
            control.call({"op": "bye"})
        except Exception:  # noqa: BLE001 - the orchestrator kills the target anyway
            pass


def main() -> int:
    role, config = sys.argv[1], json.loads(sys.argv[2])
    global _protocol
    _protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NIXL logs to stdout, from Python and C++: into the log with the rest
    try:
        {"target": target_main, "initiator": initiator_main}[role](config)
        code = 0
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator through the log
        print(f"ecx.peers {role}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stderr.flush()
    _protocol.flush()
    os._exit(code)  # skip the engines' destructors: NIXL segfaults tearing down at exit


if __name__ == "__main__":
    main()
