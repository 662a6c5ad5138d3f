// pull and 2-step (p2p_fetch.h): we read the producer's blocks into blocks reserved in
// our cache; through a view of its memory where the backend has one (same host), by a
// batched READ otherwise.
#include <atomic>
#include <cstring>
#include <optional>

#include "connector/copy_crew.h"
#include "connector/p2p_common.h"
#include "connector/p2p_consumer.h"
#include "connector/p2p_fetch.h"
#include "ecx/cache/block_header.h"
#include "ecx/common/checksum.h"

namespace ecx::connector {
namespace {

using p2p::describe;

class PullFetch final : public FetchMode {
 public:
  PullFetch(P2pConsumer& consumer, bool two_step)
      : consumer_(consumer), two_step_(two_step), copy_crew_(options().copy_threads) {}

  void fetch(const std::string& producer, std::vector<FetchSlot*>& group,
             Deadline deadline) override {
    if (!two_step_) return fetch_group(producer, group, deadline);
    for (FetchSlot* s : group) {  // an address query, then a READ, item by item
      std::vector<FetchSlot*> one{s};
      fetch_group(producer, one, deadline);
    }
  }

 private:
  // A block this load copies out of a same-host producer's memory, through a view.
  struct ViewedBlock {
    FetchSlot* slot;
    transfer::RemoteView view;
    BlockLocation loc;
  };

  ConnectorCore& core() const { return consumer_.core(); }
  const ConnectorOptions& options() const { return core().options(); }
  transfer::Agent* agent() const { return core().agent(); }

  void fetch_group(const std::string& producer, std::vector<FetchSlot*>& group, Deadline deadline);
  void read_through_view(const std::string& producer, std::vector<FetchSlot*>& moving,
                         std::vector<BlockLocation>& where);
  void copy_from_views(const std::string& producer, std::vector<ViewedBlock>& blocks);
  void read_batched(const std::string& producer, const std::vector<FetchSlot*>& moving,
                    const std::vector<BlockLocation>& where, Deadline deadline);

