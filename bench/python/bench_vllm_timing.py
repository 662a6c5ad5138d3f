"""EC load time per item, measured the same way for every vLLM EC connector.

`ecx bench vllm` (bench/python/bench_vllm.py) loads each connector through this module
instead of directly: `"ec_connector": "TimedECExampleConnector"` with
`"ec_connector_module_path"` naming this module makes vLLM's factory build
`Timed<Name>`, a subclass of the real connector `<Name>` made here on first use (PEP 562
module `__getattr__`, so importing this module imports no connector, and a connector that
is not installed fails only its own row). The subclass calls the real methods unchanged
and appends wall-clock events (`time.time()`: every process is on this host, so the
clocks agree) as JSON lines to the file named by $ECX_BENCH_TIMING_FILE (one `write(2)`
per line on an O_APPEND descriptor, so the scheduler's and the worker's lines never
interleave):

  scheduler side  {"ev": "sight", "t", "req", "items": [mm_hash, ...], "hook", "consumer"}, once per
                  request: the scheduler's first look at it. That is its first
                  `ensure_cache_available` call, which vLLM's scheduler makes for every
                  request with multimodal inputs before it schedules any of them (the base
                  class answers True; ECXConnector starts its READ there; ECCPUConnector
                  and ECMooncakeConnector check their state there). Should a connector's
                  scheduler skip it, the request's first `update_state_after_alloc` or the
                  first `has_cache_item` of one of its items stands in (`hook` says which).
                  Besides, {"ev": "alloc", "t", "req", "item"} at every
                  `update_state_after_alloc`: the step that schedules the item; and
                  {"ev": "step", "t", "tokens", "ensure_ms"} at every `build_connector_meta`,
                  which vLLM calls once at the end of each `schedule()` (tokens: what the
                  step scheduled; ensure_ms: the time this schedule() spent inside the
                  connector's `ensure_cache_available`, e.g. ECX's first-look waits), then
                  {"ev": "built", "t", "ms"} when it returned (ms: the connector's own
                  `build_connector_meta`), and
                  {"ev": "stepped", "t"} at every `get_ec_connector_stats`, which vLLM
                  calls once per step when the step's output is back. `step_stats`: the
                  engine's step as the connector makes it, step -> stepped (the forward
                  pass, in-step loads included) plus ensure_ms (idle time never counts).
  worker side     {"ev": "filled", "t", "items": [mm_hash, ...]} when `start_load_caches`
                  returned, with the items it put into vLLM's `encoder_cache` in that call
                  (its keys after the call minus before: a local encode never counts).
                  With $ECX_BENCH_ITEM_DIGESTS=1 also the SHA-256 of each such item's
                  bytes ("digests": {mm_hash: hex}, taken after "t"), and on the producer,
                  {"ev": "saved", "item", "digest"} at every `save_caches`: what E computed.
                  `item_digests` compares them, item by item.

`ec_load_stats` joins them. The figure the bench reports (`from_sight`): for each request
first seen in a time window, the time from its first sight to the first `filled` event
(after the sight) that holds its last item, divided by its number of items, in ms.
Requests whose items never arrive through the connector (a local encode after a failed
load, or items already in vLLM's cache) are counted apart, not timed. It is what the
connector leaves between the PD's first look at a request and its embeddings being in
vLLM's cache: for a pull connector (ECX, ECCPU) the transfer itself; for the disk connector
the read of a file E already wrote; for a push connector (Mooncake) the wait for E's push
and the final copy. It also holds the time the request queues in the scheduler before a
step has room for it (chunked prefill: on this CPU a step can take seconds), which every
connector pays alike and ECX overlaps with its READ. `from_alloc` separates the two: per
item, from the `update_state_after_alloc` of the step that schedules it to the `filled`
event that holds it: the load's cost inside the step (the whole load for the disk
connector; only the final copy for ECX, whose READ ended before the request was
scheduled).

With $ECX_BENCH_PHASES=1 (a diagnostic) the engines also mark vLLM's dispatch from the
scheduler to the worker ("sent", "run", "pre": `_patch_phases`), and `dispatch_phases`
splits each request's time from first sight to its fill at those marks (the run's JSON:
"dispatch_phases_ms").

This file imports neither vLLM nor ecx at module level; bench_vllm.py puts a copy of it on
the engines' PYTHONPATH as the module `ecx_vllm_timing`, so it works whether or not the
ecx package in the venv is current (`ecx.bench_vllm_timing` works too when installed).
"""
from __future__ import annotations

