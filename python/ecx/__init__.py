"""ecx: encoder-cache transfer for EPD-disaggregated LLM serving.

The C++ core (ecx._ecx) does every byte movement; this package names it for Python:

    agent = ecx.Agent("pd-0")                      # one per process
    region = agent.allocate(8 << 20)               # registered memory
    view = agent.buffer(region.id)                 # numpy/torch see it without a copy
    conn = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {}}))

Errors raise ecx.Error with .code (the Status code name, e.g. "not_found") and .message;
an argument of the wrong Python type (a negative size, a tuple of the wrong length)
raises nanobind's TypeError naming the signature.

Arrays over ecx memory never outlive it: agent.deregister(region) raises ecx.Error
("failed_precondition") while an array from agent.buffer(region) lives, and an array
from conn.loaded(request, item) holds the item: item_finished / request_finished take
effect once the last such array is gone.
"""

from ecx._ecx import (  # noqa: F401
    Agent,
    Connector,
    ConnectorMetadata,
    EncoderCachePool,
    Error,
    Region,
    TransferHandle,
    TransferParams,
)

__all__ = [
    "Agent",
    "Connector",
    "ConnectorMetadata",
    "EncoderCachePool",
    "Error",
    "Region",
    "TransferHandle",
    "TransferParams",
]
