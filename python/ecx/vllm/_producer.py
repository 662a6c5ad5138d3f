"""The encoder (E) side of ECXConnector.

Worker (where the encoder runs): each encoder output goes into ecx's pool, in this process's
agent, which publishes its metadata for its scheduler (Rendezvous). Scheduler (vLLM's
EngineCore, in general another process): when a request finishes, it asks the worker's
agent for each item's params in one call (the items are in the pool by then: the worker
saved them in the step whose output finished the request) and returns them, with vLLM's
item metadata, as the request's ec_transfer_params."""
from __future__ import annotations

import json
import time

import torch
from vllm.v1.request import RequestStatus

import ecx

from ._common import (
    DTYPES,
    InstanceConfig,
    Rendezvous,
    ecx_key,
    is_counter_name,
    logger,
    worker_agent,
)
from ._metrics import Counters


class ProducerWorker:
    """Stores encoder outputs. Only tensor-parallel rank 0 stores: every rank computes the
    same output, and the scheduler asks rank 0."""

    def __init__(self, config: InstanceConfig, conn: ecx.Connector, rank: int,
                 rendezvous: Rendezvous, counters: Counters):
        self._conn = conn
        self._rank = rank
        self._counters = counters
        self._rendezvous = rendezvous
        self._agent = worker_agent(config, rank)
        if rank == 0:
            rendezvous.publish(self._agent, conn.agent_metadata())

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self._rank != 0 or is_counter_name(mm_hash):
            return  # a counter name identifies nothing across instances: never published
        tensor = encoder_cache[mm_hash].detach()
        dtype = DTYPES.get(tensor.dtype)
        if dtype is None:
            self._counters.fail("dtype")
            logger.warning("ECXConnector: cannot store item %s of dtype %s", mm_hash, tensor.dtype)
            return
        host = tensor.to("cpu").contiguous()  # the staging copy of a device tensor
        data = host.view(torch.uint8).numpy().reshape(-1)
        params = self._conn.save(ecx_key(mm_hash), dtype, list(host.shape), data)
        # Nobody is handed these params: the scheduler asks for its own when the request
        # finishes. The pin they hold ends now, not at the lease.
        self._conn.release_params(params)
        self._counters.add("saves")
        self._counters.add("save_bytes", data.nbytes)

    def republish(self, encoder_cache: dict[str, torch.Tensor], identifiers: list[str]) -> None:
        """Items this step's requests use that vLLM had cached (so it will not encode or
        save them again) but ecx's pool no longer holds: stored again from vLLM's cache."""
        if self._rank != 0:
            return
        for mm_hash in identifiers:
            if mm_hash in encoder_cache and not self._conn.holds(ecx_key(mm_hash)):
                self.save(encoder_cache, mm_hash)

    def close(self) -> None:
        if self._rank == 0:
            self._rendezvous.withdraw(self._agent)


