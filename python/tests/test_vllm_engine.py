"""ECXConnector inside real `vllm serve` engines, under vLLM's default process layout
(on this CPU build: the API server, the EngineCore with the scheduler, and a worker, each
a process of its own; VLLM_ENABLE_V1_MULTIPROCESSING is left at its default).

An encoder (E, ec_producer) and a prefill/decode instance (PD, ec_consumer, policy
recompute) of the tiny Qwen2-VL, next to a single instance that is the reference:
- every request, with one or several images, gets the reference's greedy text from PD,
  PD's engine never runs the vision encoder, and E's pool holds no pin afterwards;
- the same from a second PD with zero_copy, which reads E's blocks in place;
- the same through ecx's proxy and through vLLM's own example EPD proxy (vLLM 0.32.0's,
  from its sdist on PyPI: scripts/deps puts it in .venv/share/vllm-examples);
- ECXConnector's figures show in vLLM's /metrics;
- tampered and mismatched params, and an encoder killed mid-run, leave both engines up,
  are counted, and end in a local encode with the right text."""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

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
    wait_until,
    png,
    warm_up,
)
from vllm_reference import REQUESTS, chat_body, fresh, fresh_video, images_of

from ecx_stack import EcxStack

EXAMPLE_PROXY = Path(os.environ.get("ECX_VLLM_EPD_PROXY") or Path(
    sys.executable).parent.parent / "share" / "vllm-examples" / "disagg_epd_proxy.py")


@pytest.fixture(scope="module")
def engines(tiny_model, deployment_secret, reference, tmp_path_factory):
    """E, PD and a second PD with zero_copy, started together next to the reference and
    stopped at the end. (An engine's start is three processes, each importing torch, one
    after another: started together, the engines keep both cores busy; the zero-copy PD
    started alone later took 67 s of a 541 s pytest run.)

    The zero-copy PD's ECXConnector reads E's blocks in place: its scheduler holds views
    of E's blocks, and vLLM's encoder cache in its worker holds tensors over them.
    VLLM_SERVER_DEV_MODE: its /reset_encoder_cache lets a test make vLLM free the
    entries."""
    logs = tmp_path_factory.mktemp("epd-default")
    common = {"auth_token_file": deployment_secret, "pool_bytes": "256MiB"}
    e_port, pd_port, zc_port = free_port(), free_port(), free_port()
    e_metrics, pd_metrics, zc_metrics = free_ports(2), free_ports(2), free_ports(2)
    # PD's agents listen on fixed ports (its scheduler's: the base), so that a proxy can
    # name its scheduler to E (an offer: test_an_encoder_offers_...).
    pd_agents = free_ports(2)
    # lease_ms of ten minutes: a pin that ends during a test was released, not expired.
    e = Engine("e", serve_argv(tiny_model, e_port, "--ec-transfer-config", ec_config(
        "ec_producer", {**common, "lease_ms": 600000, "metrics_port": e_metrics,
                        "offer_to": [f"127.0.0.1:{pd_agents}"]})),
        vllm_env(), e_port, logs / "e.log", metrics_port=e_metrics)
    pd = Engine("pd", serve_argv(tiny_model, pd_port, "--enable-logging-iteration-details",
                                 "--ec-transfer-config", ec_config(
                                     "ec_consumer", {**common, "metrics_port": pd_metrics,
                                                     "tcp_port": pd_agents})),
                vllm_env(), pd_port, logs / "pd.log", metrics_port=pd_metrics)
    pd.agent_port = pd_agents
    pd_zc = Engine("pd-zc", serve_argv(tiny_model, zc_port, "--enable-logging-iteration-details",
                                       "--ec-transfer-config", ec_config(
                                           "ec_consumer", {**common, "zero_copy": True,
                                                           "metrics_port": zc_metrics})),
                   vllm_env(VLLM_SERVER_DEV_MODE="1"), zc_port, logs / "pd-zc.log",
                   metrics_port=zc_metrics)
    with running(e, pd, pd_zc):
        # Nothing else starts while the tests run: four instances share two cores here.
        reference.engine.wait_ready()
        warm_up(e, pd, png(424242))
        yield e, pd, pd_zc


