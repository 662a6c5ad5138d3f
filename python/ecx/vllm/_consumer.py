"""The prefill/decode (PD) side of ECXConnector.

Scheduler (vLLM's EngineCore): for each request with ec_transfer_params it checks every
item's identity (its name, the params' signature, the shape vLLM expects), starts one
batched READ per encoder into its own ecx cache, and defers the request until the load
ended (by load_timeout_ms at the latest). A failed item is left to vLLM to encode (policy
"recompute") or fails the request before any encode or prefill work (policy "fail"). An
item sent without its media (a metadata reference, as vLLM's example EPD proxy sends once
E answered) cannot be encoded here: its request fails under either policy (vLLM's encoder
would otherwise assert on an item with no pixels and take the engine down).

Worker (where the model runs; in general another process): the scheduler's step metadata
hands it, per loaded item, params for the block in the scheduler's cache (its own pin and
capability per tensor-parallel rank); it reads them (same host: through shared memory,
holding that pin, with no round trip to the scheduler) and puts the tensors into vLLM's
encoder cache. With zero_copy on a CPU engine, the tensor is
the loaded bytes themselves (DLPack over E's sealed block, read-only), held by the worker's
own pin at E until vLLM frees the entry."""
from __future__ import annotations

import json
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

import ecx

from . import _outputs as outputs
from ._common import (
    PARAMS_FIELDS,
    TORCH_DTYPES,
    InstanceConfig,
    Rendezvous,
    ecx_key,
    is_counter_name,
    logger,
)
from ._metrics import Counters
from ._outputs import EncoderOutput


@dataclass
class WorkerLoad:
    """One item a worker puts into vLLM's encoder cache this step."""

    request_id: str
    identifier: str  # vLLM's mm_hash: the encoder cache key
    key: str  # ecx's key for it
    dtype: str
    shape: list[int]
    params: list[str]  # per tensor-parallel rank: params of the block in the scheduler's cache
    # When the scheduler took those params' pins, one per rank and each that rank's alone
    # (time.monotonic(): workers on the scheduler's host view the block holding that pin,
    # with no lookup of their own, while it is fresh; ecx.Item's own_pin_taken).
    taken: float | None = None


@dataclass
class _Load:
    """One request's load at the scheduler."""

    keys: dict[str, str] = field(default_factory=dict)  # ecx key -> vLLM mm_hash, loading
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # key -> dtype, shape
    failed: dict[str, str] = field(default_factory=dict)  # ecx key -> cause
    done: bool = False
    started: bool = False  # an ecx load runs (request_finished must end it)
    references: set[str] = field(default_factory=set)  # ecx keys of items sent without media

    def recomputable(self) -> bool:
        return not (self.failed.keys() & self.references)


