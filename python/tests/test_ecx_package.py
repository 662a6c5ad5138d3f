"""The `ecx` Python package over the C++ core: zero-copy buffers, the GIL released in
blocking calls, errors as ecx.Error, and a two-process round trip through Connector."""
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ecx

HERE = Path(__file__).resolve().parent


def payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_an_agent_region_is_shared_memory_not_a_copy():
    producer, consumer = ecx.Agent("pkg-producer"), ecx.Agent("pkg-consumer")
    src = producer.allocate(1 << 16)
    view = producer.buffer(src.id)
    view[:] = payload(1, view.size)  # written through numpy, straight into ecx memory
    dst = consumer.allocate(1 << 16)
    assert consumer.connect(producer.metadata()) in ("shm", "tcp")
    consumer.read("pkg-producer", [(dst.id, 0, src.id, 0, 1 << 16, "")]).wait(10000)
    received = consumer.buffer(dst.id)
    assert np.array_equal(received, payload(1, 1 << 16))
    # Both views alias the regions: a second view is the same memory.
    assert received.__array_interface__["data"][0] == consumer.buffer(dst.id).__array_interface__["data"][0]


def test_registered_numpy_memory_is_read_in_place():
    a, b = ecx.Agent("pkg-reg-a"), ecx.Agent("pkg-reg-b")
    host = payload(2, 4096)
    region = a.register_memory(host)
    dst = b.allocate(4096)
    b.connect(a.metadata(), backend="tcp")  # registered memory is reachable over tcp
    host[:16] = 7  # changed after registration: the peer reads the array itself
    b.read("pkg-reg-a", [(dst.id, 0, region.id, 0, 4096, "")]).wait(10000)
    assert np.array_equal(b.buffer(dst.id), host)


def test_a_descriptor_outside_the_local_region_is_refused_before_anything_moves():
    a = ecx.Agent("pkg-bounds")
    r = a.allocate(4096)
    with pytest.raises(ecx.Error) as err:
        a.read("nobody", [(r.id, 4000, 1, 0, 200, "")])
    assert err.value.code == "out_of_range"
    assert "outside local region" in err.value.message


def test_a_blocking_wait_releases_the_gil():
    agent = ecx.Agent("pkg-gil")
    outcome = {}

    def wait():
        try:
            agent.wait_notification(3000)  # nothing arrives: blocks until its deadline
        except ecx.Error as e:
            outcome["code"] = e.code

    waiter = threading.Thread(target=wait)
    waiter.start()
    count = 0
    while count < 200_000 and waiter.is_alive():
        count += 1  # Python work in this thread while the other one waits in C++
    still_waiting = waiter.is_alive()
    waiter.join()
    assert still_waiting, "this thread could not run while the other waited: the GIL was held"
    assert count == 200_000
    assert outcome["code"] == "deadline_exceeded"


def test_bad_config_and_params_raise_naming_the_key():
    with pytest.raises(ecx.Error) as err:
        ecx.Connector(json.dumps({"connector": "p2p", "extra": {"lese_ms": 10}}))
    assert err.value.code == "invalid_argument" and "lese_ms" in err.value.message
    with pytest.raises(ecx.Error) as err:
        ecx.Connector(json.dumps({"connector": "p2p", "extra": {"pool_bytes": [1]}}))
    assert "pool_bytes" in err.value.message
    consumer = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer"}))
    bad = {"connector": "p2p", "mm_hash": "h", "dtype": "BF16", "shape": [2], "offset": "x"}
    with pytest.raises(ecx.Error) as err:
        consumer.load("r", [ecx.Item("h", "BF16", [2], json.dumps(bad))], 1000)
    assert "'offset'" in err.value.message