@pytest.fixture(scope="module")
def epd(engines):
    """E and PD with ECXConnector (its defaults: PD copies what it loads)."""
    e, pd, _ = engines
    return e, pd


@pytest.fixture(scope="module")
def pd_zero_copy(engines):
    """The PD with zero_copy, loading from the same E."""
    return engines[2]


def e_pins(e: Engine) -> float:
    return metric(e.worker_metrics(0), "ecx_pool_pins")


def pins_settle(e: Engine) -> float:
    """E's pins once PD's asynchronous RELEASEs arrived (bounded; the lease is 10 min)."""
    wait_until(lambda: e_pins(e) == 0, 20, "E's pins back to 0")
    return e_pins(e)


def pd_request(pd: Engine, index: int, params: dict) -> tuple[int, dict]:
    return post(pd.url + "/v1/chat/completions", chat_body(index, ec_transfer_params=params))


def text_of(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_requests_with_one_and_several_images_match_the_single_instance(epd, reference):
    e, pd = epd
    local = metric(pd.metrics(), "vllm:ecx_local_encodes_total")
    for i in range(len(REQUESTS)):
        params = encode_on(e, images_of(i))
        assert params, f"E returned no ec_transfer_params for request {i}"
        assert all(p["connector"] == "p2p" and "metadata" in p for p in params.values())
        status, body = pd_request(pd, i, params)
        assert status == 200, body
        assert text_of(body) == reference.text(i), f"request {i}"
    assert pd.encoder_iterations() == 0
    assert pins_settle(e) == 0
    assert metric(pd.metrics(), "vllm:ecx_local_encodes_total") == local


def test_a_video_is_one_item_moved_whole(epd, reference):
    """A video is one encoder-cache item: every sampled frame's tokens, the largest items
    EPD moves. E encodes it (alone, and beside an image), the PD loads it and answers as
    the single instance does, without running its encoder."""
    e, pd = epd
    loads = metric(pd.metrics(), "vllm:ecx_loads_total")
    load_bytes = metric(pd.metrics(), "vllm:ecx_load_bytes_total")
    before = pd.encoder_iterations()
    videos = [fresh_video(61, frames=32), fresh_video(62, frames=16, with_image=True)]
    for i in videos:
        params = encode_on(e, images_of(i))
        assert len(params) == len(images_of(i)), params
        status, body = pd_request(pd, i, params)
        assert status == 200, body
        assert text_of(body) == reference.text(i), f"request {i}"
    assert pd.encoder_iterations() == before
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_loads_total") >= loads + 3, 30,
               "PD counted the video loads")
    # The 32-frame video alone is 16 temporal patches of 16 tokens, 256 x 256 bf16.
    assert metric(pd.metrics(), "vllm:ecx_load_bytes_total") - load_bytes >= 256 * 256 * 2
    assert pins_settle(e) == 0


