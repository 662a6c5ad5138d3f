// p2p connector: the producer keeps encoder outputs in a pool registered with its agent;
// the consumer moves them agent to agent.
//   pull       E's params carry each block's location; PD issues one batched READ per
//              producer (no control round trip before the data), then RELEASEs the
//              producer's pins asynchronously in one notification per producer.
//   pull-2step the seed NIXL connector's protocol, kept as a measured baseline: per item,
//              an address query, then a READ.
//   push       Mooncake-style: PD reserves blocks in its own cache and sends one LOAD
//              request per producer; E WRITEs into them and answers.
// Params without a location (region 0) are looked up by mm_hash at the producer in one
// request (lookup by key); a not-ready entry is waited for at the producer, bounded.
#pragma once

#include <memory>

#include "connector/connector_driver.h"

namespace ecx::connector {

Result<std::unique_ptr<EcConnector>> create_p2p_connector(ConnectorConfig config,
                                                          ConnectorOptions options,
                                                          ConnectorContext context);

}  // namespace ecx::connector
