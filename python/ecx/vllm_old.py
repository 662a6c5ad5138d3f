"""ecx.vllm.ECXConnector: ecx as a vLLM EC connector (vllm==0.33.0).

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "ECXConnector",
        "ec_connector_module_path": "ecx.vllm", "ec_role": "ec_producer",
        "ec_connector_extra_config": {"auth_token_file": "/etc/ecx/token", "pool_bytes": "4GiB"}}'

and the consumer twin with "ec_role": "ec_consumer". `ec_connector_extra_config` takes the
options of docs/CONNECTORS.md (mode, backend, pool_bytes, failure_policy, ...), plus
"connector" (default "p2p"). Every byte moves in ecx's C++ core (ecx._ecx).

How it maps onto vLLM's hooks (the scheduler and the worker of one instance run in one
process with vLLM's single-GPU executor; both connector objects share one ecx connector):
  producer  save_caches          the encoder output goes into ecx's pool (a host copy of a
                                 CUDA tensor first: the staging copy)
            request_finished     returns ec_transfer_params: each item's full location, pin
                                 and capability, signed; the consumer needs no control round
                                 trip before its READ
  consumer  ensure_cache_available  starts one batched READ per producer for the request's
                                 items and defers the request until the load ended (by
                                 load_timeout_ms at the latest)
            has_cache_item       true for items loaded this way
            update_state_after_alloc / build_connector_meta   which loaded items the step uses
            start_load_caches    fills encoder_cache from the loaded blocks (a copy to the
                                 model's device)
            get_finished         the requests whose items it filled in (finished_recving)
            take_unavailable_requests  requests whose load failed, with failure_policy "fail";
                                 with "recompute" (the default) vLLM encodes those items itself
            request_finished     releases what the request still holds
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

import ecx

_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_MM_HASH = re.compile(r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,127}$")
_ROLES = {"ec_producer": "producer", "ec_consumer": "consumer", "ec_both": "both"}
logger = logging.getLogger("ecx.vllm")


def ecx_key(identifier: str) -> str:
    """vLLM's mm_hash as an ecx key: itself when it fits ecx's alphabet, else its sha256."""
    if _MM_HASH.match(identifier):
        return identifier
    return "sha256-" + hashlib.sha256(identifier.encode()).hexdigest()


def connector_config(ec_transfer_config) -> dict:
    """The ecx connector config (as the services take it) for vLLM's ECTransferConfig."""
    extra = dict(ec_transfer_config.ec_connector_extra_config or {})
    kind = extra.pop("connector", "p2p")
    if not isinstance(kind, str):
        raise ecx.Error("invalid_argument", "ec_connector_extra_config 'connector' must be a string")
    role = _ROLES.get(ec_transfer_config.ec_role or "")
    if role is None:
        raise ecx.Error("invalid_argument", f"unknown ec_role {ec_transfer_config.ec_role!r}")
    extra.setdefault("engine_id", f"vllm-{ec_transfer_config.engine_id}")
    return {"connector": kind, "role": role, "extra": extra}


class _Shared:
    """One ecx connector per process and config, shared by the scheduler-side and the
    worker-side ECXConnector (vLLM makes one of each)."""

    _lock = threading.Lock()
    _by_engine: dict[str, "_Shared"] = {}

    def __init__(self, config: dict):
        self.conn = ecx.Connector(json.dumps(config))
        self.users = 0
        self.policy = config["extra"].get("failure_policy", "recompute")
        self.lock = threading.Lock()
        self.saved: dict[str, str] = {}  # mm_hash -> params JSON, pinned for one consumer
        self.loaded: dict[str, set[str]] = {}  # ecx key -> requests whose loads hold it

    @classmethod
    def of(cls, config: dict) -> "_Shared":
        engine = config["extra"]["engine_id"]
        with cls._lock:
            shared = cls._by_engine.get(engine)
            if shared is None:
                shared = cls._by_engine[engine] = cls(config)
            shared.users += 1
            return shared

    @classmethod
    def release(cls, shared: "_Shared") -> None:
        """One user is done; the last one stops the ecx connector (its threads, its agent)."""
        with cls._lock:
            shared.users -= 1
            if shared.users > 0:
                return
            for engine, other in list(cls._by_engine.items()):
                if other is shared:
                    del cls._by_engine[engine]
        shared.conn = None