import importlib
import json
import os
import threading
import time

ENV = "ECX_BENCH_TIMING_FILE"
DIGESTS_ENV = "ECX_BENCH_ITEM_DIGESTS"

# The connector classes this module can time: name -> (module, class).
TARGETS = {
    "ECExampleConnector": ("vllm.distributed.ec_transfer.ec_connector.example_connector",
                           "ECExampleConnector"),
    "ECCPUConnector": ("vllm.distributed.ec_transfer.ec_connector.cpu.connector",
                       "ECCPUConnector"),
    "ECMooncakeConnector": ("vllm.distributed.ec_transfer.ec_connector.mooncake_ec_connector",
                            "ECMooncakeConnector"),
    "ECXConnector": ("ecx.vllm", "ECXConnector"),
}

_made: dict[str, type] = {}
_lock = threading.Lock()


STACKS_ENV = "ECX_BENCH_STACKS"
STACKS_MAX_S = 3600  # a sampler stops by itself
_sampling = False


def _start_stack_sampler() -> None:
    """A diagnostic, off unless $ECX_BENCH_STACKS names a path: a thread of the engine's
    process samples its main thread's Python stack every 2 ms and appends it, with the
    time, to PATH.<pid> whenever it changed ({"t", "s": [file:function:line, ...]}, the
    innermost frame first). Set around `ecx bench vllm`, it shows where each engine
    process (E's and PD's EngineCore and workers) was while a request waited: how
    HISTORY.md §30 found PD's worker asleep in vLLM's message queue. Sampling takes the GIL
    every 2 ms: not for the figures a run reports."""
    global _sampling
    path = os.environ.get(STACKS_ENV)
    if not path or _sampling:
        return
    _sampling = True
    import sys
    main_id = threading.main_thread().ident
    fd = os.open(f"{path}.{os.getpid()}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def run():
        last = None
        end = time.monotonic() + STACKS_MAX_S
        while time.monotonic() < end:
            time.sleep(0.002)
            frame = sys._current_frames().get(main_id)
            if frame is None:
                return  # the main thread ended
            stack = []
            while frame is not None and len(stack) < 14:
                code = frame.f_code
                stack.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:"
                             f"{frame.f_lineno}")
                frame = frame.f_back
            if stack != last:
                try:
                    os.write(fd, (json.dumps({"t": time.time(), "s": stack}) + "\n").encode())
                except OSError:
                    return
                last = stack

    threading.Thread(target=run, daemon=True, name="ecx-bench-stacks").start()


PHASES_ENV = "ECX_BENCH_PHASES"
_phases_patched = False


def _patch_phases(log: "_Log") -> None:
    """A diagnostic, off unless $ECX_BENCH_PHASES=1: splits vLLM's dispatch (from the
    scheduler's `build_connector_meta` to the worker's `start_load_caches`) with events at
    the entry of the executor's `execute_model` in the scheduler's process ("sent") and,
    in each worker, at the entry of the model runner's `execute_model` ("run") and of its
    `_preprocess` ("pre", after `_update_states` and `_prepare_inputs`). It wraps vLLM's
    classes in this process (once); each wrapper adds a clock read and a write(2)."""
    global _phases_patched
    if os.environ.get(PHASES_ENV) != "1" or _phases_patched:
        return
    _phases_patched = True
    targets = [("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "execute_model",
                "sent"),
               ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model", "run"),
               ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_preprocess", "pre")]
    for module, cls, method, ev in targets:
        try:
            owner = getattr(importlib.import_module(module), cls)
            inner = getattr(owner, method)
        except Exception:  # noqa: BLE001 (a diagnostic must never stop an engine)
            continue

        def wrapped(*args, _inner=inner, _ev=ev, **kwargs):
            log.emit(ev=_ev, t=time.time())
            return _inner(*args, **kwargs)

        setattr(owner, method, wrapped)


class _Log:
    """Appends JSON lines to $ECX_BENCH_TIMING_FILE (nothing when it is unset)."""

    def __init__(self):
        path = os.environ.get(ENV)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else None

    def emit(self, **event) -> None:
        if self._fd is None:
            return
        event["pid"] = os.getpid()
        try:
            os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())
        except OSError:
            pass  # timing must never break serving


def _digest(tensor) -> str:
    """SHA-256 of a tensor's bytes, as they are (dtype and order)."""
    import hashlib

    import torch
    host = tensor.detach().to("cpu").contiguous()
    return hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()


