#include "transfer/read_digests.h"

#include <algorithm>

namespace ecx::transfer {

std::shared_ptr<ReadDigests> ReadDigests::for_batch(
    std::span<const TransferDescriptor> descriptors) {
  bool any = std::any_of(descriptors.begin(), descriptors.end(),
                         [](const TransferDescriptor& d) { return d.digest_length != 0; });
  return any ? std::make_shared<ReadDigests>(descriptors) : nullptr;
}

ReadDigests::ReadDigests(std::span<const TransferDescriptor> descriptors)
    : ranges_(descriptors.size()), streams_(descriptors.size()) {
  for (size_t k = 0; k < descriptors.size(); ++k) {
    const TransferDescriptor& d = descriptors[k];
    if (d.digest_length == 0) continue;
    Range& r = ranges_[k];
    r.base = static_cast<const std::byte*>(d.local);
    r.next = d.digest_from;
    r.end = d.digest_from + d.digest_length;
    streams_[k] = std::make_unique<ChecksumStream>();
  }
}

void ReadDigests::landed(size_t k, uint64_t at, uint64_t length, TransferState& state) {
  if (!wants(k)) return;
  {
    MutexLock lock(&mu_);
    Range& r = ranges_[k];
    uint64_t lo = std::max(at, r.next);
    uint64_t hi = std::min(at + length, r.end);
    if (lo >= hi) return;  // outside the range (a block's header)
    r.early[lo] = hi - lo;
    if (r.busy) return;  // the worker hashing it takes this piece in its turn
    r.busy = true;
  }
  const std::byte* base = nullptr;
  uint64_t piece_at = 0;
  uint64_t piece_length = 0;
  while (next_piece(k, piece_at, piece_length)) {
    {
      MutexLock lock(&mu_);
      base = ranges_[k].base;
    }
    streams_[k]->update(base + piece_at, piece_length);
    bool complete = false;
    {
      MutexLock lock(&mu_);
      Range& r = ranges_[k];
      r.next = piece_at + piece_length;
      complete = r.next == r.end;
      if (complete) r.busy = false;
    }
    if (complete) {
      state.record_digest(k, streams_[k]->digest());
      return;
    }
  }
}

bool ReadDigests::next_piece(size_t k, uint64_t& at, uint64_t& length) {
  MutexLock lock(&mu_);
  Range& r = ranges_[k];
  auto it = r.early.begin();
  if (it == r.early.end() || it->first != r.next) {
    r.busy = false;
    return false;
  }
  at = it->first;
  length = it->second;
  r.early.erase(it);
  return true;
}

}  // namespace ecx::transfer
