"""The two processes of one `ecx bench peers` case (bench/python/peers.py starts them):

    python peers_worker.py target    CONFIG_JSON   registered DRAM with a known pattern
    python peers_worker.py initiator CONFIG_JSON   moves it, times each request, verifies it

The target answers over ZMQ REQ/REP (tcp://127.0.0.1): "meta" (where its memory is, and
NIXL's agent metadata), "addr" (nixl-2step's per-item address query), "verify" (Mooncake
writes: compare what arrived, then clear it), "ec_items" (nixl-eccpu: the items its cache
holds, set before timing) and "bye". For nixl-eccpu it also binds a ZMQ ROUTER, the producer
side of vLLM's ECCPUConnector protocol (EcProducer; the consumer is EcCpuInitiator). Each
process writes its protocol lines ("ready PORT", "row {json}") to the stdout it was started
with; everything else, NIXL's logs included, goes to stderr (the case's log file).
Standalone: imports nothing from ecx, so it runs by path from any venv that has the peers'
wheels.
"""
import hashlib
import json
import math
import mmap
import os
import sys
import time
import uuid

SLOT_ALIGN = 4096
REQUEST_TIMEOUT_S = 10.0  # one request (or one control message) never waits longer
NOTIF = b"ecx-peers-read"  # sent after each READ, as vLLM's NIXL connector tells the producer

# nixl-eccpu: vLLM's ECCPUConnector (vllm/distributed/ec_transfer/ec_connector/cpu/). Its block
# is one embedding row (hidden size x dtype size, common.py create_ec_shared_region): 4096 x
# bf16 here, so the seed's 1600 KiB item is 200 blocks. Its protocol constants and timeouts
# (protocol.py, session.py, control/zmq.py, scheduler/__init__.py):
EC_BLOCK_BYTES = 8192
EC_CONNECTOR_VERSION = 2            # protocol.py; the producer NACKs any other
EC_PIN_LEASE_S = 30.0               # PRODUCER_PIN_LEASE_S: a grant not read by then is unpinned
EC_ACK_TIMEOUT_S = EC_PIN_LEASE_S   # consumer_ack_timeout_s' default: waiting for the XferAck
EC_READ_TIMEOUT_S = 20.0            # _CONSUMER_READ_TIMEOUT_S: READ posted -> DONE
EC_HEARTBEAT_MS = (2000, 4000, 8000)  # control/zmq.py: the DEALER's ZMQ heartbeat ivl/timeout/ttl
EC_OK, EC_NACK_NOT_READY = 0, 5     # XferStatus (1..5 are NACKs; 5 is the retryable one)
EC_STATUS = {0: "OK", 1: "NACK_MISSING", 2: "NACK_INCOMPAT", 3: "NACK_VERSION", 4: "NACK_INTERNAL",
             5: "NACK_NOT_READY"}


def _pattern(nbytes: int):
    import numpy as np
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= np.uint64(0x00EC0FFEE0DDF00D)
    return words.view(np.uint8)[:nbytes]


class Buffer:
    """Page-aligned memory seen as a numpy uint8 array: anonymous, or (shm_name) a MAP_SHARED
    mapping of a /dev/shm file, as vLLM's ECSharedRegion holds its blocks. The file is unlinked
    at once (the mapping keeps the pages), so a killed worker leaves nothing in /dev/shm."""

    def __init__(self, nbytes: int, shm_name: str | None = None):
        import numpy as np
        if shm_name is None:
            self._map = mmap.mmap(-1, nbytes)
        else:
            path = f"/dev/shm/{shm_name}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.unlink(path)
                os.ftruncate(fd, nbytes)
                self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        if shm_name is not None:
            self.array[::mmap.PAGESIZE] = 0  # fault every page in now, as ECSharedRegion does
        self.addr = self.array.ctypes.data
        self.nbytes = nbytes


def _slot(item_bytes: int, system: str = "") -> int:
    """Bytes between items: 4 KiB-aligned, or whole EC blocks for nixl-eccpu (vLLM reads an
    encoding as ceil(bytes / block) blocks). peers.py sizes the region with the same rule."""
    align = EC_BLOCK_BYTES if system == "nixl-eccpu" else SLOT_ALIGN
    return (item_bytes + align - 1) // align * align


def _extents(items: int, item_bytes: int, system: str = "") -> list[tuple[int, int]]:
    """(offset, length) of each item: item i at i * slot, the same offsets on both sides."""
    return [(i * _slot(item_bytes, system), item_bytes) for i in range(items)]


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