def _items(request) -> list[str]:
    return [f.identifier for f in (getattr(request, "mm_features", None) or [])]


def timed(base: type) -> type:
    """A subclass of the connector class `base` that records the events above."""

    class Timed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            self._ecx_log = _Log()
            self._ecx_digests = os.environ.get(DIGESTS_ENV) == "1"
            self._ecx_seen: set[str] = set()  # requests already sighted
            self._ecx_seen_items: set[str] = set()
            self._ecx_ensure_s = 0.0  # this schedule()'s time in ensure_cache_available
            super().__init__(*args, **kwargs)
            _start_stack_sampler()
            _patch_phases(self._ecx_log)

        def _ecx_sight(self, request, hook: str) -> None:
            rid = getattr(request, "request_id", None)
            if rid is None or rid in self._ecx_seen:
                return
            self._ecx_seen.add(rid)
            items = _items(request)
            self._ecx_seen_items.update(items)
            self._ecx_log.emit(ev="sight", t=time.time(), req=rid, items=items, hook=hook,
                               consumer=bool(self.is_consumer))

        # ---- scheduler side
        def ensure_cache_available(self, request, num_computed_tokens):
            self._ecx_sight(request, "ensure_cache_available")
            started = time.monotonic()
            try:
                return super().ensure_cache_available(request, num_computed_tokens)
            finally:
                self._ecx_ensure_s += time.monotonic() - started

        def update_state_after_alloc(self, request, index):
            self._ecx_sight(request, "update_state_after_alloc")
            items = _items(request)
            if 0 <= index < len(items):
                self._ecx_log.emit(ev="alloc", t=time.time(), req=request.request_id,
                                   item=items[index], consumer=bool(self.is_consumer))
            return super().update_state_after_alloc(request, index)

        def build_connector_meta(self, scheduler_output):
            self._ecx_log.emit(ev="step", t=time.time(),
                               tokens=int(getattr(scheduler_output,
                                                  "total_num_scheduled_tokens", 0) or 0),
                               ensure_ms=self._ecx_ensure_s * 1000.0,
                               consumer=bool(self.is_consumer))
            self._ecx_ensure_s = 0.0
            started = time.monotonic()
            try:
                return super().build_connector_meta(scheduler_output)
            finally:
                self._ecx_log.emit(ev="built", t=time.time(),
                                   ms=(time.monotonic() - started) * 1000.0,
                                   consumer=bool(self.is_consumer))

        def get_ec_connector_stats(self):
            self._ecx_log.emit(ev="stepped", t=time.time(), consumer=bool(self.is_consumer))
            return super().get_ec_connector_stats()

        def has_cache_item(self, identifier):
            if identifier not in self._ecx_seen_items:  # an item of an unsighted request
                self._ecx_seen_items.add(identifier)
                self._ecx_log.emit(ev="sight", t=time.time(), req=f"item:{identifier}",
                                   items=[identifier], hook="has_cache_item",
                                   consumer=bool(self.is_consumer))
            return super().has_cache_item(identifier)

        # ---- worker side
        def start_load_caches(self, encoder_cache, **kwargs):
            before = set(encoder_cache.keys()) if encoder_cache is not None else set()
            called = time.time()
            try:
                return super().start_load_caches(encoder_cache, **kwargs)
            finally:
                if encoder_cache is not None:
                    filled = [k for k in encoder_cache.keys() if k not in before]
                    if filled:
                        t = time.time()
                        digests = {k: _digest(encoder_cache[k]) for k in filled} \
                            if self._ecx_digests else None
                        # call_ms: the connector's own time in this call (the rest of
                        # from_alloc is vLLM's, between its scheduler and this worker)
                        self._ecx_log.emit(ev="filled", t=t, items=filled, digests=digests,
                                           call_ms=(t - called) * 1000.0)

        def save_caches(self, encoder_cache, mm_hash, **kwargs):
            out = super().save_caches(encoder_cache, mm_hash, **kwargs)
            if self._ecx_digests and self.is_producer and mm_hash in encoder_cache:
                self._ecx_log.emit(ev="saved", t=time.time(), item=mm_hash,
                                   digest=_digest(encoder_cache[mm_hash]), consumer=False)
            return out

    Timed.__name__ = Timed.__qualname__ = "Timed" + base.__name__
    Timed.__module__ = __name__
    Timed.__doc__ = f"{base.__name__}, timed (ecx bench vllm; see {__name__})."
    return Timed