@pytest.fixture()
def producer_process(request):
    """A producer in its own process; indirect parametrization adds to its extra config."""
    token = secrets.token_hex(16)
    engine = f"e-pkg-{os.getpid()}"
    config = {"connector": "p2p", "role": "producer",
              "extra": {"engine_id": engine, "pool_bytes": "64MiB", "auth_token": token,
                        **getattr(request, "param", {})}}
    proc = subprocess.Popen([sys.executable, str(HERE / "ecx_producer.py"), json.dumps(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"

    def command(line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    yield command, token
    proc.stdin.write("quit\n")
    proc.stdin.close()
    proc.wait(timeout=30)


def test_round_trip_between_processes_is_bit_exact_and_zero_copy(producer_process):
    command, token = producer_process
    consumer = ecx.Connector(json.dumps({
        "connector": "p2p", "role": "consumer",
        "extra": {"engine_id": f"pd-pkg-{os.getpid()}", "pool_bytes": "64MiB",
                  "auth_token": token}}))
    shapes = [("BF16", [400, 2048]), ("BF16", [7, 3]), ("U8", [1])]
    items, expected = [], {}
    for i, (dtype, shape) in enumerate(shapes):
        mm_hash = f"pkg-item-{os.getpid()}-{i}"
        params = command(f"save {mm_hash} {dtype} {','.join(map(str, shape))} {100 + i}")
        assert "error" not in json.loads(params), params
        items.append(ecx.Item(mm_hash, dtype, shape, params))
        nbytes = int(np.prod(shape)) * (2 if dtype == "BF16" else 1)
        expected[mm_hash] = payload(100 + i, nbytes)
    outcome = consumer.load("req-1", items, 30000)
    assert outcome["ok"], outcome
    assert not any(it["recomputed"] for it in outcome["items"])
    for mm_hash, want in expected.items():
        got = consumer.loaded("req-1", mm_hash)
        assert np.array_equal(got, want)
        assert not got.flags.writeable, "ecx's memory is handed out read-only"
        # The array is the consumer cache's block itself, not a copy of it.
        assert got.__array_interface__["data"][0] == consumer.loaded_address("req-1", mm_hash)
    del got  # an array over a loaded item holds it (the request ends once none is left)
    consumer.request_finished("req-1")
    stats = json.loads(command("stats"))
    for _ in range(100):  # the release travels asynchronously
        if stats["producer_pool"]["pins"] == 0:
            break
        threading.Event().wait(0.05)
        stats = json.loads(command("stats"))
    assert stats["producer_pool"]["pins"] == 0


def test_an_item_is_checked_when_made_and_a_load_block_ends_its_request_on_any_exit():
    """ecx.Item refuses a bad dtype or shape when it is made (not deep in a load); a
    request loaded in an ecx.load block gives its producer's pins back when the block is
    left by an exception, with no call of the caller's and no garbage collection."""
    with pytest.raises(ecx.Error) as err:
        ecx.Item("k", "BF17", [2])
    assert err.value.code == "invalid_argument", err.value.message
    with pytest.raises(ecx.Error):
        ecx.Item("k", "BF16", [-2])
    item = ecx.Item("k", "BF16", [4, 8])
    assert (item.mm_hash, item.dtype, item.shape, item.params) == ("k", "BF16", [4, 8], None)
    # own_pin_taken is a time.monotonic() reading, or nothing.
    for bad in (float("nan"), float("inf"), -1.0, 1e300):
        with pytest.raises(ecx.Error) as err:
            ecx.Item("k", "BF16", [4, 8], None, own_pin_taken=bad)
        assert err.value.code == "invalid_argument" and "own_pin_taken" in err.value.message
    ecx.Item("k", "BF16", [4, 8], None, own_pin_taken=time.monotonic())

    engine = f"e-item-{os.getpid()}"
    producer = ecx.Connector(json.dumps({"connector": "p2p", "role": "producer", "extra": {
        "engine_id": engine, "pool_bytes": "8MiB"}}))
    consumer = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {
        "engine_id": f"pd-item-{os.getpid()}", "pool_bytes": "8MiB"}}))
    params = producer.save("item-a", "U8", [4096], payload(5, 4096))
    pins = lambda: producer.stats()["producer_pool"]["pins"]  # noqa: E731
    assert pins() == 1  # the params' pin, until the reader is done
    with pytest.raises(RuntimeError, match="the caller's own failure"):
        with ecx.load(consumer, "r-item", [ecx.Item("item-a", "U8", [4096], params)],
                      30000) as outcome:
            assert outcome["ok"], outcome
            assert np.array_equal(consumer.loaded("r-item", "item-a"), payload(5, 4096))
            raise RuntimeError("the caller's own failure")
    for _ in range(100):  # the release travels asynchronously
        if pins() == 0:
            break
        threading.Event().wait(0.05)
    assert pins() == 0
    assert consumer.stats()["consumer_cache"]["pins"] == 0


def test_an_encoder_cache_pool_hands_out_its_blocks_without_a_copy():
    agent = ecx.Agent("pkg-pool")
    pool = ecx.EncoderCachePool(agent, name="pkg-pool", capacity_bytes=8 << 20)
    data = payload(3, 4096)
    offset, block_length, generation = pool.put("item-a", "U8", [4096], data)
    assert block_length > 4096 and generation > 0
    view = pool.find("item-a")
    assert np.array_equal(view, data)
    # The view is the pool's arena itself: what a peer READs from the pool's region.
    view[:16] = 9
    peer = ecx.Agent("pkg-pool-peer")
    peer.connect(agent.metadata())
    dst = peer.allocate(block_length)
    peer.read("pkg-pool", [(dst.id, 0, pool.region, offset, block_length, "")]).wait(10000)
    payload_at = block_length - 4096  # the block header comes first
    assert np.array_equal(peer.buffer(dst.id)[payload_at:payload_at + 16], np.full(16, 9))
    pin = pool.pin("item-a", "reader")
    assert pool.stats()["pins"] == 1
    pool.unpin(pin)
    assert pool.stats()["pins"] == 0
    with pytest.raises(ecx.Error) as err:
        pool.find("item-missing")
    assert err.value.code == "missing"  # kNotFound, named as the NACK is


def test_zero_copy_load_hands_out_the_producers_block_read_only(producer_process):
    command, token = producer_process
    consumer = ecx.Connector(json.dumps({
        "connector": "p2p", "role": "consumer",
        "extra": {"engine_id": f"pd-zc-{os.getpid()}", "pool_bytes": "64MiB",
                  "auth_token": token, "zero_copy": True, "keep_loaded": False}}))
    mm_hash = f"pkg-zc-{os.getpid()}"
    params = command(f"save {mm_hash} BF16 400,2048 7")
    assert "error" not in json.loads(params), params
    outcome = consumer.load("req-zc", [ecx.Item(mm_hash, "BF16", [400, 2048], params)], 30000)
    assert outcome["ok"], outcome
    got = consumer.loaded("req-zc", mm_hash)
    assert np.array_equal(got, payload(7, 400 * 2048 * 2))
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0] = 1  # E's block is not the PD's to write
    stats = consumer.stats()
    assert stats["views_held"] == 1, stats
    assert stats["consumer_cache"]["entries"] == 0, "a view takes no block of PD's cache"
    # The array still views E's block: the request's end waits for it, so it is never
    # read after E may reuse the block for another item.
    part = got[:64]  # a view of the view holds it too
    del got
    consumer.request_finished("req-zc")
    assert consumer.stats()["views_held"] == 1
    assert np.array_equal(part, payload(7, 400 * 2048 * 2)[:64])
    with pytest.raises(ecx.Error) as err:
        consumer.loaded("req-zc", mm_hash)  # finished: no new array
    assert err.value.code == "failed_precondition"
    del part
    assert consumer.stats()["views_held"] == 0
    assert settled(lambda: producer_pins(command), 0) == 0