@dataclass
class ECXConnectorMetadata(ECConnectorMetadata):
    # (request id, vLLM mm_hash, ecx key, dtype name, shape) of each loaded item the step uses
    loads: list[tuple[str, str, str, str, list[int]]] = field(default_factory=list)


@dataclass
class _Load:
    items: dict[str, tuple[str, str, list[int]]]  # ecx key -> (vLLM mm_hash, dtype, shape)
    done: bool = False
    failed: set[str] = field(default_factory=set)  # ecx keys that did not load


class ECXConnector(ECConnectorBase):
    def __init__(self, vllm_config, role: ECConnectorRole):
        super().__init__(vllm_config, role)
        parallel = getattr(vllm_config, "parallel_config", None)
        if parallel is not None and getattr(parallel, "world_size", 1) > 1:
            raise ValueError("ECXConnector supports one worker per instance (tensor and pipeline "
                             "parallel size 1): its scheduler and worker share one process")
        self._config = connector_config(vllm_config.ec_transfer_config)
        self._shared = _Shared.of(self._config)
        self._loads: dict[str, _Load] = {}  # request id -> its load (scheduler side)
        self._step: list[tuple[str, str, str, str, list[int]]] = []
        self._unavailable: set[str] = set()
        self._received: set[str] = set()  # worker side, for get_finished

    def shutdown(self) -> None:
        if self._shared is not None:
            _Shared.release(self._shared)
            self._shared = None

    # ---------------- producer ----------------

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if not self.is_producer:
            return  # vLLM's V1 runner calls this on every role
        tensor = encoder_cache[mm_hash].detach()
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise ecx.Error("invalid_argument", f"ECXConnector cannot store {tensor.dtype} tensors")
        host = tensor.to("cpu").contiguous()  # the staging copy of a CUDA tensor
        data = host.view(torch.uint8).numpy().reshape(-1)
        params = self._shared.conn.save(ecx_key(mm_hash), dtype, list(host.shape), data)
        with self._shared.lock:
            previous = self._shared.saved.pop(mm_hash, None)
            self._shared.saved[mm_hash] = params
        if previous is not None:  # saved again before any request handed it out
            self._shared.conn.release_params(previous)

    def _params_for(self, mm_hash: str) -> dict:
        with self._shared.lock:
            params = self._shared.saved.pop(mm_hash, None)
        if params is None:  # encoded for an earlier request: pin it again for this one
            params = self._shared.conn.saved_params(ecx_key(mm_hash))
        return json.loads(params)

    # ---------------- consumer, scheduler side ----------------

    def _items_of(self, request) -> tuple[list, set[str]]:
        """(vLLM mm_hash, ecx key, dtype, shape, TransferParams) of the request's items that
        came with ecx params, and the ecx keys of those whose params are malformed (they
        fail like a load that failed: a clear log line naming the field, never an
        exception in vLLM's scheduler)."""
        given = getattr(request, "ec_transfer_params", None) or {}
        out, bad = [], set()
        for feature in request.mm_features or []:
            entry = given.get(feature.identifier)
            if not isinstance(entry, dict) or entry.get("connector") is None:
                continue  # not ecx's params: vLLM encodes the item itself
            key = ecx_key(feature.identifier)
            ecx_params = {k: v for k, v in entry.items()
                          if k not in ("modality", "item_indices", "metadata")}
            try:
                params = ecx.TransferParams.from_json(json.dumps(ecx_params))
                out.append((feature.identifier, key, str(entry["dtype"]), list(entry["shape"]),
                            params))
            except (ecx.Error, KeyError, TypeError) as e:
                logger.warning("ECXConnector: request %s, item %s: %s", request.request_id,
                               feature.identifier, e)
                bad.add(key)
        return out, bad

    def _start_load(self, request) -> None:
        conn = self._shared.conn
        items, bad = self._items_of(request)
        load = _Load(items={key: (mm, dtype, shape) for mm, key, dtype, shape, _ in items},
                     failed=set(bad))
        self._loads[request.request_id] = load
        if bad and self._shared.policy == "fail":
            self._unavailable.add(request.request_id)
        if not items:
            load.done = True
            return
        batch = [(key, dtype, shape, params) for _, key, dtype, shape, params in items]
        for i in range(len(batch)):
            conn.update_state_after_alloc(request.request_id, batch, i)
        conn.start_load_caches(conn.build_connector_meta())

    def _settle(self, request_id: str, load: _Load) -> None:
        outcome = self._shared.conn.wait_for_load(request_id, 0)
        for item in outcome["items"]:
            if item["ok"]:
                with self._shared.lock:
                    self._shared.loaded.setdefault(item["mm_hash"], set()).add(request_id)
            else:
                load.failed.add(item["mm_hash"])
        if load.failed and self._shared.policy == "fail":
            self._unavailable.add(request_id)
        load.done = True

    def ensure_cache_available(self, request, num_computed_tokens: int) -> bool:
        if not self.is_consumer or not request.mm_features:
            return True
        load = self._loads.get(request.request_id)
        if load is None:
            self._start_load(request)
            load = self._loads[request.request_id]
        if not load.done:
            finished = set(self._shared.conn.get_finished())
            for rid in finished:
                other = self._loads.get(rid)
                if other is not None and not other.done:
                    self._settle(rid, other)
        return load.done

    def wait_for_loads(self, request, timeout_s: float) -> bool:
        """Calls ensure_cache_available until it admits the request (for drivers and
        tests outside vLLM's scheduler loop); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.ensure_cache_available(request, 0):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        with self._shared.lock:
            return bool(self._shared.loaded.get(ecx_key(identifier)))

    def update_state_after_alloc(self, request, index: int) -> None:
        if not self.is_consumer:
            return
        feature = request.mm_features[index]
        key = ecx_key(feature.identifier)
        load = self._loads.get(request.request_id)
        if load is None or key not in load.items or key in load.failed:
            return
        with self._shared.lock:
            holders = self._shared.loaded.get(key, set())
            # Its own load, else another request's that holds the same item this step.
            holder = request.request_id if request.request_id in holders else next(
                iter(holders), None)
        if holder is not None:
            mm, dtype, shape = load.items[key]
            self._step.append((holder, mm, key, dtype, shape))

    def build_connector_meta(self, scheduler_output) -> ECXConnectorMetadata:
        meta, self._step = ECXConnectorMetadata(loads=self._step), []
        return meta

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request) -> tuple[bool, dict[str, Any] | None]:
        if self.is_producer and not self.is_consumer:
            params = {}
            for i, feature in enumerate(request.mm_features or []):
                entry = self._params_for(feature.identifier)
                entry.update({"modality": feature.modality, "item_indices": [i]})
                params[feature.identifier] = entry
            return False, params or None
        load = self._loads.pop(request.request_id, None)
        if load is not None:
            with self._shared.lock:
                for key in load.items:
                    holders = self._shared.loaded.get(key)
                    if holders is not None:
                        holders.discard(request.request_id)
                        if not holders:
                            del self._shared.loaded[key]
            self._shared.conn.request_finished(request.request_id)
        return False, None

    # ---------------- consumer, worker side ----------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        if not self.is_consumer:
            return
        meta = self._get_connector_metadata()
        device = kwargs.get("device")
        for request_id, mm_hash, key, dtype, shape in getattr(meta, "loads", []):
            if mm_hash in encoder_cache:
                continue
            view = self._shared.conn.loaded(request_id, key)  # ecx memory, no copy
            tensor = torch.from_numpy(view).view(_TORCH_DTYPES[dtype]).reshape(shape)
            # vLLM keeps the tensor after ecx gives the block back: a copy, to the device
            # the encoder would have written (CUDA: the host staging copy's way back).
            target = device or _encoder_device(encoder_cache)
            encoder_cache[mm_hash] = tensor.to(target, copy=True)
            self._received.add(request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None, the requests whose loaded items this worker put into encoder_cache since
        the last call): what vLLM's ECConnectorOutput calls finished_recving."""
        received, self._received = self._received, set()
        return None, (received or None)


def _encoder_device(encoder_cache: dict[str, torch.Tensor]) -> torch.device:
    for tensor in encoder_cache.values():
        return tensor.device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


__all__ = ["ECXConnector", "ECXConnectorMetadata", "connector_config", "ecx_key"]