  P2pConsumer& consumer_;
  const bool two_step_;  // every block looked up first (pinned for us), however located
  // Same-host copies, split over copy_threads. Its helpers go with the mode, which the
  // connector drops only after its loaders are joined and no caller is left in a load.
  CopyCrew copy_crew_;
};

void PullFetch::fetch_group(const std::string& producer, std::vector<FetchSlot*>& group,
                            Deadline deadline) {
  std::vector<BlockLocation> where = consumer_.locate(producer, group, two_step_, deadline);
  // Every block (header + payload) straight into our cache, in one batch.
  std::vector<FetchSlot*> moving;
  std::vector<BlockLocation> moving_where;
  for (size_t i = 0; i < group.size(); ++i) {
    FetchSlot* slot = group[i];
    if (!slot->status.ok()) continue;
    const BlockLocation& loc = where[i];
    if (loc.length != slot->block.block_length) {
      slot->status = InvalidArgument(
          "ec_transfer_params for " + slot->item->mm_hash.str() + ": length " +
          std::to_string(loc.length) + " does not match " + slot->item->meta.to_string() + " (" +
          std::to_string(slot->block.block_length) + " bytes with header)");
      continue;
    }
    moving.push_back(slot);
    moving_where.push_back(loc);
  }
  // Zero-copy where the backend maps the producer's memory; a batched READ otherwise.
  read_through_view(producer, moving, moving_where);
  if (!moving.empty()) read_batched(producer, moving, moving_where, deadline);
  // A grant the producer no longer holds: its pin ended (released, expired), so the block
  // may be gone. That is the "evicted" NACK, not an error of ours.
  for (FetchSlot* slot : group) {
    if (slot->status.code() == StatusCode::kPermissionDenied) {
      slot->status = Status(StatusCode::kEvicted,
                            slot->status.message() + " (the producer no longer grants it)");
    }
  }
}

// Reads through a zero-copy view of the producer's arena where the backend has one (shm:
// same host; our pin keeps the block in place). The blocks it could not view because the
// backend maps nothing (or not that memory) stay in `moving` for a READ; the others leave
// it, done or failed.
void PullFetch::read_through_view(const std::string& producer, std::vector<FetchSlot*>& moving,
                                  std::vector<BlockLocation>& where) {
  std::vector<FetchSlot*> to_read;
  std::vector<BlockLocation> to_read_where;
  std::vector<ViewedBlock> viewed;
  for (size_t k = 0; k < moving.size(); ++k) {
    FetchSlot* slot = moving[k];
    const BlockLocation& loc = where[k];
    auto view = agent()->view(producer, loc.region, loc.offset, loc.length, loc.capability);
    if (!view.ok() && view.status().code() == StatusCode::kFailedPrecondition) {
      to_read.push_back(slot);
      to_read_where.push_back(loc);
      continue;
    }
    if (view.ok()) {
      viewed.push_back({slot, std::move(*view), loc});
    } else {
      slot->status = view.status();
    }
  }
  if (!viewed.empty()) copy_from_views(producer, viewed);
  moving.swap(to_read);
  where.swap(to_read_where);
}

// Copies blocks out of the producer's memory and commits them. Each header is read before
// the payloads and compared after them: the producer clears a block's magic before it can
// be reused (and a reused block gets a new generation), so an unchanged header proves the
// payload copied in between untorn, should our pin have ended meanwhile (lease). The
// payloads' xxh3 is checked besides when the checksum option says so (off by default here:
// nothing crossed a wire); otherwise the payloads are copied by the copy crew, split over
// copy_threads.
void PullFetch::copy_from_views(const std::string& producer, std::vector<ViewedBlock>& blocks) {
  const bool verify = options().verify_checksum(/*crossed=*/false);
  std::vector<std::optional<uint64_t>> sums(blocks.size());
  std::vector<CopyCrew::Range> payloads;
  for (size_t k = 0; k < blocks.size(); ++k) {
    FetchSlot& slot = *blocks[k].slot;
    const std::byte* block = blocks[k].view.data;
    std::memcpy(slot.block.block, block, cache::kBlockHeaderBytes);
    const uint64_t payload = blocks[k].loc.length - cache::kBlockHeaderBytes;
    if (verify) {
      sums[k] = copy_with_checksum(slot.block.payload(), block + cache::kBlockHeaderBytes, payload);
    } else {
      // A large block of our cache is rarely in cache: streaming stores skip reading it.
      payloads.push_back({slot.block.payload(), block + cache::kBlockHeaderBytes, payload});
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the headers' loads before the payloads'
  copy_crew_.copy(payloads);
  std::atomic_thread_fence(std::memory_order_acquire);  // the payloads' loads before these
  for (size_t k = 0; k < blocks.size(); ++k) {
    FetchSlot& slot = *blocks[k].slot;
    const BlockLocation& loc = blocks[k].loc;
    if (std::memcmp(slot.block.block, blocks[k].view.data, cache::kBlockHeaderBytes) != 0) {
      slot.status = Status(StatusCode::kEvicted, "block at " + describe(loc, producer) +
                                                     " was evicted and reused while it was read");
      continue;
    }
    slot.status = core().consumer_cache()->commit_received(
        slot.item->mm_hash, slot.block.generation,
        {slot.item->mm_hash, slot.item->meta, loc.generation, describe(loc, producer), verify},
        sums[k]);
  }
}

// One batched READ of every block. Where the payload is checked, the backend hashes it as
// it lands when it can (tcp): commit_received then compares that digest, with no second
// pass over the payload.
void PullFetch::read_batched(const std::string& producer, const std::vector<FetchSlot*>& moving,
                             const std::vector<BlockLocation>& where, Deadline deadline) {
  const bool verify = options().verify_checksum(/*crossed=*/true);
  std::vector<transfer::TransferDescriptor> descs;
  for (size_t k = 0; k < moving.size(); ++k) {
    const BlockLocation& loc = where[k];
    descs.push_back({moving[k]->block.block, loc.region, loc.offset, loc.length, loc.capability});
    const uint64_t payload = moving[k]->item->meta.byte_size();
    if (verify && loc.length >= cache::kBlockHeaderBytes &&
        payload <= loc.length - cache::kBlockHeaderBytes) {
      descs.back().digest_from = cache::kBlockHeaderBytes;
      descs.back().digest_length = payload;
    }
  }
  auto handle = agent()->read(producer, descs, deadline);
  Status s = handle.ok() ? handle->wait(deadline) : handle.status();
  for (size_t k = 0; k < moving.size(); ++k) {
    FetchSlot* slot = moving[k];
    std::optional<uint64_t> landed_sum;
    if (s.ok() && verify && descs[k].digest_length != 0) landed_sum = handle->digest(k);
    slot->status = s.ok() ? core().consumer_cache()->commit_received(
                                slot->item->mm_hash, slot->block.generation,
                                {slot->item->mm_hash, slot->item->meta, where[k].generation,
                                 describe(where[k], producer), verify},
                                landed_sum)
                          : s;
  }
}

}  // namespace

std::unique_ptr<FetchMode> make_pull(P2pConsumer& consumer, bool two_step) {
  return std::make_unique<PullFetch>(consumer, two_step);
}

}  // namespace ecx::connector