def test_a_zero_copy_pd_reads_the_encoders_blocks_in_place(epd, pd_zero_copy, reference):
    e, _ = epd
    pd = pd_zero_copy
    for i in range(len(REQUESTS)):
        params = encode_on(e, images_of(i))
        status, body = pd_request(pd, i, params)
        assert status == 200, body
        assert text_of(body) == reference.text(i), f"request {i}"
    assert pd.encoder_iterations() == 0
    # The scheduler viewed E's blocks (no copy into its cache on the load's path), and the
    # worker read them from E: the scheduler's cache was not on the bytes' way.
    assert metric(pd.metrics(pd.metrics_port), "ecx_items_viewed_total") > 0
    assert metric(pd.worker_metrics(0), "ecx_items_viewed_total") > 0
    # vLLM's encoder cache holds the items in place, tensors over E's blocks: the worker's
    # views (and so its pins at E) last past the requests, for as long as vLLM keeps them.
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_worker_items_in_place_total") > 0, 30,
               "PD counted items held in place")
    assert metric(pd.metrics(), "vllm:ecx_worker_items_total") == 0  # nothing was copied
    held = metric(pd.worker_metrics(0), "ecx_views_held")
    assert held > 0
    assert e_pins(e) >= held
    # vLLM frees its entries: the views end with the last tensor over them, and E's pins
    # come back.
    request = urllib.request.Request(pd.url + "/reset_encoder_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 200
    wait_until(lambda: metric(pd.worker_metrics(0), "ecx_views_held") == 0, 20,
               "the worker's views end once vLLM freed its entries")
    assert pins_settle(e) == 0
    # Later requests load again and get the reference's texts.
    for i in (0, 2):
        status, body = pd_request(pd, i, encode_on(e, images_of(i)))
        assert status == 200, body
        assert text_of(body) == reference.text(i), f"request {i} after the reset"
    request = urllib.request.Request(pd.url + "/reset_encoder_cache", method="POST")
    urllib.request.urlopen(request, timeout=30).close()
    assert pins_settle(e) == 0


def test_ecx_proxy_in_front_of_vllm_moves_the_embeddings(epd, reference, ecx_binary,
                                                         tmp_path):
    e, pd = epd
    loads = metric(pd.metrics(), "vllm:ecx_loads_total")
    with EcxStack(ecx_binary, tmp_path) as stack:
        # No --model, as QUICKSTART runs it: the proxy serves what the PD lists at
        # /v1/models (tiny-vlm, its --served-model-name).
        proxy = stack.start("proxy", "--upstream-api", "vllm", "--encoders", e.url,
                            "--pd", pd.url)
        with urllib.request.urlopen(proxy.url + "/v1/models", timeout=30) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny-vlm"]
        # Images, and a video beside an image: every media part goes to E, keyed by its
        # content hash, and the PD loads each.
        for i in (0, 2, 3, fresh_video(63, frames=16, with_image=True)):
            status, body = post(proxy.url + "/v1/chat/completions", chat_body(i))
            assert status == 200, body
            assert text_of(body) == reference.text(i)
    assert pd.encoder_iterations() == 0
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_loads_total") >= loads + 8, 30,
               "PD counted the proxy's loads")
    assert pins_settle(e) == 0


def test_vllms_example_proxy_moves_the_embeddings(epd, reference, tmp_path):
    e, pd = epd
    assert EXAMPLE_PROXY.is_file(), f"{EXAMPLE_PROXY}: run scripts/deps"
    port = free_port()
    proxy = Engine("vllm-proxy", [sys.executable, str(EXAMPLE_PROXY), "--host", "127.0.0.1",
                                  "--port", str(port), "--encode-servers-urls", e.url,
                                  "--decode-servers-urls", pd.url],
                   vllm_env(), port, tmp_path / "proxy.log", ready_marker=b"Uvicorn running on")
    proxy.start()
    try:
        proxy.wait_ready(120)
        for i in (1, 3, 5):
            status, body = post(proxy.url + "/v1/chat/completions", chat_body(i))
            assert status == 200, body
            assert text_of(body) == reference.text(i)
    finally:
        proxy.stop()
    # The proxy sends PD a reference to E's item (its grid, under E's name), not the image.
    assert "Rewrote" in proxy.log_text()
    assert pd.encoder_iterations() == 0
    assert pins_settle(e) == 0


