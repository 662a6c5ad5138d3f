"""ECXConnector's figures: per-interval stats in vLLM's EC stats hooks (they reach vLLM's
/metrics and its periodic log line), and an optional exporter of each process's ecx
connector (pools, pins, connections) on a port of its own."""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from ._common import logger

_COUNTS = ("loads", "load_bytes", "local_encodes", "saves", "save_bytes", "params_issued",
           "offers", "worker_items", "worker_items_in_place", "worker_bytes",
           "worker_copies_warm", "idle_waits")
_SERIES = ("load_ms", "worker_copy_ms")
_MAX_SERIES = 10000  # observations kept per interval (vLLM reads them every step)


def empty_stats() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in _COUNTS}
    data.update({name: [] for name in _SERIES})
    data["failures"] = {}
    return data


def merge_stats(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    for name in _COUNTS:
        into[name] = into.get(name, 0) + int(other.get(name, 0))
    for name in _SERIES:
        into.setdefault(name, []).extend(other.get(name, [])[:_MAX_SERIES])
        del into[name][_MAX_SERIES:]
    failures = into.setdefault("failures", {})
    for cause, n in (other.get("failures") or {}).items():
        failures[cause] = failures.get(cause, 0) + int(n)
    return into


def stats_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(n) for n in _COUNTS + _SERIES) and not data.get("failures")


class Counters:
    """This process's figures since vLLM last took them. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = empty_stats()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._data[name] += n

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            if len(self._data[name]) < _MAX_SERIES:
                self._data[name].append(value)

    def fail(self, cause: str, n: int = 1) -> None:
        with self._lock:
            self._data["failures"][cause] = self._data["failures"].get(cause, 0) + n

    def merge(self, other: dict[str, Any]) -> None:
        with self._lock:
            merge_stats(self._data, other)

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            data, self._data = self._data, empty_stats()
        return None if stats_empty(data) else data


@dataclass
class ECXConnectorStats(ECConnectorStats):
    data: dict[str, Any] = field(default_factory=empty_stats)

    def reset(self):
        self.data = empty_stats()

    def aggregate(self, other: ECConnectorStats) -> "ECXConnectorStats":
        merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        loads = d.get("load_ms") or []
        copies = d.get("worker_copy_ms") or []
        out: dict[str, int | float] = {
            "items_loaded": d.get("loads", 0),
            "MB_loaded": round(d.get("load_bytes", 0) / 1e6, 3),
            "avg_load_ms": round(sum(loads) / len(loads), 3) if loads else 0,
            "items_encoded_locally": d.get("local_encodes", 0),
            "avg_worker_copy_ms": round(sum(copies) / len(copies), 3) if copies else 0,
            "items_in_place": d.get("worker_items_in_place", 0),
            "items_saved": d.get("saves", 0),
            "params_issued": d.get("params_issued", 0),
            "offers": d.get("offers", 0),
        }
        for cause, n in sorted((d.get("failures") or {}).items()):
            out[f"failed_{cause}"] = n
        return out

    def is_empty(self) -> bool:
        return stats_empty(self.data)


_SECONDS_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                    5.0, 10.0, 30.0]


class ECXPromMetrics(ECConnectorPromMetrics):
    """vllm:ecx_* series in vLLM's /metrics (docs/VLLM.md lists them)."""

    _COUNTERS = {
        "loads": ("vllm:ecx_loads_total", "Items loaded from encoders by ECXConnector."),
        "load_bytes": ("vllm:ecx_load_bytes_total", "Bytes of items loaded from encoders."),
        "local_encodes": ("vllm:ecx_local_encodes_total",
                          "Items whose load failed and that vLLM encoded itself (recompute)."),
        "saves": ("vllm:ecx_saves_total", "Encoder outputs stored in ecx's pool."),
        "save_bytes": ("vllm:ecx_save_bytes_total", "Bytes of encoder outputs stored."),
        "params_issued": ("vllm:ecx_params_issued_total",
                          "ec_transfer_params items an encoder handed out."),
        "offers": ("vllm:ecx_offers_total",
                   "Requests whose items an encoder offered the PD the proxy named, early."),
        "worker_items": ("vllm:ecx_worker_items_total",
                         "Items a worker copied into vLLM's encoder cache."),
        "worker_copies_warm": ("vllm:ecx_worker_copies_warm_total",
                               "Items a worker copied into a host buffer an earlier copy left "
                               "(already faulted in) rather than a fresh allocation."),
        "idle_waits": ("vllm:ecx_idle_waits_total",
                       "Looks at a load still running that PD's scheduler waited on because "
                       "the engine's last step scheduled nothing (instead of empty steps)."),
        "worker_items_in_place": ("vllm:ecx_worker_items_in_place_total",
                                  "Items vLLM's encoder cache holds where they lie (zero_copy: "
                                  "a read-only tensor over the encoder's block, no copy)."),
    }
    _HISTOGRAMS = {
        "load_ms": ("vllm:ecx_load_seconds",
                    "One request's EC load, from its start until every item is in the cache."),
        "worker_copy_ms": ("vllm:ecx_worker_copy_seconds",
                           "A worker's step: loaded items into vLLM's encoder cache."),
    }

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._per_engine(self._counter_cls(name=name, documentation=doc,
                                                    labelnames=labelnames))
            for key, (name, doc) in self._COUNTERS.items()}
        self._histograms = {
            key: self._per_engine(self._histogram_cls(
                name=name, documentation=doc, buckets=_SECONDS_BUCKETS, labelnames=labelnames))
            for key, (name, doc) in self._HISTOGRAMS.items()}
        self._failures = self._counter_cls(
            name="vllm:ecx_load_failures_total",
            documentation="Items ECXConnector could not load or hand out, by cause.",
            labelnames=[*labelnames, "cause"])

    def _per_engine(self, metric):
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self._counters.items():
            n = transfer_stats_data.get(key, 0)
            if n:
                per_engine[engine_idx].inc(n)
        for key, per_engine in self._histograms.items():
            for ms in transfer_stats_data.get(key, []):
                per_engine[engine_idx].observe(ms / 1000.0)
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for cause, n in (transfer_stats_data.get("failures") or {}).items():
            self._failures.labels(*labels, cause).inc(n)