class ConsumerScheduler:
    def __init__(self, config: InstanceConfig, conn: ecx.Connector, counters: Counters,
                 vllm_config, rendezvous: Rendezvous):
        self._config = config
        self._conn = conn
        self._counters = counters
        self._loads: dict[str, _Load] = {}
        self._holders: dict[str, set[str]] = {}  # ecx key -> requests whose loads hold it
        self._step: list[tuple[str, str, str]] = []  # (holder, mm_hash, key) this step
        self._unavailable: set[str] = set()
        self._model_config = vllm_config.model_config
        self._instance_id = vllm_config.instance_id
        self._rendezvous = rendezvous
        # What this model's encoder puts in vLLM's cache per modality, as worker 0 measured
        # it at start: read now (vLLM makes the scheduler once every worker has loaded the
        # model), or on first use where it was not there yet (a scheduler made alone).
        self._outputs: dict[str, EncoderOutput] | None = None
        try:
            self._outputs = outputs.lookup(config.name, self._instance_id, rendezvous)
        except ValueError as e:
            logger.info("ECXConnector: the encoder's measure is not there yet (%s)", e)
        self._resolver = None  # vLLM's PlaceholderMetadataResolver, made on first use
        self._first_look_left_ms = float(config.first_look_step_ms)  # this step's, left
        self._idle = False  # the last step scheduled nothing: vLLM only waits on loads

    # ---- ensure_cache_available ----

    def ensure(self, request, num_computed_tokens: int) -> bool:
        load = self._loads.get(request.request_id)
        if load is None:
            load = self._start(request, num_computed_tokens)
            # On one host a load ends within a millisecond or two: waited for here, a
            # little, the request is scheduled in this step rather than the next one (a
            # whole engine step later). The wait ends with the load, so a step waits about
            # as long as its new loads take (what the disk connector spends reading its
            # files in the step).
            self._wait(request.request_id, load)
        elif self._idle:
            # Still loading after a step that scheduled nothing: vLLM, with only loads to
            # wait for, would run empty steps back to back (each one sent to the workers,
            # a few ms apart), and take from the load the cores it runs on. Waited for
            # here instead, the load ends sooner and no step is delayed: there is none.
            if self._wait(request.request_id, load):
                self._counters.add("idle_waits")
        if not load.done:
            self._settle_finished()
        if not load.done:
            return False
        # A failed request waits for take_unavailable_requests: nothing runs for it first.
        return request.request_id not in self._unavailable

    def _wait(self, request_id: str, load: _Load) -> bool:
        """Waits for a running load, until it ends or at most first_look_wait_ms, and the
        waits of one step first_look_step_ms together, so that a burst or a slow producer
        cannot hold the step. A load still running then is not waited for further in this
        step: vLLM asks again in the next one. Whether it waited."""
        wait_ms = min(self._config.first_look_wait_ms, self._first_look_left_ms)
        if not load.started or load.done or wait_ms < 1:
            return False
        started = time.monotonic()
        self._conn.wait_for_load(request_id, int(wait_ms))
        self._first_look_left_ms -= (time.monotonic() - started) * 1e3
        return True

    def _start(self, request, num_computed_tokens: int) -> _Load:
        rid = request.request_id
        load = self._loads[rid] = _Load()
        given = request.ec_transfer_params or {}
        entries = {k: v for k, v in given.items()
                   if isinstance(v, dict) and v.get("connector") is not None}
        load.references = {ecx_key(f.identifier) for f in request.mm_features or []
                           if self._metadata_only(f)}
        if not entries:
            if load.references:  # e.g. a client that talks to PD directly
                load.failed = dict.fromkeys(load.references, "mismatch")
                self._counters.fail("mismatch")
                logger.warning("ECXConnector: request %s: items sent without media and "
                               "without ec_transfer_params", rid)
                self._fail(rid, load)
                return load
            load.done = True  # not an EPD request: vLLM encodes its items as usual
            return load
        items, release, used = [], [], set()
        for feature in request.mm_features or []:
            name = feature.identifier
            key = ecx_key(name)
            if key in load.keys or key in load.failed:
                continue  # the same image twice in one request
            entry = entries.get(name)
            if entry is not None:
                used.add(name)
            cause, detail, item = self._check(name, entry, feature)
            if cause is None and feature.mm_position.offset + feature.mm_position.length \
                    <= num_computed_tokens:
                release.append(item)  # its tokens are in the prefix cache: nothing to load
                continue
            if cause is not None:
                load.failed[key] = cause
                self._counters.fail(cause)
                logger.warning("ECXConnector: request %s, item %s: %s", rid, name, detail)
                if item is not None:
                    release.append(item)
                continue
            items.append(item)
            load.keys[key] = name
            load.tensors[key] = (item.dtype, list(item.shape))  # checked against this model
        self._release_unused(rid, entries, used, release)
        trusted = self._conn.has_caches(rid, items) if items else []
        loadable = []
        for item, ok in zip(items, trusted):
            if ok:
                loadable.append(item)
            else:  # ecx logged why (not signed by this deployment, not this item's params)
                load.keys.pop(item.mm_hash)
                load.failed[item.mm_hash] = "untrusted_params"
                self._counters.fail("untrusted_params")
        if load.failed and (self._config.policy == "fail" or not load.recomputable()):
            self._fail(rid, load)
            if loadable:
                self._conn.discard(rid, loadable)  # give the encoders' pins back now
            return load
        if not loadable:
            self._done_recomputing(load)
            return load
        for i in range(len(loadable)):
            self._conn.update_state_after_alloc(rid, loadable, i)
        self._conn.start_load_caches(self._conn.build_connector_meta())
        load.started = True
        return load

    def _check(self, name: str, entry, feature):
        """(None, None, item) for an item to load (an ecx.Item: its key, dtype, shape and
        params); else (cause, message, item or None): item when its params were readable
        (so the pin they hold at the encoder can be given back)."""
        if is_counter_name(name):
            return ("identity", "named by arrival order (renderer counter), not by content: "
                    "its embedding could be another image's", None)
        if entry is None:
            return ("mismatch", "ec_transfer_params name no item of this name (an encoder "
                    "keyed it otherwise, e.g. a uuid given to E only)", None)
        params = None
        try:
            params = ecx.TransferParams.from_json(
                json.dumps({k: v for k, v in entry.items() if k in PARAMS_FIELDS}))
            dtype, shape = str(entry["dtype"]), [int(d) for d in entry["shape"]]
            item = ecx.Item(ecx_key(name), dtype, shape, params)
        except (ecx.Error, KeyError, TypeError, ValueError) as e:
            # Params that parsed still hold a pin at their encoder: an item that names no
            # tensor (one byte) gives it back.
            back = ecx.Item(ecx_key(name), "U8", [1], params) if params is not None else None
            return ("malformed_params", f"ec_transfer_params unreadable: {e}", back)
        expected, unknown = self._expected(feature)
        if expected is None:
            return "shape", unknown, item
        if [dtype, shape] != expected:
            return ("shape", f"ec_transfer_params describe {dtype}{shape}, but this model's "
                    f"{feature.modality} encoder gives {expected[0]}{expected[1]} for the item",
                    item)
        return None, None, item

    def _expected(self, feature) -> tuple[list | None, str | None]:
        """([dtype, shape], None): what this model's encoder puts in vLLM's cache for the
        item (its tokens by vLLM's placeholders, its width and dtype as measured at start);
        (None, why) when that is not known."""
        if self._outputs is None:
            try:
                self._outputs = outputs.lookup(self._config.name, self._instance_id,
                                               self._rendezvous)
            except ValueError as e:
                return None, f"this PD's encoder outputs are not known ({e})"
        output = self._outputs.get(feature.modality)
        if output is None:
            return None, (f"this model's encoder takes no {feature.modality} items (it "
                          f"takes {', '.join(sorted(self._outputs)) or 'none'})")
        pos = feature.mm_position
        tokens = pos.get_num_embeds() if hasattr(pos, "get_num_embeds") else pos.length
        return [output.dtype, [tokens, output.width]], None

    def _release_unused(self, rid: str, entries: dict, used: set[str], release: list) -> None:
        """Params that match no item of the request are counted and logged; their pins at
        the encoder, and those of `release` (items not loaded), are given back now. Only
        params this deployment signed reach an encoder."""
        unused = list(release)
        for name, entry in entries.items():
            if name in used:
                continue
            self._counters.fail("mismatch")
            logger.warning("ECXConnector: request %s: ec_transfer_params for %s match no item "
                           "of the request", rid, name)
            try:
                params = ecx.TransferParams.from_json(
                    json.dumps({k: v for k, v in entry.items() if k in PARAMS_FIELDS}))
                unused.append(ecx.Item(params.mm_hash, str(entry["dtype"]),
                                       [int(d) for d in entry["shape"]], params))
            except (ecx.Error, KeyError, TypeError, ValueError):
                continue
        if unused:
            self._conn.discard(rid + "/unmatched", unused)

    def _metadata_only(self, feature) -> bool:
        """An item whose data holds only the placeholder metadata vLLM's parser accepts
        on an EC consumer (the grid), no media and no embedding: nothing to encode here.
        Unknown (no data at the scheduler, no resolver in this vLLM) counts as media."""
        data = getattr(feature, "data", None)
        if data is None:
            return False
        try:
            if self._resolver is None:
                from vllm.distributed.ec_transfer.ec_connector.utils import (
                    PlaceholderMetadataResolver,
                )
                self._resolver = PlaceholderMetadataResolver(self._model_config)
            fields = self._resolver.fields_for(feature.modality)
            return bool(fields) and set(data.get_data()) <= fields
        except (ImportError, AttributeError):
            return False

    def _fail(self, rid: str, load: _Load) -> None:
        load.done = True
        self._unavailable.add(rid)
        why = "failure_policy fail" if load.recomputable() else \
            "an item sent without its media cannot be encoded here"
        logger.error("ECXConnector: request %s fails (%s): items %s", rid, why,
                     ", ".join(f"{load.keys.get(k, k)}: {c}" for k, c in load.failed.items()))
        if not load.recomputable():
            self._counters.fail("not_recomputable")

    def _done_recomputing(self, load: _Load) -> None:
        load.done = True
        self._counters.add("local_encodes", len(load.failed))

    def _settle_finished(self) -> None:
        for rid in self._conn.get_finished():
            load = self._loads.get(rid)
            if load is None or load.done:
                continue
            outcome = self._conn.wait_for_load(rid, 0)
            for item in outcome["items"]:
                key = item["mm_hash"]
                if item["ok"]:
                    self._holders.setdefault(key, set()).add(rid)
                else:
                    load.failed[key] = item["code"]
                    self._counters.fail(item["code"])
                    logger.warning("ECXConnector: request %s, item %s: load failed: %s: %s",
                                   rid, load.keys.get(key, key), item["code"], item["message"])
            ok = sum(1 for item in outcome["items"] if item["ok"])
            self._counters.add("loads", ok)
            self._counters.add("load_bytes", int(outcome["bytes"]))
            self._counters.observe("load_ms", float(outcome["load_ms"]))
            if load.failed and (self._config.policy == "fail" or not load.recomputable()):
                self._fail(rid, load)
            else:
                self._done_recomputing(load)

    # ---- the step ----

    def has_item(self, identifier: str) -> bool:
        return bool(self._holders.get(ecx_key(identifier)))

    def after_alloc(self, request, index: int) -> None:
        key = ecx_key(request.mm_features[index].identifier)
        holders = self._holders.get(key)
        if not holders:
            return
        rid = request.request_id
        holder = rid if rid in holders else next(iter(holders))
        self._step.append((holder, request.mm_features[index].identifier, key))

    def step_loads(self, scheduled_tokens: int | None = None) -> list[WorkerLoad]:
        """The loaded items this step's requests use (vLLM calls it once per step, after
        scheduling, with the tokens the step scheduled: the next step's looks get their
        whole wait again, and after a step with none, a running load is waited for)."""
        self._first_look_left_ms = float(self._config.first_look_step_ms)
        self._idle = scheduled_tokens == 0
        step, self._step = self._step, []
        out = []
        for holder, name, key in step:
            dtype, shape = self._loads[holder].tensors[key]
            taken = time.monotonic()
            params = self._conn.share_loaded(holder, key, self._config.tp_size)
            out.append(WorkerLoad(request_id=holder, identifier=name, key=key, dtype=dtype,
                                  shape=shape, params=params, taken=taken))
        return out

    def take_unavailable(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def finished(self, request) -> None:
        rid = request.request_id
        load = self._loads.pop(rid, None)
        self._unavailable.discard(rid)
        if load is None:
            return
        for key in list(load.keys):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(rid)
                if not holders:
                    del self._holders[key]
        if load.started:
            self._conn.request_finished(rid)  # gives back its cache pins (and any in flight)


def _read_only_tensor(view) -> torch.Tensor:
    """A tensor over ecx's read-only bytes, only ever read (then copied) here: torch's
    warning that it could be written through does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(view)


class _StepLoad:
    """One step's worker load whose items vLLM's encoder cache holds in place: each held
    item keeps it alive (through _Held), and its end, once vLLM freed the last of them,
    ends the request. Until then ecx renews the pins the views hold at their producer
    (every lease_ms / 3); they count toward this worker's pin quota there, and past that
    quota a load copies instead."""

    def __init__(self, conn: ecx.Connector, request_id: str):
        self.conn = conn  # kept alive with the views
        self.request_id = request_id

    def __del__(self):
        try:
            self.conn.request_finished(self.request_id)
        except Exception:  # noqa: BLE001 (a finalizer must not raise)
            logger.exception("ECXConnector: ending worker load %s failed", self.request_id)


class _Held:
    """One item vLLM's encoder cache holds in place: the storage of the tensor over its
    bytes keeps this object alive (through DLPack); its end, once vLLM freed the entry and
    every view of it, gives back the item's pins at once (the step's other items stay)."""

    def __init__(self, step: _StepLoad, key: str):
        self._step = step
        self._key = key

    def __del__(self):
        try:
            self._step.conn.item_finished(self._step.request_id, self._key)
        except Exception:  # noqa: BLE001 (a finalizer must not raise)
            logger.exception("ECXConnector: ending item %s of worker load %s failed",
                             self._key, self._step.request_id)


class ConsumerWorker:
    """Puts the scheduler's loads into vLLM's encoder cache, through this process's agent:
    a copy on the model's device, or, with zero_copy on a CPU engine, a tensor over the
    loaded bytes themselves (E's sealed block) for as long as vLLM keeps it."""

    def __init__(self, config: InstanceConfig, conn: ecx.Connector, rank: int,
                 counters: Counters):
        self._config = config
        self._conn = conn
        self._rank = rank
        self._counters = counters
        self._steps = 0
        self._zero_copy = bool(config.extra.get("zero_copy", False))
        self._copies = ecx.CopyBuffers(config.copy_cache)  # host copies' buffers, kept warm
        self._copies_reused = 0  # their count of reuses, as last read
        # vLLM's entries over views: identifier -> (request, ecx key, the tensor, weakly)
        self._in_place: dict[str, tuple[str, str, weakref.ref]] = {}

    def check_in_place(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Before every step: an entry whose view is no longer intact (a renewal its
        producer refused, or its block's header is not the item's any more: the pins
        lapsed and E reused the block) leaves vLLM's encoder cache, so that no step reads
        another item's bytes. vLLM then fails what still needed it, loudly."""
        for name, (request_id, key, ref) in list(self._in_place.items()):
            tensor = ref()
            if tensor is None or encoder_cache.get(name) is not tensor:
                del self._in_place[name]  # vLLM freed or replaced it
                continue
            try:
                self._conn.view_intact(request_id, key)
            except ecx.Error as e:
                del self._in_place[name]
                encoder_cache.pop(name, None)
                self._counters.fail("view_lost")
                logger.error("ECXConnector: worker %d: item %s is no longer E's (%s: %s): "
                             "dropped from vLLM's encoder cache", self._rank, name, e.code,
                             e.message)

    def load(self, loads: list[WorkerLoad], encoder_cache: dict[str, torch.Tensor],
             device) -> None:
        """Puts the step's loads into vLLM's encoder cache, each as its encoder made it (its
        own dtype: PD's scheduler checked it against this model's encoder), on `device`."""
        started = time.monotonic()
        self._steps += 1
        rid = f"step-{self._steps}"
        wanted, skipped = [], []
        for w in loads:
            item = ecx.Item(w.key, w.dtype, w.shape, w.params[self._rank],
                            own_pin_taken=w.taken)
            (skipped if w.identifier in encoder_cache else wanted).append(item)
        if skipped:
            self._conn.discard(rid + "/cached", skipped)  # their pins end now, not at the lease
        if not wanted:
            return
        # In place: the model reads the bytes where they lie (host memory, in its dtype).
        # One request loads the step's items (one lookup per producer); each item held in
        # place ends when vLLM frees its entry, the request with the last of them.
        in_place = self._zero_copy and torch.device(device).type == "cpu"
        outcome = self._conn.load(rid, wanted, self._config.load_timeout_ms)
        step = _StepLoad(self._conn, rid) if in_place else None
        held, ended = set(), set()  # (in place) keys vLLM's entries hold; keys ended here
        try:
            moved, seen = 0, set()
            for item in outcome["items"]:
                key = item["mm_hash"]
                if key in seen:  # one item twice in the step: one entry of vLLM's
                    continue
                seen.add(key)
                w = next(x for x in loads if x.key == key)
                if not item["ok"]:
                    self._counters.fail("worker_" + item["code"])
                    logger.error("ECXConnector: worker %d could not read item %s from its "
                                 "scheduler: %s: %s", self._rank, w.identifier, item["code"],
                                 item["message"])
                    continue
                want = TORCH_DTYPES[w.dtype]
                if step and self._viewed(rid, key):
                    # DLPack over the read-only view, no copy: its storage holds the item,
                    # and the item ends with the last user of that storage (even should
                    # what follows raise).
                    held.add(key)
                    view = self._conn.loaded(rid, key, _Held(step, key))
                    tensor = torch.from_dlpack(view).view(want).reshape(w.shape)
                    encoder_cache[w.identifier] = tensor
                    self._in_place[w.identifier] = (rid, key, weakref.ref(tensor))
                    self._counters.add("worker_items_in_place")
                    continue
                # vLLM keeps its tensor after ecx reuses the block: a copy, on the model's
                # device and in its dtype.
                tensor = self._copy(rid, key, device).view(want).reshape(w.shape)
                encoder_cache[w.identifier] = tensor
                moved += tensor.numel() * tensor.element_size()
                self._counters.add("worker_items")
                if step:  # copied: its pins end now, not with the step's last in-place item
                    del tensor
                    ended.add(key)
                    self._conn.item_finished(rid, key)
        finally:
            if step is None:
                self._conn.request_finished(rid)
            else:  # the request ends with `step`: now, or with the last entry held in place
                self._end_unheld(rid, outcome["items"], held | ended)
        self._counters.add("worker_bytes", moved)
        reused = self._copies.stats()["reused"]  # one read per step: the pool counts
        self._counters.add("worker_copies_warm", reused - self._copies_reused)
        self._copies_reused = reused
        self._counters.observe("worker_copy_ms", (time.monotonic() - started) * 1e3)

    def _copy(self, request_id: str, key: str, device) -> torch.Tensor:
        """The loaded item's bytes, copied for vLLM to keep. On the host, into one of this
        worker's warm buffers (ecx.CopyBuffers: a fresh allocation of an item's size would
        fault on every page as the copy first writes it, several times the copy itself);
        else straight onto the device."""
        if torch.device(device).type == "cpu":
            return torch.from_numpy(self._conn.loaded_copy(request_id, key, self._copies))
        view = self._conn.loaded(request_id, key)  # ecx memory, read-only, no copy
        return _read_only_tensor(view).to(device=device, copy=True)

    def _viewed(self, request_id: str, key: str) -> bool:
        """Whether the item is a view of E's block. One that was copied instead (past this
        worker's pin quota at E, E on another host) is copied on into vLLM's tensor: the
        worker's own cache holds only a step's loads."""
        try:
            self._conn.view_intact(request_id, key)
            return True
        except ecx.Error:
            return False

    def _end_unheld(self, request_id: str, items: list[dict], done: set[str]) -> None:
        """A step cut short (an exception) ends the pins of the items it did not reach at
        once: no entry of vLLM's holds them, and they would otherwise be renewed for as
        long as the step's other entries live."""
        for item in items:
            if item["ok"] and item["mm_hash"] not in done:
                done.add(item["mm_hash"])
                try:
                    self._conn.item_finished(request_id, item["mm_hash"])
                except ecx.Error:
                    logger.exception("ECXConnector: ending item %s of worker load %s failed",
                                     item["mm_hash"], request_id)