def test_an_encoder_offers_the_items_to_the_pd_the_proxy_names(epd, reference, tmp_path):
    """A proxy names the PD it picked in E's request (vLLM's example proxy does with
    --ec-consumer-zmq-addrs, made for Mooncake: here PD's scheduler agent): E's
    ECXConnector offers that PD the request's items as soon as it issued their params, and
    the PD loads them while the request is still on its way, so that its scheduler finds
    them in its cache at first sight. First step by step (the offer landed before PD gets
    the request), then through vLLM's example proxy."""
    e, pd = epd
    address = f"127.0.0.1:{pd.agent_port}"
    scheduler = pd.metrics_port  # PD's scheduler's exporter (its workers': + rank + 1)

    def figures() -> tuple[float, float, float, float]:
        text = pd.metrics(scheduler)
        return (metric(e.metrics(e.metrics_port), "ecx_offers_sent_total"),
                metric(text, "ecx_items_offered_total"), metric(text, "ecx_local_hits_total"),
                metric(text, "ecx_items_loaded_total"))

    sent, offered, hits, loaded = figures()
    i = fresh(6, n_images=2)
    params = encode_on(e, images_of(i), consumer=address)
    wait_until(lambda: figures()[1] == offered + 2, 20, "PD loaded the offered items")
    status, body = pd_request(pd, i, params)
    assert status == 200, body
    assert text_of(body) == reference.text(i)
    now = figures()
    assert now[0] == sent + 1
    assert now[2] == hits + 2  # found at first sight
    assert now[3] == loaded + 2  # read from E once each: by the offer
    assert pins_settle(e) == 0

    port = free_port()
    proxy = Engine("vllm-proxy", [sys.executable, str(EXAMPLE_PROXY), "--host", "127.0.0.1",
                                  "--port", str(port), "--encode-servers-urls", e.url,
                                  "--decode-servers-urls", pd.url, "--ec-consumer-zmq-addrs",
                                  address],
                   vllm_env(), port, tmp_path / "proxy.log", ready_marker=b"Uvicorn running on")
    sent, offered, hits, loaded = figures()
    i = fresh(7, n_images=2)
    proxy.start()
    try:
        proxy.wait_ready(120)
        status, body = post(proxy.url + "/v1/chat/completions", chat_body(i))
        assert status == 200, body
        assert text_of(body) == reference.text(i)
    finally:
        proxy.stop()
    now = figures()
    assert now[0] == sent + 1
    # Each item read from E once, by the offer or (had the request overtaken it) by the
    # request's own load, which the other then joins or finds.
    assert now[3] == loaded + 2
    assert pd.encoder_iterations() == 0
    assert pins_settle(e) == 0


def test_vllm_metrics_show_the_transfers(epd):
    e, pd = epd
    loads = metric(pd.metrics(), "vllm:ecx_loads_total")
    i = fresh(1, n_images=3)
    status, _ = pd_request(pd, i, encode_on(e, images_of(i)))
    assert status == 200
    text = wait_until(lambda: (lambda t: t if metric(t, "vllm:ecx_loads_total") >= loads + 3
                               else "")(pd.metrics()), 30, "vllm:ecx_loads_total in PD's /metrics")
    assert metric(text, "vllm:ecx_load_bytes_total") >= 3 * 16 * 256 * 2
    assert metric(text, "vllm:ecx_load_seconds_count") >= 1
    # The worker's figures reach PD's scheduler through vLLM's worker metadata.
    assert metric(text, "vllm:ecx_worker_items_total") >= 3
    e_text = wait_until(lambda: (lambda t: t if metric(t, "vllm:ecx_params_issued_total") >= 3
                                 else "")(e.metrics()), 30, "params issued in E's /metrics")
    assert metric(e_text, "vllm:ecx_params_issued_total") >= 3
    # An encode-only instance's V1 runner drops its worker's connector output, so E's
    # worker figures are on ECXConnector's exporter (metrics_port + 1).
    assert metric(e.worker_metrics(0), "ecx_saves_total") >= 3
    assert metric(pd.worker_metrics(0), "ecx_loads_ok_total") >= 1
    # PD's worker read the items where its scheduler holds them (a view, then one copy
    # into vLLM's tensor), not through a cache of its own.
    assert metric(pd.worker_metrics(0), "ecx_items_viewed_total") >= 3


def test_tampered_params_are_counted_and_the_item_encoded_on_pd(epd, reference):
    e, pd = epd
    before = pd.encoder_iterations()
    failures = metric(pd.metrics(), "vllm:ecx_load_failures_total", cause="untrusted_params")
    i = fresh(2)
    params = encode_on(e, images_of(i))
    for entry in params.values():
        sig = entry["signature"]
        entry["signature"] = ("0" if sig[0] != "0" else "1") + sig[1:]
    status, body = pd_request(pd, i, params)
    assert status == 200, body
    assert text_of(body) == reference.text(i)
    assert pd.encoder_iterations() > before  # recompute: PD encoded it
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_load_failures_total",
                              cause="untrusted_params") > failures, 30, "counted")
    assert pd.alive() and e.alive()


