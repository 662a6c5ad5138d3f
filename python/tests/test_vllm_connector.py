"""ecx.vllm.ECXConnector against the real vllm==0.33.0 package: vLLM's factory makes it,
vLLM's base class defines what it must implement, and a producer process and a consumer
here, each driven through the hooks in the order vLLM's scheduler and model runner call
them, move real torch tensors bit-exact. No GPU: tensors are on the CPU (the CUDA path is
the same code with a device copy), and vLLM's engine loop itself is not run."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm_support import connectors, empty_step, request, tensor

from ecx.vllm import ECXConnector
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

HERE = Path(__file__).resolve().parent


def test_vllms_factory_makes_the_connector_from_the_module_path():
    scheduler, worker = connectors("ec_consumer", {"engine_id": f"pd-factory-{os.getpid()}"})
    assert type(scheduler) is ECXConnector and type(worker) is ECXConnector
    assert isinstance(scheduler, ECConnectorBase)
    assert scheduler.is_consumer and not scheduler.is_producer


def test_the_scheduler_and_worker_share_one_ecx_connector_until_both_shut_down():
    extra = {"engine_id": f"pd-shared-{os.getpid()}"}
    scheduler, worker = connectors("ec_consumer", extra)
    shared = scheduler._shared.conn
    assert worker._shared.conn is shared
    scheduler.shutdown()
    again, again_worker = connectors("ec_consumer", extra)  # the worker still uses it
    assert again._shared.conn is shared
    again.shutdown()
    again_worker.shutdown()
    worker.shutdown()  # the last user: the ecx connector stops
    fresh, fresh_worker = connectors("ec_consumer", extra)
    assert fresh._shared.conn is not shared
    fresh.shutdown()
    fresh_worker.shutdown()


def test_the_abstract_api_is_what_the_connector_was_written_for():
    # A change in vLLM's EC connector API fails here first.
    assert ECConnectorBase.__abstractmethods__ == {
        "build_connector_meta", "has_cache_item", "save_caches", "start_load_caches",
        "update_state_after_alloc"}


def test_bad_extra_config_names_the_key():
    import ecx
    with pytest.raises(ecx.Error) as err:
        connectors("ec_consumer", {"engine_id": "pd-bad", "lease_msec": 5})
    assert "lease_msec" in err.value.message
    with pytest.raises(ecx.Error) as err:
        connectors("ec_consumer", {"engine_id": "pd-bad2", "load_timeout_ms": "soon"})
    assert "load_timeout_ms" in err.value.message


class Producer:
    def __init__(self, extra: dict):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "vllm_producer.py"), json.dumps(extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=HERE)
        assert self.proc.stdout.readline().strip() == "ready"

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def encode(self, request_id: str, items: list[tuple[str, int, list[int]]]) -> dict:
        spec = " ".join(f"{h}:{seed}:{','.join(map(str, shape))}" for h, seed, shape in items)
        return json.loads(self.ask(f"encode {request_id} {spec}"))

    def pins_settled(self) -> int:
        for _ in range(100):  # RELEASE travels asynchronously; far below any lease
            pins = int(self.ask("pins"))
            if pins == 0:
                return 0
            time.sleep(0.05)
        return pins

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture()
def deployment():
    token = secrets.token_hex(16)
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    base = {"auth_token": token, "pool_bytes": "64MiB", "load_timeout_ms": 5000}
    producer = Producer({**base, "engine_id": f"e-{tag}", "lease_ms": 600000})

    def consumer(policy: str = "recompute", name: str = "pd"):
        return connectors("ec_consumer", {**base, "engine_id": f"{name}-{tag}-{policy}",
                                          "failure_policy": policy})

    yield producer, consumer
    producer.stop()


def load_through_hooks(scheduler, worker, req) -> dict:
    """What vLLM does for a request on a consumer, one scheduler step plus one worker step."""
    assert scheduler.wait_for_loads(req, timeout_s=30)  # ensure_cache_available until admitted
    for i, feature in enumerate(req.mm_features):
        if scheduler.has_cache_item(feature.identifier):
            scheduler.update_state_after_alloc(req, i)
    step = empty_step()
    step.ec_connector_metadata = scheduler.build_connector_meta(step)
    worker.bind_connector_metadata(step.ec_connector_metadata)
    encoder_cache = {}
    worker.start_load_caches(encoder_cache)
    _, received = worker.get_finished(set())
    assert received == {req.request_id}
    worker.clear_connector_metadata()
    return encoder_cache


def test_tensors_arrive_bit_exact_and_the_pins_come_back(deployment):
    producer, consumer = deployment
    scheduler, worker = consumer()
    items = [("img-seed", 1, [400, 2048]), ("img-odd", 2, [3, 5]), ("img-one", 3, [1, 7])]
    for r in range(3):  # the pool drains after every request, not by lease
        hashes = [(f"{h}-{r}", seed + 10 * r, shape) for h, seed, shape in items]
        params = producer.encode(f"e-req-{r}", hashes)
        assert set(params) == {h for h, _, _ in hashes}
        assert all(p["item_indices"] == [i] for i, p in enumerate(params.values()))
        req = request(f"pd-req-{r}", [(h, shape[0]) for h, _, shape in hashes], params)
        cache = load_through_hooks(scheduler, worker, req)
        for h, seed, shape in hashes:
            assert cache[h].dtype == torch.bfloat16 and list(cache[h].shape) == shape
            assert torch.equal(cache[h], tensor(seed, shape)), h
        assert scheduler.take_unavailable_requests() == set()
        assert scheduler.request_finished(req) == (False, None)
        assert producer.pins_settled() == 0


def test_an_item_the_producer_no_longer_holds_fails_cleanly(deployment):
    producer, consumer = deployment
    params = producer.encode("e-gone", [("img-gone", 5, [16, 64])])
    # A first consumer reads the item and gives its pin back: the params grant nothing now.
    first, first_worker = consumer(name="first")
    used = request("first-gone", [("img-gone", 16)], params)
    assert "img-gone" in load_through_hooks(first, first_worker, used)
    first.request_finished(used)
    assert producer.pins_settled() == 0
    for policy in ("fail", "recompute"):
        scheduler, _ = consumer(policy)
        req = request(f"pd-gone-{policy}", [("img-gone", 16)], params)
        started = time.monotonic()
        assert scheduler.wait_for_loads(req, timeout_s=30)
        assert time.monotonic() - started < 30
        assert not scheduler.has_cache_item("img-gone")  # vLLM would encode it itself
        unavailable = scheduler.take_unavailable_requests()
        assert unavailable == ({req.request_id} if policy == "fail" else set())
        scheduler.request_finished(req)


def test_a_killed_producer_reaches_take_unavailable_requests_within_the_deadline(deployment):
    producer, consumer = deployment
    params = producer.encode("e-dead", [("img-dead", 6, [16, 64])])
    producer.proc.send_signal(signal.SIGKILL)
    producer.proc.wait(timeout=30)
    scheduler, _ = consumer("fail")
    req = request("pd-dead", [("img-dead", 16)], params)
    assert scheduler.wait_for_loads(req, timeout_s=30)  # load_timeout_ms is 5 s: no hang
    assert scheduler.take_unavailable_requests() == {"pd-dead"}
    assert not scheduler.has_cache_item("img-dead")
    scheduler.request_finished(req)


def test_malformed_params_fail_the_item_cleanly(deployment):
    producer, consumer = deployment
    params = producer.encode("e-bad", [("img-bad", 7, [16, 64])])
    broken = {"img-bad": {**params["img-bad"], "offset": "not a number"}}
    for policy in ("fail", "recompute"):
        scheduler, _ = consumer(policy)
        req = request(f"pd-bad-{policy}", [("img-bad", 16)], broken)
        assert scheduler.wait_for_loads(req, timeout_s=30)  # no exception into vLLM's loop
        assert not scheduler.has_cache_item("img-bad")
        unavailable = scheduler.take_unavailable_requests()
        assert unavailable == ({req.request_id} if policy == "fail" else set())
        scheduler.request_finished(req)