# What each number of ecx's connector stats (EcConnector.stats(): src/connector/stats.cc)
# counts: ("counter" | "gauge", help). Counters are totals since the process started and
# are exported with "_total". Each is exported as ecx_<name>, named as `ecx serve` names
# the same figure (docs/SERVING.md, "Metrics"): a pool's numbers under ecx_pool_ (E's
# producer pool) or ecx_cache_ (PD's consumer cache), the others by _RENAMED or their own
# name. A number not listed here is exported as untyped, under its own name.
_STAT_TYPES: dict[str, tuple[str, str]] = {
    "saves": ("counter", "items this process saved into its pool"),
    "loads_ok": ("counter", "load requests that ended with every item loaded"),
    "loads_failed": ("counter", "load requests with an item that failed"),
    "items_loaded": ("counter", "items loaded"),
    "items_recomputed": ("counter", "items left to be encoded here"),
    "local_hits": ("counter", "items found in this process's own cache"),
    "bytes_loaded": ("counter", "bytes of items loaded"),
    "load_seconds_total": ("counter", "seconds spent in loads, summed"),
    "not_ready_retries": ("counter", "lookups retried while an item was being saved"),
    "nacks": ("counter", "item loads refused by the producer, by code"),
    "releases_sent": ("counter", "pins this process gave back to producers"),
    "releases_received": ("counter", "pins consumers gave back to this process"),
    "views_held": ("gauge", "items read in place (zero_copy) held now"),
    "items_viewed": ("counter", "items read in place (zero_copy)"),
    "view_renewals_failed": ("counter", "renewals of views' pins that failed"),
    "renewals_received": ("counter", "pin renewals consumers sent this process"),
    "params_rejected": ("counter", "ec_transfer_params refused (signature, item)"),
    "offers_sent": ("counter", "offers this process sent to consumers (E: a request's items)"),
    "offers_failed": ("counter", "offers not delivered (consumer unreachable, queue full)"),
    "items_offered": ("counter", "items consumers offered this process and it loaded early"),
    "offered_refused": ("counter", "offered items refused (untrusted params, too many at once)"),
    "transfer_connects": ("counter", "connections this process's agent made, by result"),
    "peer_failures": ("counter", "peers this process's agent found failed"),
    "capacity_bytes": ("gauge", "bytes of the pool"),
    "used_bytes": ("gauge", "bytes of the pool in use"),
    "payload_bytes": ("gauge", "bytes of items the pool holds"),
    "entries": ("gauge", "items the pool holds"),
    "writing_entries": ("gauge", "items being written"),
    "pinned_entries": ("gauge", "items with at least one pin"),
    "pins": ("gauge", "pins on the pool's items (readers to come)"),
    "evictions": ("counter", "items the pool evicted"),
    "lease_expiries": ("counter", "pins that ended by their lease (a reader that died)"),
    "hits": ("counter", "lookups that found their item"),
    "misses": ("counter", "lookups that did not"),
    "bytes_used_per_payload_byte": ("gauge", "the pool's bytes in use per byte of items"),
}
# {key: n} numbers: one series per key, labelled as `ecx serve` labels them.
_LABELED = {"nacks": "code", "transfer_connects": "backend"}
# Numbers `ecx serve` exports under another name; the pools by their role.
_RENAMED = {"nacks": "ec_nacks", "params_rejected": "ec_params_rejected",
            "bytes_loaded": "ec_bytes_loaded", "producer_pool": "pool",
            "consumer_cache": "cache"}