def __getattr__(name: str):
    """`Timed<Name>` for each connector of TARGETS, made on first use."""
    if not name.startswith("Timed") or name[5:] not in TARGETS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in _made:
            module, cls = TARGETS[name[5:]]
            _made[name] = timed(getattr(importlib.import_module(module), cls))
        return _made[name]


# ---------------------------------------------------------------- the join

def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def read_events(path: str) -> list[dict]:
    events = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a killed process
    except FileNotFoundError:
        pass
    return events


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50": _percentile(values, 50), "p99": _percentile(values, 99),
            "mean": sum(values) / len(values)}


def _first_after(times: list[float], t0: float) -> float | None:
    return next((t for t in times if t >= t0), None)


def ec_load_stats(events: list[dict], t_from: float = 0.0, t_to: float = float("inf")) -> dict:
    """{"from_sight", "from_alloc", "worker_call", "requests", "items", "not_loaded"} for the
    requests first
    seen in [t_from, t_to] (see the module's docstring); each of from_sight (per request:
    last item filled - first sight, / items) and from_alloc (per item: filled - its alloc) is
    {"p50", "p99", "mean"} in ms, or None when nothing loaded through the connector."""
    sights: dict[str, tuple[float, list[str]]] = {}
    allocs: list[tuple[float, str]] = []
    fills: dict[str, list[float]] = {}
    for e in events:
        if not e.get("consumer", True):
            continue  # a producer's scheduler: not a load
        if e.get("ev") == "sight":
            req = e["req"]
            if req not in sights or e["t"] < sights[req][0]:
                sights[req] = (e["t"], list(e.get("items") or []))
        elif e.get("ev") == "alloc" and t_from <= e["t"] <= t_to:
            allocs.append((e["t"], e["item"]))
        elif e.get("ev") == "filled":
            for item in e.get("items") or []:
                fills.setdefault(item, []).append(e["t"])
    for times in fills.values():
        times.sort()
    # A request sighted by its ensure_cache_available/update_state_after_alloc covers its
    # items; a has_cache_item sighting ("item:<mm_hash>") counts only for items no request
    # sighting names.
    covered = {i for r, (_, items) in sights.items() if not r.startswith("item:") for i in items}
    per_request, not_loaded, items_total = [], 0, 0
    for req, (t0, items) in sights.items():
        if not (t_from <= t0 <= t_to) or not items:
            continue
        if req.startswith("item:") and items[0] in covered:
            continue
        done = [_first_after(fills.get(item, []), t0) for item in items]
        if None in done:
            not_loaded += 1
            continue
        items_total += len(items)
        per_request.append((max(done) - t0) * 1000.0 / len(items))
    calls = [e["call_ms"] / len(e["items"]) for e in events
             if e.get("ev") == "filled" and "call_ms" in e and e.get("items")
             and t_from <= e["t"] <= t_to]
    per_item = []
    for t_alloc, item in allocs:
        t_fill = _first_after(fills.get(item, []), t_alloc)
        if t_fill is not None:
            per_item.append((t_fill - t_alloc) * 1000.0)
    return {"from_sight": _summary(per_request), "from_alloc": _summary(per_item),
            "worker_call": _summary(calls),
            "requests": len(per_request), "items": items_total, "not_loaded": not_loaded}


def step_stats(events: list[dict], t_from: float = 0.0, t_to: float = float("inf")) -> dict | None:
    """The consumer engine's steps that scheduled work in [t_from, t_to], as the connector
    makes them: from the end of the step's schedule() to its output (the forward pass and
    any in-step load) plus the time its schedule() spent in ensure_cache_available, in ms:
    {"p50", "p99", "mean", "steps", "ensure_mean", "empty_steps"}, or None without such a
    step. empty_steps: the steps that scheduled nothing (vLLM runs them back to back while
    a waiting request's connector says its items are not there yet)."""
    timeline = sorted((e["t"], e["ev"], e) for e in events
                      if e.get("ev") in ("step", "stepped") and e.get("consumer", True))
    totals, ensures = [], []
    for (t, ev, e), (t_next, ev_next, _) in zip(timeline, timeline[1:]):
        if ev != "step" or ev_next != "stepped" or e.get("tokens", 0) <= 0:
            continue
        if not t_from <= t <= t_to:
            continue
        ensures.append(float(e.get("ensure_ms", 0.0)))
        totals.append((t_next - t) * 1000.0 + ensures[-1])
    out = _summary(totals)
    if out is not None:
        out["steps"] = len(totals)
        out["ensure_mean"] = sum(ensures) / len(ensures)
        out["empty_steps"] = sum(1 for t, ev, e in timeline if ev == "step"
                                 and e.get("tokens", 0) <= 0 and t_from <= t <= t_to)
    return out


