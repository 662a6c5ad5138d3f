// ReadDigests: the checksums a READ batch asked for (TransferDescriptor::digest_length),
// computed by a stream backend's workers as the bytes land, while they are still in
// cache, instead of in a second pass over memory once the batch is done. Each
// descriptor's range is hashed in order by whichever worker holds the piece that comes
// next; a piece that lands early (a descriptor cut across two streams) waits, and the
// worker that lands the piece before it hashes it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "ecx/common/checksum.h"
#include "ecx/common/mutex.h"
#include "ecx/transfer/types.h"
#include "transfer/transfer_state.h"

namespace ecx::transfer {

class ReadDigests {
 public:
  // nullptr when no descriptor asks for a digest.
  static std::shared_ptr<ReadDigests> for_batch(std::span<const TransferDescriptor> descriptors);
  explicit ReadDigests(std::span<const TransferDescriptor> descriptors);

  // Whether descriptor k asked for a digest.
  bool wants(size_t k) const { return k < streams_.size() && streams_[k] != nullptr; }
  // Bytes [at, at + length) of descriptor k (offsets within it) landed. Records k's digest
  // in `state` once its whole range is hashed; call before the part that landed them is
  // done, so that the digest is there when the transfer completes.
  void landed(size_t k, uint64_t at, uint64_t length, TransferState& state) ECX_EXCLUDES(mu_);

 private:
  struct Range {
    const std::byte* base = nullptr;
    uint64_t end = 0;                    // of the range, within the descriptor
    uint64_t next = 0;                   // hashed up to here
    std::map<uint64_t, uint64_t> early;  // landed, not yet hashed: offset -> length
    bool busy = false;                   // a worker is hashing it (and owns its stream)
  };
  // Takes the next piece of range k in order, or ends the caller's turn (busy = false).
  bool next_piece(size_t k, uint64_t& at, uint64_t& length) ECX_EXCLUDES(mu_);

  Mutex mu_;
  std::vector<Range> ranges_ ECX_GUARDED_BY(mu_);
  // Used only by the worker whose turn it is (Range::busy): no lock.
  std::vector<std::unique_ptr<ChecksumStream>> streams_;
};

}  // namespace ecx::transfer
