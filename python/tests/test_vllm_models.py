"""ECXConnector moves whatever each model's encoder produced: one tiny random model per
architecture family vLLM users run with EPD (bench/python/tiny_vlm.py builds them offline
from transformers configs), each served by a real `vllm serve` E and PD under vLLM's
defaults (multiprocess executor, processor cache and prefix caching on).

Per family, the PD runs with failure_policy "fail", so an item ECX refused fails its
request loudly instead of being encoded quietly on the PD:
- every request (one image, several, the same image twice) gets from the PD, loading
  from E, the text the same engine gives when it encodes the images itself (the single
  instance's answer: asked again after its encoder and prefix caches were emptied, with no
  ec_transfer_params), and the PD's engine never runs its encoder for them;
- the PD counted one load per item and no failure of any cause (no "shape" among them),
  and E's pins are back to 0;
- through ecx's proxy (`--upstream-api vllm`), each family's media (images, videos,
  audio) goes to E keyed by its content, and the PD loads it: the same texts, no encode;
- an item whose params describe another shape than the PD's model gives (the width of
  the language model, as ECX once assumed) fails its request, naming the item and why."""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from ecx_stack import EcxStack
from vllm_engines import (
    Engine,
    ec_config,
    encode_on,
    free_port,
    free_ports,
    messages,
    metric,
    mp4,
    png,
    post,
    running,
    serve_argv,
    vllm_env,
    wait_until,
    wav,
)