def _shortest(x: float) -> str:
    """`x` (a bucket's bound: positive) as the C++ services write a number
    (std::to_chars): its shortest round-trip digits, fixed or scientific, whichever is
    shorter (fixed on a tie), so that a bucket's `le` label is the same text in both
    exporters ("1e-04", "0.001", "10")."""
    d = Decimal(repr(float(x))).normalize()
    _, digits, exponent = d.as_tuple()
    text = "".join(map(str, digits))
    power = len(text) - 1 + exponent
    mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
    scientific = f"{mantissa}e{'-' if power < 0 else '+'}{abs(power):02d}"
    fixed = format(d, "f")
    return fixed if len(fixed) <= len(scientific) else scientific


def _histogram_series(name: str, labels: str, h: dict[str, Any]) -> list[str]:
    """One histogram's series as the agent keeps it ({bounds, cumulative, sum, count})."""
    lines = [f'{name}_bucket{{{labels},le="{_shortest(bound)}"}} {n}'
             for bound, n in zip(h["bounds"], h["cumulative"])]
    return [*lines, f'{name}_bucket{{{labels},le="+Inf"}} {h["count"]}',
            f"{name}_sum{{{labels}}} {h['sum']}", f"{name}_count{{{labels}}} {h['count']}"]


def _prometheus_text(stats: dict[str, Any], process: str) -> str:
    """ecx's connector stats (EcConnector.stats()) as Prometheus text: one family per
    number, with HELP and TYPE; counters named with "_total"; the agent's transfer times
    (transfer_seconds, by op) a histogram, as the C++ services export them."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    stats = dict(stats)
    transfer_seconds = stats.pop("transfer_seconds", None) or {}
    if transfer_seconds:
        name = "ecx_transfer_seconds"
        series = [line for op, h in sorted(transfer_seconds.items())
                  for line in _histogram_series(name, f'process="{process}",op="{op}"', h)]
        families[name] = ("histogram", "seconds from a transfer batch's submission to its "
                          "end (moved or failed), by op", series)

    def add(path: str, leaf: str, value: float, labels: str) -> None:
        kind, help_text = _STAT_TYPES.get(leaf, ("untyped", f"ecx connector stat {leaf}"))
        name = f"ecx_{path}"
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"
        family = families.setdefault(name, (kind, help_text, []))
        family[2].append(f"{name}{{{labels}}} {value}")

    def walk(path: list[str], value: Any, labels: str) -> None:
        """`path`: the keys down to `value` (a pool's numbers are one level down)."""
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)):
            add("_".join(_RENAMED.get(p, p) for p in path), path[-1], value, labels)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (int, float)) and path and path[-1] in _LABELED:
                    walk(path, v, f'{labels},{_LABELED[path[-1]]}="{k}"')
                else:
                    walk([*path, k], v, labels)

    walk([], stats, f'process="{process}"')
    lines: list[str] = []
    for name, (kind, help_text, series) in families.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *series]
    return "\n".join(lines) + "\n"


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `limit` at once: a connection past them is closed
    at once, so idle or slow clients cannot pile threads up inside vLLM's process."""

    daemon_threads = True

    def __init__(self, address, handler, limit: int):
        self._slots = threading.BoundedSemaphore(limit)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class Exporter:
    """GET /metrics on <host>:<port> (127.0.0.1 by default): this process's ecx connector,
    for the figures vLLM does not collect (a producer worker's pool and pins, a consumer
    worker's cache). At most `max_connections` are served at once, each given `timeout_s`
    for its request; a port that is taken is logged and left: the exporter never stops
    the process it runs in (`serving` says whether it listens)."""

    def __init__(self, port: int, process: str, stats_fn, host: str = "127.0.0.1",
                 max_connections: int = 8, timeout_s: float = 5.0):
        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s  # a connection that sends no whole request in it is closed

            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path != "/metrics":
                    self.send_error(404, "only /metrics")
                    return
                try:
                    body = _prometheus_text(stats_fn(), process).encode()
                except Exception as e:  # the connector may be shutting down
                    self.send_error(503, f"ecx connector unavailable: {e}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no access log in vLLM's output
                pass

        self.port = port
        try:
            self._server: _BoundedServer | None = _BoundedServer((host, port), Handler,
                                                                 max_connections)
        except OSError as e:
            self._server = None
            logger.warning("ECXConnector (%s): no ecx metrics exporter on %s:%d: %s (vLLM "
                           "runs on without it)", process, host, port, e)
            return
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"ecx-metrics-{port}", daemon=True)
        self._thread.start()
        logger.info("ECXConnector (%s): ecx metrics on http://%s:%d/metrics", process, host,
                    port)

    @property
    def serving(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