def test_a_copy_of_a_loaded_item_is_its_own_and_its_buffer_serves_the_next_copy(
        producer_process):
    command, token = producer_process
    consumer = ecx.Connector(json.dumps({
        "connector": "p2p", "role": "consumer",
        "extra": {"engine_id": f"pd-copy-{os.getpid()}", "pool_bytes": "64MiB",
                  "auth_token": token, "keep_loaded": False}}))
    buffers = ecx.CopyBuffers("8MiB")
    addresses = []
    for i in range(2):
        mm_hash = f"pkg-copy-{os.getpid()}-{i}"
        params = command(f"save {mm_hash} BF16 400,2048 {20 + i}")
        assert "error" not in json.loads(params), params
        with ecx.load(consumer, f"req-copy-{i}", [ecx.Item(mm_hash, "BF16", [400, 2048], params)],
                      30000) as outcome:
            assert outcome["ok"], outcome
            copy = consumer.loaded_copy(f"req-copy-{i}", mm_hash, buffers)
            assert copy.__array_interface__["data"][0] != \
                consumer.loaded_address(f"req-copy-{i}", mm_hash), "a copy, not the block"
        # The request ended (its pins at E back), the copy stays: it is the caller's.
        assert settled(lambda: producer_pins(command), 0) == 0
        assert np.array_equal(copy, payload(20 + i, 400 * 2048 * 2))
        assert copy.flags.writeable
        copy[:4] = 0
        addresses.append(copy.__array_interface__["data"][0])
        with pytest.raises(ecx.Error) as err:
            consumer.loaded_copy(f"req-copy-{i}", mm_hash, buffers)  # the request ended
        assert err.value.code in ("not_found", "failed_precondition"), err.value.code
        del copy
    # The first copy's buffer, given back when its array went, took the second copy.
    assert addresses[0] == addresses[1]
    assert buffers.stats() == {"reused": 1, "allocated": 1, "released": 0,
                               "idle_bytes": 1664 * 1024}  # 1600 KiB, in 128 KiB steps
    # An item whose end was asked for (put off while an array views it) is not copied:
    # the copy would read what is being given back.
    mm_hash = f"pkg-copy-{os.getpid()}-ending"
    params = command(f"save {mm_hash} BF16 400,2048 29")
    outcome = consumer.load("req-ending", [ecx.Item(mm_hash, "BF16", [400, 2048], params)], 30000)
    assert outcome["ok"], outcome
    view = consumer.loaded("req-ending", mm_hash)
    consumer.item_finished("req-ending", mm_hash)
    with pytest.raises(ecx.Error) as err:
        consumer.loaded_copy("req-ending", mm_hash, buffers)
    assert err.value.code == "failed_precondition"
    del view
    consumer.request_finished("req-ending")
    assert settled(lambda: producer_pins(command), 0) == 0