BENCH_PY = Path(__file__).resolve().parents[2] / "bench" / "python"
# The tiny Qwen2-VL runs in test_vllm_engine.py and test_vllm_layouts.py.
# ECX_TEST_FAMILIES=a,b: only those (while working on one).
FAMILIES = [f for f in os.environ.get("ECX_TEST_FAMILIES", "").split(",") if f] or [
    "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "llava", "gemma3", "idefics3", "qwen2-audio"]
# Families that take video too: a video is one item, all its frames' tokens. Audio
# families take audio only.
VIDEO_FAMILIES = {"qwen3-vl"}
AUDIO_FAMILIES = {"qwen2-audio"}
MEDIA = [png(seed) for seed in range(101, 106)] + [mp4(107), mp4(108, frames=24)] + [
    wav(109), wav(110, seconds=5.0)]
IMAGE_REQUESTS = [([0], "What is in the picture?"), ([1, 2], "Compare the two images."),
                  ([3, 4, 3], "Three images, one of them twice.")]
VIDEO_REQUESTS = [([5], "What happens in the video?"), ([6, 0], "A video and an image.")]
AUDIO_REQUESTS = [([7], "What is said?"), ([8, 7], "Two clips, then the first again."),
                  ([8], "The longer clip.")]
MAX_TOKENS = 8


def requests_of(family: str) -> list[tuple[list[int], str]]:
    if family in AUDIO_FAMILIES:
        return AUDIO_REQUESTS
    return IMAGE_REQUESTS + (VIDEO_REQUESTS if family in VIDEO_FAMILIES else [])


def body(request: tuple[list[int], str], **extra) -> dict:
    media, text = request
    return {"model": "tiny-vlm", "messages": messages(text, [MEDIA[i] for i in media]),
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, deployment_secret, tmp_path_factory):
    """E and PD (policy fail) of one family's tiny model, started side by side."""
    family = request.param
    model = tmp_path_factory.mktemp(f"model-{family}")
    subprocess.run([sys.executable, str(BENCH_PY / "tiny_vlm.py"), str(model), "--family", family],
                   check=True, timeout=600, capture_output=True)
    logs = tmp_path_factory.mktemp(f"epd-{family}")
    common = {"auth_token_file": deployment_secret, "pool_bytes": "128MiB"}
    e_port, pd_port = free_port(), free_port()
    e_metrics, pd_metrics = free_ports(2), free_ports(2)
    e = Engine(f"e-{family}", serve_argv(model, e_port, "--ec-transfer-config", ec_config(
        "ec_producer", {**common, "lease_ms": 600000, "metrics_port": e_metrics})),
        vllm_env(), e_port, logs / "e.log", metrics_port=e_metrics)
    # VLLM_SERVER_DEV_MODE: /reset_encoder_cache and /reset_prefix_cache, so that the same
    # engine then answers as a single instance.
    pd = Engine(f"pd-{family}", serve_argv(
        model, pd_port, "--enable-logging-iteration-details", "--ec-transfer-config",
        ec_config("ec_consumer", {**common, "failure_policy": "fail",
                                  "metrics_port": pd_metrics})),
        vllm_env(VLLM_SERVER_DEV_MODE="1"), pd_port, logs / "pd.log", metrics_port=pd_metrics)
    with running(e, pd):
        yield family, e, pd


# The single instance's texts, per family (the first test's), for the later tests.
SINGLE_INSTANCE: dict[str, list[str]] = {}


def reset_caches(pd: Engine) -> None:
    for path in ("/reset_encoder_cache", "/reset_prefix_cache"):
        request = urllib.request.Request(pd.url + path, method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200, path


def text_of(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def test_the_pd_loads_every_item_and_answers_as_a_single_instance(pair):
    family, e, pd = pair
    pd.mark_log()
    texts, items = [], 0
    for i, request in enumerate(requests_of(family)):
        distinct = len(set(request[0]))
        params = encode_on(e, [MEDIA[j] for j in request[0]])
        assert len(params) == distinct, f"{family}: E's params {list(params)}"
        status, answer = post(pd.url + "/v1/chat/completions",
                              body(request, ec_transfer_params=params))
        assert status == 200, f"{family}, request {i}: {answer}"
        texts.append(text_of(answer))
        items += distinct
    assert pd.encoder_iterations() == 0, f"{family}: the PD ran its encoder"
    stats = wait_until(lambda: (lambda t: t if metric(t, "vllm:ecx_loads_total") >= items
                                else "")(pd.metrics()), 30, f"{family}: PD counted its loads")
    assert metric(stats, "vllm:ecx_loads_total") == items
    assert metric(stats, "vllm:ecx_load_failures_total") == 0, family
    assert metric(stats, "vllm:ecx_local_encodes_total") == 0, family
    wait_until(lambda: metric(e.worker_metrics(0), "ecx_pool_pins") == 0, 20,
               f"{family}: E's pins back to 0")
    # The same engine as a single instance: it encodes the images itself.
    reset_caches(pd)
    pd.mark_log()
    for i, (request, text) in enumerate(zip(requests_of(family), texts)):
        status, answer = post(pd.url + "/v1/chat/completions", body(request))
        assert status == 200, f"{family}, request {i} (single instance): {answer}"
        assert text_of(answer) == text, f"{family}, request {i}: EPD and single instance differ"
    assert pd.encoder_iterations() > 0, f"{family}: the single instance did not encode"
    SINGLE_INSTANCE[family] = texts


def test_ecx_proxy_sends_every_modality_to_e(pair, ecx_binary, tmp_path):
    """Runs after the first test (its texts are the reference). The proxy names each item
    by a hash of its bytes (a uuid E and PD both get), so neither engine's caches, which
    hold the items under vLLM's own names, stand in for the load."""
    family, e, pd = pair
    assert family in SINGLE_INSTANCE, "the first test did not run"
    pd.mark_log()
    loads = metric(pd.metrics(), "vllm:ecx_loads_total")
    with EcxStack(ecx_binary, tmp_path) as stack:
        proxy = stack.start("proxy", "--upstream-api", "vllm", "--encoders", e.url,
                            "--pd", pd.url, "--model", "tiny-vlm")
        for i, request in enumerate(requests_of(family)):
            status, answer = post(proxy.url + "/v1/chat/completions", body(request))
            assert status == 200, f"{family}, request {i} through the proxy: {answer}"
            assert text_of(answer) == SINGLE_INSTANCE[family][i], f"{family}, request {i}"
    assert pd.encoder_iterations() == 0, f"{family}: the PD ran its encoder"
    items = sum(len(set(r[0])) for r in requests_of(family))
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_loads_total") >= loads + items, 30,
               f"{family}: PD counted the proxy's loads")


def test_params_of_another_shape_fail_the_request_naming_the_item(pair):
    family, e, pd = pair
    image = wav(4242) if family in AUDIO_FAMILIES else png(4242)
    params = encode_on(e, [image])
    (name, entry), = params.items()
    rows, width = entry["shape"]
    entry["shape"] = [rows, width + 64]  # what a PD of another model would describe
    failures = metric(pd.metrics(), "vllm:ecx_load_failures_total", cause="shape")
    status, answer = post(pd.url + "/v1/chat/completions",
                          {"model": "tiny-vlm", "messages": messages("Which one?", [image]),
                           "max_tokens": 2, "temperature": 0, "ec_transfer_params": params})
    assert status >= 500, f"{family}: {answer}"
    wait_until(lambda: metric(pd.metrics(), "vllm:ecx_load_failures_total",
                              cause="shape") > failures, 30, f"{family}: counted as shape")
    # The PD's log reaches us through a pipe, after its metrics may already count it.
    wait_until(lambda: f"item {name}: ec_transfer_params describe" in pd.log_text(), 30,
               f"{family}: the PD logged the item and why")
    assert pd.alive() and e.alive()
