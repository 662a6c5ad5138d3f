"""ecx: encoder-cache transfer for EPD-disaggregated LLM serving.

The C++ core (ecx._ecx) does every byte movement; this package names it for Python:

    agent = ecx.Agent("pd-0")                      # one per process
    region = agent.allocate(8 << 20)               # registered memory
    view = agent.buffer(region.id)                 # numpy/torch see it without a copy
    conn = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {}}))

A request names its items as ecx.Item(mm_hash, dtype, shape, params), checked when
made. What a request holds (its cache pins, and the producers' pins its loads took) ends
by an explicit call, request_finished, or with a block:

    with ecx.load(conn, "req-1", [ecx.Item(key, "BF16", [400, 2048], params)], 30000) as out:
        embedding = conn.loaded("req-1", key)   # read-only, no copy
    # request_finished has run, however the block was left

Errors raise ecx.Error with .code (the Status code name, e.g. "not_found") and .message;
an argument of the wrong Python type (a negative size, a tuple of the wrong length)
raises nanobind's TypeError naming the signature.

Arrays over ecx memory never outlive it: agent.deregister(region) raises ecx.Error
("failed_precondition") while an array from agent.buffer(region) lives, and an array
from conn.loaded(request, item) holds the item: item_finished / request_finished take
effect once the last such array is gone.
"""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ecx._ecx import (  # noqa: F401
    Agent,
    Connector,
    ConnectorMetadata,
    CopyBuffers,
    EncoderCachePool,
    Error,
    Item,
    Region,
    TransferHandle,
    TransferParams,
    set_log_level,
)


@contextlib.contextmanager
def load(conn: Connector, request_id: str, items: Sequence[Item],
         timeout_ms: int) -> Iterator[dict[str, Any]]:
    """Loads `items` as request `request_id` (Connector.load: its outcome is what the
    block gets) and ends the request when the block is left, by return or by exception:
    its pins go back then (once the last array from conn.loaded is gone). A load refused
    because another load of that request id runs ("already_exists") ends nothing: that
    request is not this block's."""
    outcome = conn.load(request_id, list(items), timeout_ms)
    if outcome["code"] == "already_exists":
        yield outcome
        return
    try:
        yield outcome
    finally:
        conn.request_finished(request_id)

__all__ = [
    "Agent",
    "Connector",
    "ConnectorMetadata",
    "CopyBuffers",
    "EncoderCachePool",
    "Error",
    "Item",
    "Region",
    "TransferHandle",
    "TransferParams",
    "load",
]