def producer_pins(command) -> int:
    return json.loads(command("stats"))["producer_pool"]["pins"]


def settled(probe, want, seconds: float = 10.0):
    """probe() once it returns `want` (releases travel asynchronously), else its last value."""
    end = threading.Event()
    for _ in range(int(seconds / 0.05)):
        got = probe()
        if got == want:
            return got
        end.wait(0.05)
    return probe()


def zero_copy_worker(name: str, token: str, lease_ms: int, zero_copy: bool = True):
    """ECXConnector's consumer worker as vLLM makes it (zero_copy unless told), with its
    connector and counters, in this process."""
    from ecx.vllm._common import InstanceConfig
    from ecx.vllm._consumer import ConsumerWorker
    from ecx.vllm._metrics import Counters

    config = InstanceConfig(name=f"{name}-{os.getpid()}", role="consumer",
                            extra={"auth_token": token, "zero_copy": zero_copy, "lease_ms": lease_ms},
                            policy="recompute", load_timeout_ms=30000, params_timeout_ms=2000,
                            first_look_wait_ms=10, first_look_step_ms=50, metrics_port=None,
                            metrics_host="127.0.0.1", rendezvous_dir=None, tp_size=1)
    conn = ecx.Connector(config.ecx_config("consumer", f"{config.name}-w0", 1, keep_loaded=False,
                                           pool_bytes="64MiB"))
    counters = Counters()
    return conn, counters, ConsumerWorker(config, conn, 0, counters)


