"""ecx: encoder-cache transfer for EPD-disaggregated LLM serving.

The C++ core (ecx._ecx) does every byte movement; this package names it for Python:

    agent = ecx.Agent("pd-0")                      # one per process
    region = agent.allocate(8 << 20)               # registered memory
    view = agent.buffer(region.id)                 # numpy/torch see it without a copy
    conn = ecx.Connector(json.dumps({"connector": "p2p", "role": "consumer", "extra": {}}))

Errors raise ecx.Error with .code (the Status code name, e.g. "not_found") and .message.
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
