"""ECXConnector in vLLM's other process layout, and with failure_policy "fail".

E and PD run with VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler and the worker share
the EngineCore process (the API server is still its own). The PD fails what it cannot
load, and must do so before any local encode or prefill work, with its engine alive:
- an encoder that stalls (SIGSTOP) fails the request by the load deadline;
- answers equal the single instance's, with no encoder iteration on PD;
- tampered params fail the request without an encoder iteration;
- an encoder that died fails the request by the load deadline."""
from __future__ import annotations

import time

import pytest
from vllm_engines import (
    Engine,
    ec_config,
    encode_on,
    free_port,
    free_ports,
    metric,
    post,
    running,
    serve_argv,
    vllm_env,
    png,
    wait_until,
    warm_up,
)
from vllm_reference import chat_body, images_of

LOAD_TIMEOUT_MS = 8000


@pytest.fixture(scope="module")
def epd_fail(tiny_model, deployment_secret, reference, tmp_path_factory):
    logs = tmp_path_factory.mktemp("epd-inprocess")
    common = {"auth_token_file": deployment_secret, "pool_bytes": "128MiB",
              "load_timeout_ms": LOAD_TIMEOUT_MS}
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    e_port, pd_port = free_port(), free_port()
    e_metrics, pd_metrics = free_ports(2), free_ports(2)
    e = Engine("e", serve_argv(tiny_model, e_port, "--ec-transfer-config", ec_config(
        "ec_producer", {**common, "lease_ms": 600000, "metrics_port": e_metrics})),
        env, e_port, logs / "e.log", metrics_port=e_metrics)
    pd = Engine("pd", serve_argv(tiny_model, pd_port, "--enable-logging-iteration-details",
                                 "--ec-transfer-config", ec_config(
                                     "ec_consumer", {**common, "failure_policy": "fail",
                                                     "metrics_port": pd_metrics})),
                env, pd_port, logs / "pd.log", metrics_port=pd_metrics)
    with running(e, pd):
        reference.engine.wait_ready()
        yield e, pd


def pd_request(pd: Engine, index: int, params: dict) -> tuple[int, dict]:
    return post(pd.url + "/v1/chat/completions", chat_body(index, ec_transfer_params=params))


def failures(pd: Engine, cause: str) -> float:
    return metric(pd.metrics(), "vllm:ecx_load_failures_total", cause=cause)


def test_a_stalled_encoder_fails_the_load_by_its_deadline(epd_fail):
    """Runs first: PD has not met E yet, so its first load needs E's handshake. (Once
    connected on one host, PD reads E's pool through shared memory without E's help.)"""
    e, pd = epd_fail
    params = encode_on(e, images_of(2))
    e.pause()
    try:
        started = time.monotonic()
        status, body = pd_request(pd, 2, params)
        elapsed = time.monotonic() - started
    finally:
        e.resume()
    assert status >= 500, body
    assert elapsed < LOAD_TIMEOUT_MS / 1000 + 30
    assert pd.encoder_iterations() == 0
    assert pd.alive()
    # While the load stalled PD had nothing else to run: its scheduler waited on the load
    # after each empty step (hundreds of times in 8 s) rather than let vLLM run empty
    # steps back to back.
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_idle_waits_total") >= 10, 20,
               "PD's scheduler waits on a stalled load while its engine is idle")
    wait_until(lambda: e.alive(), 60, "E answers again after SIGCONT")


def test_in_process_layout_matches_the_single_instance(epd_fail, reference):
    e, pd = epd_fail
    warm_up(e, pd, png(434343))  # PD connects to E again after the stall
    for i in (0, 3, 6):
        status, body = pd_request(pd, i, encode_on(e, images_of(i)))
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == reference.text(i)
    assert pd.encoder_iterations() == 0
    wait_until(lambda: metric(e.worker_metrics(0), "ecx_pool_pins") == 0, 20,
               "E's pins back to 0")


def test_policy_fail_fails_tampered_params_before_any_encode(epd_fail):
    e, pd = epd_fail
    before = failures(pd, "untrusted_params")
    params = encode_on(e, images_of(1))
    for entry in params.values():
        entry["offset"] = entry["offset"] + 64  # still well-formed, no longer signed
    status, body = pd_request(pd, 1, params)
    assert status >= 500, body  # vLLM's answer to a request its scheduler failed
    assert pd.encoder_iterations() == 0  # failed before a local encode (or a prefill)
    wait_until(lambda: failures(pd, "untrusted_params") > before, 30, "counted")
    assert pd.alive() and e.alive()


def test_a_dead_encoder_fails_the_request_and_pd_serves_on(epd_fail):
    """Runs last: E does not come back."""
    e, pd = epd_fail
    failures = metric(pd.metrics(pd.metrics_port), "ecx_peer_failures_total")
    params = encode_on(e, images_of(5))
    e.kill()
    wait_until(lambda: metric(pd.metrics(pd.metrics_port), "ecx_peer_failures_total") > failures,
               30, "PD's agent saw E die")
    started = time.monotonic()
    status, body = pd_request(pd, 5, params)
    assert status >= 500, body
    assert time.monotonic() - started < LOAD_TIMEOUT_MS / 1000 + 30
    assert pd.encoder_iterations() == 0
    # The engine serves on: a text-only request is answered.
    status, body = post(pd.url + "/v1/chat/completions",
                        {"model": "tiny-vlm", "max_tokens": 4, "temperature": 0,
                         "messages": [{"role": "user", "content": "Hello"}]})
    assert status == 200, body