def saved_items(command, tag: str, shape: list[int], count: int, first_seed: int) -> list:
    """`count` BF16 items the producer process saved (payload seeds first_seed, ...), as
    the worker loads vLLM's scheduler hands ECXConnector's worker (identifiers image-i)."""
    from ecx.vllm._consumer import WorkerLoad

    loads = []
    for i in range(count):
        key = f"pkg-{tag}-{os.getpid()}-{i}"
        params = command(f"save {key} BF16 {shape[0]},{shape[1]} {first_seed + i}")
        assert "error" not in json.loads(params), params
        loads.append(WorkerLoad(request_id="r", identifier=f"image-{i}", key=key, dtype="BF16",
                                shape=shape, params=[params]))
    return loads


@pytest.mark.parametrize("producer_process", [{"lease_ms": 600}], indirect=True)
def test_vllms_encoder_cache_holds_zero_copy_items_in_place_until_it_frees_them(
        producer_process):
    """ECXConnector's worker (zero_copy, a CPU engine) puts into vLLM's encoder cache a
    tensor over E's block itself (DLPack, read-only, no copy). Each item's view keeps its
    own pin at E, renewed past E's lease, until vLLM drops the entry and every view of it."""
    import torch

    command, token = producer_process
    conn, counters, worker = zero_copy_worker("pd-inplace", token, lease_ms=600)
    shape = [400, 2048]
    loads = saved_items(command, "inplace", shape, count=2, first_seed=40)
    cache: dict[str, torch.Tensor] = {}
    worker.load(loads, cache, torch.device("cpu"))
    expected = [torch.from_numpy(payload(40 + i, shape[0] * shape[1] * 2)) for i in range(2)]
    for i in range(2):
        got = cache[f"image-{i}"]
        assert got.dtype == torch.bfloat16 and list(got.shape) == shape
        assert torch.equal(got.view(torch.uint8).flatten(), expected[i])
        # No copy: the tensor is the view, E's block mapped into this process. One request
        # of the worker loaded both items (one lookup at E for the step).
        assert got.data_ptr() == conn.loaded_address("step-1", loads[i].key)
    del got
    taken = counters.take()
    assert taken["worker_items_in_place"] == 2 and taken["worker_items"] == 0, taken
    assert conn.stats()["views_held"] == 2
    # Per item at E: the view's own pin and the params' pin, both held and renewed by the
    # view's request (docs/CONNECTORS.md, "Zero-copy loads").
    assert producer_pins(command) == 4
    # Past several of E's leases the views still hold: the worker renews their pins.
    threading.Event().wait(2.0)
    assert conn.stats()["views_held"] == 2
    assert conn.stats()["view_renewals_failed"] == 0
    assert producer_pins(command) == 4
    for i in range(2):
        assert torch.equal(cache[f"image-{i}"].view(torch.uint8).flatten(), expected[i])
    # vLLM frees one entry; a slice of it (as the model's gather makes) keeps it a while.
    piece = cache.pop("image-0")[:10]
    assert conn.stats()["views_held"] == 2
    del piece
    assert conn.stats()["views_held"] == 1
    assert settled(lambda: producer_pins(command), 2) == 2
    # The other item of that step's request is still held and renewed past E's lease.
    threading.Event().wait(1.0)
    assert conn.stats()["view_renewals_failed"] == 0
    assert producer_pins(command) == 2
    assert torch.equal(cache["image-1"].view(torch.uint8).flatten(), expected[1])
    cache.clear()
    assert conn.stats()["views_held"] == 0
    assert settled(lambda: producer_pins(command), 0) == 0