def _new_nixl_agent(name: str, error_mode: str, progress_thread: bool = True, eccpu: bool = False):
    """NIXL's defaults (a progress thread, as vLLM's NIXL connectors run it), UCX backend. eccpu:
    as ECCPUConnector's NixlDataTransport makes it (data/nixl.py): nixl_agent_config(num_threads=1,
    capture_telemetry=True), which gives the UCX backend num_threads=1."""
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], capture_telemetry=eccpu)
    agent = nixl_agent(name, config)
    params = {"ucx_error_handling_mode": error_mode}
    if eccpu:
        params["num_threads"] = "1"
    agent.create_backend("UCX", params)
    return agent


def _new_mooncake_engine():
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) returned {rc}")
    return engine


# ---------------------------------------------------------------- nixl-eccpu: vLLM's ECCPUConnector
#
# vLLM's CPU EC connector (vllm/distributed/ec_transfer/ec_connector/cpu/), rebuilt on the real
# NIXL Python API and pyzmq without vLLM: the same messages and control flow, written here.
#   protocol.py   XferReq {mm_hash, compatibility_hash, session_id, connector_version} and
#                 XferAck {mm_hash, status, session_id, src_block_indices, agent_metadata,
#                 mem_descriptor}, msgspec msgpack with a "req"/"ack" tag. Here: msgpack maps of
#                 the same fields with "type": "req"/"ack".
#   control/zmq.py  the consumer's DEALER (one per producer, ZMQ heartbeats, a monitor for
#                 EVENT_DISCONNECTED) sends [b"", msg]; the producer's ROUTER answers
#                 [identity, b"", msg].
#   session.py    ConsumerSession.start_xfer sends one XferReq per item (mm_hash); the
#                 scheduler's admission loop (scheduler/__init__.py _admit_item) starts every
#                 item of a request in the same step, so a request's XferReqs go out together.
#                 ProducerSession._grant_or_nack checks version, compatibility hash and
#                 session id, pins the item (pin_if_ready) and answers OK with the item's
#                 block indices plus its NIXL agent metadata and the msgpack descriptor list of
#                 every block of its region, in every OK ack; else NACK_MISSING / _INCOMPAT /
#                 _VERSION / _INTERNAL / _NOT_READY (the only retryable one). On an OK ack the
#                 consumer registers the producer's agent and preps its descriptor list the
#                 first time (again only if the metadata bytes change), then posts one NIXL
#                 READ of the item's blocks (make_prepped_xfer on prepped per-block lists, as
#                 data/nixl.py post_read) with notif_msg "{session_id}:{mm_hash}", and polls
#                 check_xfer_state to DONE. The producer unpins the item when that
#                 notification arrives (get_new_notifs), or when its 30 s pin lease expires.
#   Timeouts: XferAck 30 s (consumer_ack_timeout_s, default PRODUCER_PIN_LEASE_S), READ 20 s
#   (_CONSUMER_READ_TIMEOUT_S, then vLLM quarantines the blocks for 60 s), 60 s per item of a
#   request in all (_ADMIT_DEFER_TIMEOUT_S). Here a timeout or a NACK fails the row (vLLM would
#   fall back to encoding locally); NACK_NOT_READY is re-requested, as vLLM does.
# Not rebuilt: vLLM drives both sessions once per engine step (the consumer from
# ensure_cache_available, the producer from build_connector_meta), so an XferAck waits for the
# producer's next step and a DONE for the consumer's; here both sides poll in a tight loop, so
# the row is the protocol's lower bound. The GPU<->region copies (worker/) are outside it too.

def _ec_compat_hash() -> str:
    """protocol.py compute_ec_compatibility_hash: sha256 over vLLM version, model, dtype, block
    size. Sent with every XferReq; the producer NACKs a mismatch."""
    factors = json.dumps(["ecx-peers", "seed", "bfloat16", EC_BLOCK_BYTES], separators=(",", ":"))
    return hashlib.sha256(factors.encode()).hexdigest()