class ProducerScheduler:
    """Returns each finished request's ec_transfer_params, asked from worker 0's agent."""

    def __init__(self, config: InstanceConfig, conn: ecx.Connector, rendezvous: Rendezvous,
                 counters: Counters, vllm_config):
        self._config = config
        self._conn = conn
        self._rendezvous = rendezvous
        self._counters = counters
        self._vllm_config = vllm_config
        self._worker_metadata: str | None = None
        self._resolver = None  # vLLM's per-modality metadata fields, made on first use

    def publish_list(self, scheduler_output) -> list[str]:
        """The items of this step's new requests: the worker stores again any that vLLM had
        cached but ecx's pool lost (ProducerWorker.republish)."""
        out: list[str] = []
        for req in scheduler_output.scheduled_new_reqs or []:
            for feature in getattr(req, "mm_features", None) or []:
                out.append(feature.identifier)
        return out

    def params(self, request) -> dict | None:
        if request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return None  # never encoded, or nobody will read it
        features = request.mm_features or []
        names = list(dict.fromkeys(f.identifier for f in features))
        wanted = []
        for name in names:
            if is_counter_name(name):
                self._counters.fail("identity")
                logger.warning(
                    "ECXConnector: request %s, item %s is named by arrival order, not content "
                    "(no processor cache, no prefix caching, no uuid): no ec_transfer_params "
                    "for it, a PD could not tell it from another image", request.request_id, name)
            else:
                wanted.append(name)
        if not wanted:
            return None
        replies = self._ask_worker(request.request_id, wanted)
        metadata = self._item_metadata(features)
        out = {}
        issued = []
        for name, (params, error) in zip(wanted, replies):
            if params is None:
                code, message = error
                self._counters.fail(code)
                logger.warning("ECXConnector: request %s: no ec_transfer_params for item %s: "
                               "%s: %s", request.request_id, name, code, message)
                continue
            issued.append(params)
            entry = json.loads(params)
            entry.update(metadata.get(name, {}))
            out[name] = entry
            self._counters.add("params_issued")
        if issued:
            self._offer(request, issued)
        return out or None

    def _offer(self, request, issued: list[str]) -> None:
        """Tells the PD that will serve the request (named by the proxy in E's request, as
        vLLM's example EPD proxy names it with --ec-consumer-zmq-addrs: there, PD's
        scheduler agent's tcp address) the params now: it loads them while the request
        is on its way to it. Only to an address of E's `offer_to` (ecx refuses others: the
        address comes from the request). Only queued here (ecx sends it from its own
        thread); a PD that cannot be reached costs it the early start only."""
        given = getattr(request, "ec_transfer_params", None) or {}
        address = given.get("consumer_zmq") if isinstance(given, dict) else None
        if not address:
            return
        if not isinstance(address, str):
            self._counters.fail("offer")
            logger.warning("ECXConnector: request %s: consumer_zmq %r is not an address",
                           request.request_id, address)
            return
        try:
            self._conn.offer(address, issued)
            self._counters.add("offers")
        except Exception as e:  # noqa: BLE001 (the request's params must go out regardless)
            self._counters.fail("offer")
            logger.warning("ECXConnector: request %s: no offer to %r (only the addresses in "
                           "offer_to are offered to): %s", request.request_id, address, e)

    def _ask_worker(self, request_id: str, names: list[str]) -> list[tuple]:
        started = time.monotonic()
        try:
            if self._worker_metadata is None:
                self._worker_metadata = self._rendezvous.lookup(worker_agent(self._config, 0))
            return self._conn.remote_saved_params(self._worker_metadata,
                                                  [ecx_key(n) for n in names],
                                                  self._config.params_timeout_ms)
        except (ecx.Error, ValueError) as e:
            self._worker_metadata = None  # read again next time (a restarted worker)
            code = e.code if isinstance(e, ecx.Error) else "rendezvous"
            logger.error("ECXConnector: request %s: asking the worker for params failed after "
                         "%.0f ms: %s", request_id, (time.monotonic() - started) * 1e3, e)
            return [(None, (code, str(e)))] * len(names)

    def _item_metadata(self, features) -> dict:
        """vLLM's per-item `metadata` (the grid a PD needs to size the placeholders) and
        `item_indices`, as vLLM's own EC connectors report them: with them vLLM's example
        EPD proxy sends PD a reference under E's name instead of the raw image."""
        try:
            from vllm.distributed.ec_transfer.ec_connector.utils import (
                PlaceholderMetadataResolver,
                collect_ec_item_metadata,
            )
            if self._resolver is None:
                self._resolver = PlaceholderMetadataResolver(self._vllm_config.model_config)
            return collect_ec_item_metadata(features, self._resolver)
        except ImportError:  # a vLLM without these helpers: positions only
            out: dict = {}
            for i, feature in enumerate(features):
                out.setdefault(feature.identifier, {"item_indices": []})["item_indices"].append(i)
            return out