def test_a_copying_worker_copies_into_the_buffers_of_entries_vllm_evicted(producer_process):
    """A copying worker on a CPU engine copies each item into a host buffer of its own
    (vLLM keeps it; ecx's block is given back). Once vLLM evicts entries, their buffers,
    already faulted in, take the next copies instead of fresh memory."""
    import torch

    command, token = producer_process
    conn, counters, worker = zero_copy_worker("pd-copying", token, 10000, zero_copy=False)
    shape = [400, 2048]
    addresses = []
    for step, seed in enumerate((60, 70)):
        loads = saved_items(command, f"copying{step}", shape, count=2, first_seed=seed)
        cache: dict[str, torch.Tensor] = {}
        worker.load(loads, cache, torch.device("cpu"))
        for i in range(2):
            got = cache[f"image-{i}"]
            assert got.dtype == torch.bfloat16 and list(got.shape) == shape
            assert torch.equal(got.view(torch.uint8).flatten(),
                               torch.from_numpy(payload(seed + i, shape[0] * shape[1] * 2)))
        taken = counters.take()
        assert taken["worker_items"] == 2 and taken["worker_items_in_place"] == 0, taken
        assert taken["worker_copies_warm"] == (0 if step == 0 else 2), taken
        # Copies: the step's pins at E end with the step, whatever vLLM keeps.
        assert settled(lambda: producer_pins(command), 0) == 0
        addresses.append({t.data_ptr() for t in cache.values()})
        cache[f"image-0"][0, 0] = 1.0  # vLLM's own tensor: writable
        del got
        cache.clear()  # vLLM evicts both entries
    assert addresses[0] == addresses[1], "the second step's copies reused the first's buffers"


class _CacheFullAfterOne(dict):
    """An encoder cache that takes one entry, then raises (a step cut short)."""

    def __setitem__(self, key, value):
        if self:
            raise RuntimeError("encoder cache full")
        super().__setitem__(key, value)


@pytest.mark.parametrize("producer_process", [{"lease_ms": 600}], indirect=True)
def test_a_worker_step_cut_short_keeps_only_the_pins_of_the_entry_it_made(producer_process):
    """A zero-copy worker step that raises midway (vLLM's cache refuses its second item)
    keeps the entry it made, held and renewed, and gives back the pins of the item it was
    putting in and of the one it never reached, without waiting for the entry's end."""
    import torch

    command, token = producer_process
    conn, counters, worker = zero_copy_worker("pd-cutshort", token, lease_ms=600)
    shape = [64, 1024]
    loads = saved_items(command, "cutshort", shape, count=3, first_seed=60)
    cache = _CacheFullAfterOne()
    with pytest.raises(RuntimeError, match="encoder cache full"):
        worker.load(loads, cache, torch.device("cpu"))
    assert list(cache) == ["image-0"]
    assert settled(lambda: conn.stats()["views_held"], 1) == 1
    # Item 0's view pin and params pin at E; items 1 and 2 gave theirs back.
    assert settled(lambda: producer_pins(command), 2) == 2
    threading.Event().wait(1.0)  # past E's lease: the entry's pins are renewed
    assert conn.stats()["view_renewals_failed"] == 0 and producer_pins(command) == 2
    expected = torch.from_numpy(payload(60, shape[0] * shape[1] * 2))
    assert torch.equal(cache["image-0"].view(torch.uint8).flatten(), expected)
    cache.clear()
    assert settled(lambda: producer_pins(command), 0) == 0
    assert conn.stats()["views_held"] == 0