def test_params_under_another_name_are_counted_and_the_encoders_pins_released(epd, reference):
    e, pd = epd
    mismatches = metric(pd.metrics(), "vllm:ecx_load_failures_total", cause="mismatch")
    before = e_pins(e)  # the tampered params' pin stays: nobody may end it but its lease
    i = fresh(3)
    params = encode_on(e, images_of(i))
    assert e_pins(e) == before + 1
    renamed = {"not-" + k: v for k, v in params.items()}  # a uuid E saw and PD did not
    status, body = pd_request(pd, i, renamed)
    assert status == 200, body
    assert text_of(body) == reference.text(i)
    # Released by PD at once: the lease (10 min) cannot be what ended it.
    wait_until(lambda: e_pins(e) == before, 20, "E's pin released")
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_load_failures_total",
                              cause="mismatch") > mismatches, 30, "counted")
    assert pd.alive() and e.alive()


def as_reference(params: dict, text: str) -> list[dict]:
    """The messages vLLM's example EPD proxy sends PD once E answered: each image replaced
    by a reference (its grid, under E's name), no pixels."""
    content = []
    for name, entry in params.items():
        grid = {k: [x for v in values for x in (v if isinstance(v, list) else [v])]
                for k, values in entry["metadata"].items()}
        content.append({"type": "image_embeds", "image_embeds": grid, "uuid": name})
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def test_an_item_without_media_fails_cleanly_when_its_load_fails(epd):
    """Under policy recompute, an item PD cannot load is encoded on PD, unless it came as
    a reference without its pixels (vLLM's example proxy sends that): vLLM's encoder would
    assert on it and take the engine down. Such a request fails; PD serves on."""
    e, pd = epd
    before = pd.encoder_iterations()
    i = fresh(5)
    params = encode_on(e, images_of(i))
    assert all("metadata" in entry for entry in params.values()), params
    tampered = {name: {**entry, "offset": entry["offset"] + 64} for name, entry in params.items()}
    body = {"model": "tiny-vlm", "max_tokens": 4, "temperature": 0,
            "messages": as_reference(params, "Which image?")}
    status, answer = post(pd.url + "/v1/chat/completions",
                          {**body, "ec_transfer_params": tampered})
    assert status >= 500, answer  # vLLM's answer to a request its scheduler failed
    # A client that sends PD a reference with no params at all fails the same way.
    status, answer = post(pd.url + "/v1/chat/completions", body)
    assert status >= 400, answer
    assert pd.encoder_iterations() == before
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_load_failures_total",
                              cause="not_recomputable") >= 2, 30, "counted")
    # PD's engine is alive and serves the untampered reference from E.
    status, answer = post(pd.url + "/v1/chat/completions", {**body, "ec_transfer_params": params})
    assert status == 200, answer
    assert pd.alive() and e.alive()


def pd_saw_encoder_die(pd: Engine, before: float) -> None:
    """Waits until PD's scheduler agent saw its connection to E break. (Until then, on one
    host, PD may still read E's already-published items from the shared memory it mapped,
    which stays valid, and intact, after E's death; that race is not what is tested.)"""
    wait_until(lambda: metric(pd.metrics(pd.metrics_port), "ecx_peer_failures_total") > before,
               30, "PD's agent saw E die")


def test_an_encoder_killed_mid_run_leaves_the_pd_recomputing(epd, reference):
    """Runs last in this module: E does not come back."""
    e, pd = epd
    local = metric(pd.metrics(), "vllm:ecx_local_encodes_total")
    failures = metric(pd.metrics(pd.metrics_port), "ecx_peer_failures_total")
    i = fresh(4, n_images=2)
    params = encode_on(e, images_of(i))
    e.kill()
    pd_saw_encoder_die(pd, failures)
    started = time.monotonic()
    status, body = pd_request(pd, i, params)
    elapsed = time.monotonic() - started
    assert status == 200, body
    assert text_of(body) == reference.text(i)
    assert elapsed < 10 + 60  # the load deadline (10 s) plus the local encode and decode
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_local_encodes_total") >= local + 2, 30,
               "counted as local encodes")
    assert metric(pd.metrics(), "vllm:ecx_load_failures_total", cause="unavailable") >= 2
    assert pd.alive()