def _ec_block_descs(base: int, nbytes: int) -> list[tuple[int, int, int]]:
    """utils.py build_block_descs: (addr, size, device) of every block of a region."""
    return [(base + i * EC_BLOCK_BYTES, EC_BLOCK_BYTES, 0) for i in range(nbytes // EC_BLOCK_BYTES)]


def _ec_prep_local(agent, buf: "Buffer"):
    """data/nixl.py _register_local_memory: register the region, prep its per-block dlist."""
    agent.register_memory([(buf.addr, buf.nbytes, 0, "")], "DRAM")
    descs = _ec_block_descs(buf.addr, buf.nbytes)
    return descs, agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(descs, "DRAM"))


class EcProducer:
    """ProducerSession over ZmqServerTransport and NixlDataTransport (see above): one poll()
    is one poll_step (drain the ROUTER, grant or NACK each XferReq, drain NIXL notifications,
    sweep expired pins)."""

    def __init__(self, agent, buf: "Buffer"):
        import msgpack
        import zmq
        self.zmq, self.msgpack, self.agent = zmq, msgpack, agent
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        for opt in (zmq.RCVHWM, zmq.SNDHWM, zmq.LINGER):  # make_zmq_socket's HWMs; no linger
            self.router.setsockopt(opt, 0)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        descs, self.local_dlist = _ec_prep_local(agent, buf)
        self.agent_metadata = agent.get_agent_metadata()
        self.mem_descriptor = msgpack.packb(descs)
        self.compat_hash = _ec_compat_hash()
        self.cache: dict[str, list] = {}  # mm_hash -> [block ids, pins]: the EmbeddingCache's ready entries
        self.active: dict[str, tuple[str, float]] = {}  # "session:mm_hash" -> (mm_hash, lease deadline)
        self.counts = {"xfer_reqs": 0, "nacks": 0, "notifs": 0, "leases_expired": 0, "malformed": 0}

    def poll(self) -> None:
        zmq = self.zmq
        while True:
            try:
                frames = self.router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                identity, _, payload = frames
                req = self.msgpack.unpackb(payload)
                if req.get("type") != "req":
                    raise ValueError(req.get("type"))
            except Exception:  # noqa: BLE001 - vLLM drops a malformed XferReq
                self.counts["malformed"] += 1
                continue
            self.counts["xfer_reqs"] += 1
            self.router.send_multipart([identity, b"", self.msgpack.packb(self._grant_or_nack(req))])
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                self.counts["notifs"] += 1
                grant = self.active.pop(msg.decode("utf-8", "replace"), None)
                if grant is not None:
                    self._unpin(grant[0])
        now = time.monotonic()
        for key, (mm_hash, deadline) in list(self.active.items()):
            if now > deadline:
                self.counts["leases_expired"] += 1
                self._unpin(mm_hash)
                del self.active[key]

    def _unpin(self, mm_hash: str) -> None:
        entry = self.cache.get(mm_hash)
        if entry is not None and entry[1] > 0:
            entry[1] -= 1

    def _grant_or_nack(self, req: dict) -> dict:
        mm_hash = req.get("mm_hash", "")
        nack = lambda status: {"type": "ack", "mm_hash": mm_hash, "status": status}  # noqa: E731
        if req.get("connector_version") != EC_CONNECTOR_VERSION:
            status = 3
        elif req.get("compatibility_hash") != self.compat_hash:
            status = 2
        elif not req.get("session_id"):
            status = 4
        elif mm_hash not in self.cache:
            status = 1
        else:
            status = EC_OK
        if status != EC_OK:
            self.counts["nacks"] += 1
            return nack(status)
        entry = self.cache[mm_hash]
        key = f"{req['session_id']}:{mm_hash}"
        if key in self.active:  # a re-request of a grant still held: drop its pin first
            self._unpin(mm_hash)
        entry[1] += 1
        self.active[key] = (mm_hash, time.monotonic() + EC_PIN_LEASE_S)
        return {"type": "ack", "mm_hash": mm_hash, "status": EC_OK, "session_id": req["session_id"],
                "src_block_indices": entry[0], "agent_metadata": self.agent_metadata,
                "mem_descriptor": self.mem_descriptor}


# ---------------------------------------------------------------- target process

def target_main(config: dict) -> None:
    """Holds `region_bytes` of registered DRAM (the pattern, or zeros for writes) and answers
    the initiator over ZMQ REQ/REP until `bye` or its lifetime runs out."""
    import zmq
    system, variant = config["system"], config["variant"]
    eccpu = system == "nixl-eccpu"
    buf = Buffer(config["region_bytes"], f"ecx-peers-eccpu-{os.getpid()}.mmap" if eccpu else None)
    expected = _pattern(buf.nbytes)
    if variant != "write":
        buf.array[:] = expected
    sock = _zmq_socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    meta = {"base": buf.addr, "bytes": buf.nbytes}
    agent = engine = producer = None  # the engine lives as long as this function: it serves the reads
    if eccpu:  # the agent, its region and its ROUTER, as ECCPUScheduler._setup_nixl makes them
        agent = _new_nixl_agent(f"ecx-peers-target-{os.getpid()}", variant, eccpu=True)
        producer = EcProducer(agent, buf)
        meta.update(ec_port=producer.port, ec_block_bytes=EC_BLOCK_BYTES)
        blob = b""  # the consumer gets the agent metadata in each XferAck, as in vLLM
    elif system.startswith("nixl"):
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
    if producer is not None:
        poller.register(producer.router, zmq.POLLIN)
    notifs = 0
    while time.monotonic() < deadline:
        events = dict(poller.poll(5))
        if producer is not None:
            producer.poll()  # ECCPUConnector's ProducerSession.poll_step
        if sock not in events:
            if agent is not None and producer is None:
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
        elif op == "ec_items":  # nixl-eccpu: the encodings the producer saved and holds, ready
            producer.cache.update({h: [blocks, 0] for h, blocks in request["items"].items()})
            sock.send(b"{}")
        elif op == "bye":
            sock.send(json.dumps(producer.counts if producer is not None else {"notifs": notifs}).encode())
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


class EcCpuInitiator:
    """The consumer side of vLLM's ECCPUConnector (ConsumerSession and ConsumerXfer in
    session.py, ZmqClientConnection in control/zmq.py, NixlDataTransport in data/nixl.py; see
    the block above EcProducer). One request: an XferReq per item, all sent at once; each OK
    XferAck posts that item's NIXL READ; every READ polled to DONE. Items are mm_hashes the
    producer holds; the same ones are read again each iteration, as the other rows do."""

    def __init__(self, config: dict, control: Control, local: Buffer):
        import msgpack
        import zmq
        self.zmq, self.msgpack, self.control, self.local = zmq, msgpack, control, local
        meta = control.json({"op": "meta"})
        if meta.get("ec_block_bytes") != EC_BLOCK_BYTES:
            raise RuntimeError(f"target's EC block is {meta.get('ec_block_bytes')} bytes, not {EC_BLOCK_BYTES}")
        self.agent = _new_nixl_agent(f"ecx-peers-initiator-{os.getpid()}", config["variant"],
                                     config.get("nixl_initiator_progress_thread", True), eccpu=True)
        _, self.local_dlist = _ec_prep_local(self.agent, local)
        # ZmqClientTransport.connect: a DEALER per producer, with heartbeats and a disconnect monitor.
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        for opt in (zmq.RCVHWM, zmq.SNDHWM, zmq.LINGER):
            self.dealer.setsockopt(opt, 0)
        for opt, ms in zip((zmq.HEARTBEAT_IVL, zmq.HEARTBEAT_TIMEOUT, zmq.HEARTBEAT_TTL), EC_HEARTBEAT_MS):
            self.dealer.setsockopt(opt, ms)
        self.dealer.connect(f"tcp://127.0.0.1:{meta['ec_port']}")
        monitor_addr = f"inproc://ec-peer-mon-127.0.0.1-{meta['ec_port']}"
        self.dealer.monitor(monitor_addr, zmq.EVENT_DISCONNECTED)
        self.monitor = self.ctx.socket(zmq.PAIR)
        self.monitor.connect(monitor_addr)
        self.session_id = str(uuid.uuid4())
        self.compat_hash = _ec_compat_hash()
        self.peer_agent = self.peer_metadata = self.remote_dlist = None
        self.items: list[tuple[str, list[int]]] = []

    def prepare(self, extents):
        """The producer's saved encodings (untimed): item i's blocks, named like an mm_hash."""
        self.items = [(f"ecx-peers-{len(extents)}x{n}-{i}",
                       list(range(o // EC_BLOCK_BYTES, o // EC_BLOCK_BYTES + -(-n // EC_BLOCK_BYTES))))
                      for i, (o, n) in enumerate(extents)]
        self.control.json({"op": "ec_items", "items": dict(self.items)})

    def _send_req(self, mm_hash: str) -> None:  # ConsumerSession.start_xfer
        self.dealer.send_multipart([b"", self.msgpack.packb(
            {"type": "req", "mm_hash": mm_hash, "compatibility_hash": self.compat_hash,
             "session_id": self.session_id, "connector_version": EC_CONNECTOR_VERSION})])

    def _ensure_registered(self, metadata: bytes, mem_descriptor: bytes) -> str:
        """ConsumerSession._ensure_registered + NixlDataTransport.add_remote_peer."""
        if self.peer_agent is not None and self.peer_metadata == metadata:
            return self.peer_agent
        if self.peer_agent is not None:  # the producer restarted
            self.agent.remove_remote_agent(self.peer_agent)
        name = self.agent.add_remote_agent(metadata)
        descs = [tuple(d) for d in self.msgpack.unpackb(mem_descriptor)]
        self.remote_dlist = self.agent.prep_xfer_dlist(name, self.agent.get_xfer_descs(descs, "DRAM"))
        self.peer_agent, self.peer_metadata = name, metadata
        return name

    def _peer_down(self) -> bool:  # ZmqClientTransport.poll_dead
        from zmq.utils.monitor import recv_monitor_message
        try:
            while True:
                if recv_monitor_message(self.monitor, flags=self.zmq.NOBLOCK)["event"] == self.zmq.EVENT_DISCONNECTED:
                    return True
        except self.zmq.Again:
            return False

    def request(self, extents, _iteration: int) -> None:
        zmq = self.zmq
        blocks = dict(self.items)
        for mm_hash, _ in self.items:  # the admission loop starts every item in one step
            self._send_req(mm_hash)
        waiting = {h: time.monotonic() + EC_ACK_TIMEOUT_S for h, _ in self.items}  # WAITING_ACK
        reading: dict[str, tuple] = {}  # READING: mm_hash -> (handle, deadline)
        try:
            while waiting or reading:
                if waiting and not reading:  # nothing to progress but the acks: wait for one
                    left = min(waiting.values()) - time.monotonic()
                    if left > 0:
                        self.dealer.poll(int(left * 1000) + 1, zmq.POLLIN)
                while True:  # ZmqClientConnection.recv: drain without blocking
                    try:
                        frames = self.dealer.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2 or frames[0] != b"":
                        continue  # a malformed envelope is dropped
                    ack = self.msgpack.unpackb(frames[1])
                    mm_hash = ack.get("mm_hash")
                    if ack.get("type") != "ack" or mm_hash not in waiting:
                        continue  # unknown mm_hash or a duplicate ack
                    status = ack.get("status")
                    if status == EC_NACK_NOT_READY:  # retryable: request it again
                        self._send_req(mm_hash)
                        waiting[mm_hash] = time.monotonic() + EC_ACK_TIMEOUT_S
                        continue
                    if status != EC_OK:  # vLLM falls back to a local encode; the row fails
                        raise RuntimeError(f"XferAck {EC_STATUS.get(status, status)} for {mm_hash}")
                    peer = self._ensure_registered(ack["agent_metadata"], ack["mem_descriptor"])
                    # ConsumerXfer.handle_ack -> NixlDataTransport.post_read
                    handle = self.agent.make_prepped_xfer(
                        "READ", self.local_dlist, blocks[mm_hash], self.remote_dlist, ack["src_block_indices"],
                        notif_msg=f"{self.session_id}:{mm_hash}".encode())
                    self.agent.transfer(handle)  # its state is read by check_xfer_state, as vLLM does
                    del waiting[mm_hash]
                    reading[mm_hash] = (handle, time.monotonic() + EC_READ_TIMEOUT_S)
                if self._peer_down():
                    raise RuntimeError("producer disconnected (ZMQ monitor)")
                now = time.monotonic()
                for mm_hash, deadline in waiting.items():
                    if now > deadline:
                        raise TimeoutError(f"no XferAck for {mm_hash} within {EC_ACK_TIMEOUT_S:g} s")
                for mm_hash, (handle, deadline) in list(reading.items()):  # ConsumerXfer._poll_reading
                    state = self.agent.check_xfer_state(handle)
                    if state == "DONE":
                        del reading[mm_hash]
                        self.agent.release_xfer_handle(handle)
                    elif state != "PROC":
                        raise RuntimeError(f"READ of {mm_hash}: NIXL state {state}")
                    elif now > deadline:  # vLLM quarantines the blocks; the row fails
                        raise TimeoutError(f"READ of {mm_hash} not DONE within {EC_READ_TIMEOUT_S:g} s")
                if reading:
                    os.sched_yield()  # two cores: let the progress threads (ours, the target's) run
        finally:
            for handle, _ in reading.values():
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
    system = config["system"]
    local = Buffer(config["region_bytes"], f"ecx-peers-eccpu-{os.getpid()}.mmap" if system == "nixl-eccpu" else None)
    expected = _pattern(local.nbytes)
    write = config["variant"] == "write"
    if write:
        local.array[:] = expected
    control = Control(config["port"])
    peer = None
    try:
        peer = {"mooncake": MooncakeInitiator, "nixl-eccpu": EcCpuInitiator}.get(system, NixlInitiator)(
            config, control, local)
        for items, item_bytes in sizes:
            row = {"items": items, "item_bytes": item_bytes}
            try:
                extents = _extents(items, item_bytes, system)
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
