// How a p2p consumer brings one producer's items into its cache: a fetch mode, chosen
// once at start (p2p_consumer.h), the way UCX chooses a protocol.
//   pull     the params locate each block; one batched READ per producer, or a copy out
//            of a same-host producer's memory through a view (p2p_pull.cc).
//   2-step   the seed NIXL connector's protocol, a measured baseline: per item, a lookup,
//            then a READ (p2p_pull.cc).
//   push     the producer WRITEs into windows we grant it in our cache (p2p_push.cc).
//   view     zero_copy: no copy at all; the block is read where it lies, pinned for us
//            (p2p_view.cc).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "connector/connector_driver.h"

namespace ecx::connector {

class P2pConsumer;

class FetchMode {
 public:
  virtual ~FetchMode() = default;
  // Settles every slot of `group`, whose items are all `producer`'s (connected): a copy
  // committed to the consumer cache, a view (view mode), or a failed status. The view mode
  // leaves a slot it cannot view (another host, or our pin quota full there) ok and not
  // viewed, for the copying mode. Returns by `deadline`.
  virtual void fetch(const std::string& producer, std::vector<FetchSlot*>& group,
                     Deadline deadline) = 0;
};

// The modes. Each uses `consumer` for lookups and calls, and does not outlive it.
std::unique_ptr<FetchMode> make_pull(P2pConsumer& consumer, bool two_step);
std::unique_ptr<FetchMode> make_push(P2pConsumer& consumer);
std::unique_ptr<FetchMode> make_view(P2pConsumer& consumer);

}  // namespace ecx::connector