@pytest.mark.parametrize("producer_process", [{"lease_ms": 600}], indirect=True)
def test_an_in_place_item_whose_block_e_reused_leaves_vllms_encoder_cache(producer_process):
    """A worker that renews too seldom (its lease_ms 100x E's): its pins at E lapse, and E
    reuses the block for other items. Before the next step, the entry over that block
    leaves vLLM's encoder cache (counted as view_lost): no step reads another item's
    bytes as this one's."""
    import torch

    from ecx.vllm._consumer import WorkerLoad

    command, token = producer_process
    conn, counters, worker = zero_copy_worker("pd-lapse", token, lease_ms=60000)
    shape = [400, 2048]
    key = f"pkg-lapse-{os.getpid()}"
    params = command(f"save {key} BF16 {shape[0]},{shape[1]} 77")
    assert "error" not in json.loads(params), params
    cache: dict[str, torch.Tensor] = {}
    worker.load([WorkerLoad(request_id="r", identifier="image", key=key, dtype="BF16",
                            shape=shape, params=[params])], cache, torch.device("cpu"))
    assert counters.take()["worker_items_in_place"] == 1
    worker.check_in_place(cache)
    assert "image" in cache  # intact: held, its header the item's
    # E's lease passes with no renewal (the worker's comes every 20 s): the pins lapse.
    assert settled(lambda: producer_pins(command), 0) == 0
    # E needs the room: 48 other items through its 64 MiB pool reuse every free block.
    for i in range(48):
        out = command(f"save {key}-other-{i} BF16 {shape[0]},{shape[1]} {i}")
        assert "error" not in json.loads(out), out
    worker.check_in_place(cache)
    assert "image" not in cache
    assert counters.take()["failures"] == {"view_lost": 1}
    assert settled(lambda: conn.stats()["views_held"], 0) == 0  # the request ended too


MISUSE = r"""
import json, sys, numpy as np, ecx
case = sys.argv[1]
if case == "buffer":
    agent = ecx.Agent("misuse-buffer")
    region = agent.allocate(1 << 20)
    view = agent.buffer(region.id)[100:200]
    try:
        agent.deregister(region.id)
        print("deregistered")
    except ecx.Error as e:
        print("refused", e.code)
    print(int(view.sum()))
    del view
    agent.deregister(region.id)
    print("deregistered once unviewed")
elif case == "zero_copy_producer_gone":
    token = "misuse-secret-0123456789abcdef"
    producer = ecx.Connector(json.dumps({"connector": "p2p", "role": "producer", "extra": {
        "engine_id": "misuse-e", "pool_bytes": "16MiB", "auth_token": token}}))
    data = np.arange(4096, dtype=np.uint8)
    params = producer.save("misuse-item", "U8", [4096], data)
    consumer = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {
        "engine_id": "misuse-pd", "pool_bytes": "16MiB", "auth_token": token,
        "zero_copy": True, "keep_loaded": False}}))
    outcome = consumer.load("r", [ecx.Item("misuse-item", "U8", [4096], params)], 30000)
    assert outcome["ok"], outcome
    got = consumer.loaded("r", "misuse-item")
    consumer.request_finished("r")
    del producer  # the in-process producer goes, its arena with it
    import time
    time.sleep(1)  # the consumer drops a gone peer's mappings on a background thread
    print("same" if np.array_equal(got, data) else "changed")
elif case == "bad_arguments":
    for call in (lambda: ecx.EncoderCachePool("str"),
                 lambda: ecx.Agent("misuse-args").allocate(-5),
                 lambda: ecx.Agent("misuse-args2").read("x", [(1, 2)])):
        try:
            call()
            print("accepted")
        except (ecx.Error, TypeError) as e:
            print(type(e).__name__)
"""


@pytest.mark.parametrize("case,expected", [
    ("buffer", ["refused failed_precondition", "0", "deregistered once unviewed"]),
    ("zero_copy_producer_gone", ["same"]),
    ("bad_arguments", ["Error", "TypeError", "TypeError"]),
])
def test_binding_misuse_raises_and_never_crashes_the_interpreter(case, expected):
    """Each case in its own interpreter, so a crash fails it (it used to be a SIGSEGV: a
    region's array read after deregister(), a zero-copy array read after
    request_finished() once its in-process producer had gone; EncoderCachePool("str")
    raised RuntimeError std::bad_cast). Arguments of a wrong Python type (a negative
    size, a tuple of the wrong length) raise nanobind's TypeError; wrong values
    ecx.Error."""
    run = subprocess.run([sys.executable, "-c", MISUSE, case], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    said = [line for line in run.stdout.splitlines() if not line.startswith("[")]  # no logs
    assert said == expected, run.stdout