PHASES = ("look", "build", "to_sent", "sent_run", "run_pre", "pre_call", "call")


def dispatch_phases(events: list[dict], t_from: float = 0.0,
                    t_to: float = float("inf")) -> dict | None:
    """Where each request's time from first sight to its first fill goes, with the
    $ECX_BENCH_PHASES events (None without them), per request first seen in [t_from, t_to],
    in ms: "look" (sight -> its step's build_connector_meta: the rest of schedule(), the
    connector's ensure_cache_available included), "build" (the connector's
    build_connector_meta), "to_sent" (-> the executor's execute_model), "sent_run" (->
    the worker's model runner: vLLM's message queue), "run_pre" (-> its _preprocess:
    _update_states, _prepare_inputs), "pre_call" (-> start_load_caches), "call" (the
    connector's call), each {"p50", "p99", "mean"}; "requests"; and "sent_run_by_ensure":
    sent_run's summary for the requests whose schedule() spent under / at least 0.5 ms in
    ensure_cache_available ({"under", "over"})."""
    consumer = [e for e in events if e.get("consumer", True) or e.get("ev") in
                ("sent", "run", "pre")]
    consumer.sort(key=lambda e: e["t"])
    sights = [e for e in consumer if e.get("ev") == "sight" and not e["req"].startswith("item:")]
    if not sights:
        return None
    sched = sights[0]["pid"]

    def last(ev: str, until: float, pid: int):
        """The last `ev` of process `pid` at or before `until`: the marks are taken back
        from the fill, so that a request scheduled steps after its first sight is split
        at the step that ran it (the steps before count in its look)."""
        return next((e for e in reversed(consumer) if e.get("ev") == ev and e["t"] <= until
                     and e["pid"] == pid), None)

    rows, by_ensure = {k: [] for k in PHASES}, {"under": [], "over": []}
    for s in sights:
        if not t_from <= s["t"] <= t_to:
            continue
        fill = next((e for e in consumer if e.get("ev") == "filled" and e["t"] >= s["t"]
                     and set(s["items"]) & set(e.get("items") or [])), None)
        if fill is None or "call_ms" not in fill:
            continue
        called = fill["t"] - fill["call_ms"] / 1000.0
        pre = last("pre", called, fill["pid"])
        run = pre and last("run", pre["t"], fill["pid"])
        sent = run and last("sent", run["t"], sched)
        built = sent and last("built", sent["t"], sched)
        step = built and last("step", built["t"], sched)
        if step is None or step["t"] < s["t"]:
            continue  # no marks (the diagnostic off), or not this request's step
        marks = [s["t"], step["t"], built["t"], sent["t"], run["t"], pre["t"], called, fill["t"]]
        for name, a, b in zip(PHASES, marks, marks[1:]):
            rows[name].append((b - a) * 1000.0)
        by_ensure["over" if step.get("ensure_ms", 0.0) >= 0.5 else "under"].append(
            (run["t"] - sent["t"]) * 1000.0)
    if not rows["look"]:
        return None
    out: dict = {name: _summary(v) for name, v in rows.items()}
    out["requests"] = len(rows["look"])
    out["sent_run_by_ensure"] = {k: _summary(v) for k, v in by_ensure.items()}
    return out


def item_digests(events: list[dict]) -> dict | None:
    """Each item PD's connector put into vLLM's cache against what E computed for it:
    {"items", "equal", "differ": [mm_hash, ...], "not_saved"}; None without digests."""
    saved = {e["item"]: e["digest"] for e in events if e.get("ev") == "saved"}
    filled: dict[str, str] = {}
    for e in events:
        if e.get("ev") == "filled" and e.get("digests"):
            filled.update(e["digests"])
    if not filled:
        return None
    differ = sorted(k for k, d in filled.items() if k in saved and saved[k] != d)
    not_saved = sum(1 for k in filled if k not in saved)
    return {"items": len(filled), "equal": len(filled) - len(differ) - not_saved,
            "differ": differ, "not_saved": not_saved}
