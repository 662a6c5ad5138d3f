// push (p2p_fetch.h), Mooncake-style: we reserve blocks in our cache and send one LOAD
// request per producer; the producer WRITEs into them and answers.
#include "connector/p2p_common.h"
#include "connector/p2p_consumer.h"
#include "connector/p2p_fetch.h"

namespace ecx::connector {
namespace {

using p2p::params_capability;

class PushFetch final : public FetchMode {
 public:
  explicit PushFetch(P2pConsumer& consumer) : consumer_(consumer) {}

  void fetch(const std::string& producer, std::vector<FetchSlot*>& group,
             Deadline deadline) override;

 private:
  ConnectorCore& core() const { return consumer_.core(); }
  const ConnectorOptions& options() const { return core().options(); }
  transfer::Agent* agent() const { return core().agent(); }

  P2pConsumer& consumer_;
};

// push: asks the producer to write each block into the window we grant it in our cache.
void PushFetch::fetch(const std::string& producer, std::vector<FetchSlot*>& group,
                      Deadline deadline) {
  auto exchange = [&](const std::vector<size_t>& pending, int64_t wait_ms) {
    LoadBlocksRequest req{.consumer = agent()->metadata().to_json(),
                          .backend = options().backend,
                          .wait_ms = wait_ms};
    // The producer may write our reserved blocks, and nothing else, until the call ends.
    std::vector<transfer::Capability> grants;
    for (size_t i : pending) {
      FetchSlot* slot = group[i];
      const auto& p = *slot->item->params;
      auto cap = params_capability(p);
      auto window = agent()->grant(core().consumer_cache()->region_id(), slot->block.offset,
                                   slot->block.block_length, /*write=*/true, producer);
      if (window.ok()) grants.push_back(*window);
      req.items.push_back({.mm_hash = slot->item->mm_hash,
                           .capability = cap.ok() ? *cap : transfer::Capability{},
                           .dst_region = core().consumer_cache()->region_id(),
                           .dst_offset = slot->block.offset,
                           .dst_length = slot->block.block_length,
                           .dst_capability = window.ok() ? *window : transfer::Capability{},
                           .generation = p.generation,
                           .pin = p.pin});
    }
    auto answer = agent()->call(producer, to_json(req), deadline);
    for (const auto& g : grants) agent()->revoke(g);
    return answer;
  };
  consumer_.call_until_ready(
      producer, group, deadline, "load", exchange, [&](size_t i, const ItemReply& reply) {
        FetchSlot* slot = group[i];
        // The producer ends the params' pin once it has written (or failed).
        slot->params_pin_released = true;
        Status s = reply.status;
        if (s.ok()) {
          s = core().consumer_cache()->commit_received(
              slot->item->mm_hash, slot->block.generation,
              {slot->item->mm_hash, slot->item->meta, slot->item->params->generation,
               "our cache offset " + std::to_string(slot->block.offset) + " written by " + producer,
               options().verify_checksum(/*crossed=*/true)});
        }
        slot->status = s;
      });
}

}  // namespace

std::unique_ptr<FetchMode> make_push(P2pConsumer& consumer) {
  return std::make_unique<PushFetch>(consumer);
}

}  // namespace ecx::connector
