// The view mode (p2p_fetch.h): zero_copy reads a same-host producer's block where it
// lies, with no copy at all.
#include "connector/p2p_common.h"
#include "connector/p2p_consumer.h"
#include "connector/p2p_fetch.h"
#include "ecx/cache/block_header.h"

namespace ecx::connector {
namespace {

using p2p::describe;

// A view that the params' pin holds alone (LoadItem::own_pin_taken): no lookup takes
// another.
bool holds_params_pin(const FetchSlot& slot, std::chrono::milliseconds lease) {
  const LoadItem& item = *slot.item;
  return item.own_pin_taken && item.params && item.params->pin != 0 &&
         Clock::now() - *item.own_pin_taken < lease / 3;
}

// zero_copy, pull: views each block where it lies in the producer's memory (same host),
// then takes a pin of our own on it: a lookup with the params' capability, which proves
// the params' pin still holds the block and pins it for this consumer alone (its quota;
// its death ends it; nobody else can release it). Only then is the header checked: with
// our pin live, the block cannot be reused under the view. Blocks that cannot be viewed
// (another host), and views beyond our pin quota, are left to fetch. A worker's view of
// its own scheduler's block holds the pin the scheduler shared with it instead, when that
// pin is fresh (LoadItem::own_pin_taken).
class ViewFetch final : public FetchMode {
 public:
  explicit ViewFetch(P2pConsumer& consumer) : consumer_(consumer) {}

  void fetch(const std::string& producer, std::vector<FetchSlot*>& group,
             Deadline deadline) override;

 private:
  const ConnectorOptions& options() const { return consumer_.core().options(); }
  transfer::Agent* agent() const { return consumer_.core().agent(); }

  bool map_view(const std::string& producer, FetchSlot& slot, const BlockLocation& loc);
  void settle_view(const std::string& producer, FetchSlot& slot, const BlockLocation& named,
                   const BlockLocation& mine);

  P2pConsumer& consumer_;
};

void ViewFetch::fetch(const std::string& producer, std::vector<FetchSlot*>& group,
                      Deadline deadline) {
  std::vector<BlockLocation> where =
      consumer_.locate(producer, group, /*force_lookup=*/false, deadline);
  std::vector<FetchSlot*> mapped;
  std::vector<BlockLocation> mapped_where;
  for (size_t i = 0; i < group.size(); ++i) {
    if (map_view(producer, *group[i], where[i])) {
      mapped.push_back(group[i]);
      mapped_where.push_back(where[i]);
    }
  }
  if (mapped.empty()) return;
  // Our own pins: those a lookup by key took already (locate), the params' pins that are
  // ours alone (no pin of the slot's: the params' is renewed and given back), and the
  // others' now.
  std::vector<BlockLocation> ours = mapped_where;
  std::vector<FetchSlot*> to_pin;
  std::vector<size_t> to_pin_index;
  for (size_t k = 0; k < mapped.size(); ++k) {
    if (mapped[k]->producer_pin.pin != 0) continue;
    if (holds_params_pin(*mapped[k], std::chrono::milliseconds(options().lease_ms))) {
      ours[k].pin = 0;
      continue;
    }
    to_pin.push_back(mapped[k]);
    to_pin_index.push_back(k);
  }
  if (!to_pin.empty()) {
    std::vector<BlockLocation> found(to_pin.size());
    consumer_.lookup(producer, to_pin, found, deadline);
    for (size_t j = 0; j < to_pin.size(); ++j) ours[to_pin_index[j]] = found[j];
  }
  for (size_t k = 0; k < mapped.size(); ++k) {
    settle_view(producer, *mapped[k], mapped_where[k], ours[k]);
  }
}

// Maps `slot`'s block, as the params name it at `loc`; false if it is not viewed (failed,
// or left to fetch: the backend maps nothing of that producer).
bool ViewFetch::map_view(const std::string& producer, FetchSlot& slot, const BlockLocation& loc) {
  if (!slot.status.ok()) return false;
  if (loc.length != cache::kBlockHeaderBytes + slot.item->meta.byte_size()) {
    slot.status = InvalidArgument("ec_transfer_params for " + slot.item->mm_hash.str() +
                                  ": length " + std::to_string(loc.length) + " does not match " +
                                  slot.item->meta.to_string());
    return false;
  }
  auto view = agent()->view(producer, loc.region, loc.offset, loc.length, loc.capability);
  if (!view.ok() && view.status().code() == StatusCode::kFailedPrecondition) return false;
  if (!view.ok()) {
    slot.status = view.status().code() == StatusCode::kPermissionDenied
                      ? Status(StatusCode::kEvicted,
                               view.status().message() + " (the producer no longer grants it)")
                      : view.status();
    return false;
  }
  slot.block = cache::BlockRef{.mm_hash = slot.item->mm_hash,
                               .meta = slot.item->meta,
                               .region = loc.region,
                               .offset = loc.offset,
                               .block_length = loc.length,
                               .generation = loc.generation,
                               .block = const_cast<std::byte*>(view->data)};  // read-only
  slot.keepalive = view->keepalive;
  return true;
}

// A mapped view, once the lookup answered for our own pin (`mine`): viewed if the pin is
// on the block the params named and its header is the item's; copied instead if the
// producer pins no more for us; failed otherwise.
void ViewFetch::settle_view(const std::string& producer, FetchSlot& slot,
                            const BlockLocation& named, const BlockLocation& mine) {
  if (mine.pin != 0) slot.producer_pin = {mine.pin, mine.capability};  // released at the end
  Status s = slot.status;
  if (s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kFailedPrecondition) {
    // We hold all the pins this producer lets one reader keep, or the block's owner
    // pins nothing for readers (an owner that serves no lookups): copy it.
    slot.block = {};
    slot.keepalive.reset();
    slot.status = Status::Ok();
    return;
  }
  if (s.ok() && (mine.region != named.region || mine.offset != named.offset ||
                 (named.generation != 0 && mine.generation != named.generation))) {
    s = Status(StatusCode::kEvicted, "block of " + slot.item->mm_hash.str() + " at " +
                                         describe(named, producer) + " was reused");
  }
  if (s.ok()) {
    s = cache::verify_block(
        slot.block.block, slot.block.block_length,
        {slot.item->mm_hash, slot.item->meta, slot.block.generation, describe(named, producer),
         options().verify_checksum(/*crossed=*/false)});
  } else if (s.code() == StatusCode::kNotFound) {
    s = Status(StatusCode::kEvicted, s.message() + " (its pin at " + producer + " ended)");
  }
  slot.status = s;
  slot.viewed = s.ok();
  if (!s.ok()) {
    slot.block = {};
    slot.keepalive.reset();
  }
}

}  // namespace

std::unique_ptr<FetchMode> make_view(P2pConsumer& consumer) {
  return std::make_unique<ViewFetch>(consumer);
}

}  // namespace ecx::connector
