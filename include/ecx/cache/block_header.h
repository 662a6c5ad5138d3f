// BlockHeader: the first 256 bytes of every encoder-cache block. It travels with the
// payload (one READ or WRITE moves header + payload), so the receiver can prove the
// bytes are the entry it asked for and not a reused block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/common/tensor_meta.h"

namespace ecx::cache {

constexpr uint32_t kBlockMagic = 0x42584345;  // "ECXB"
constexpr uint16_t kBlockVersion = 1;
constexpr uint64_t kBlockHeaderBytes = 256;
constexpr uint64_t kBlockAlignment = 64;

struct BlockHeader {
  uint32_t magic = kBlockMagic;
  uint16_t version = kBlockVersion;
  uint8_t dtype = 0;
  uint8_t rank = 0;
  uint64_t generation = 0;
  uint64_t payload_length = 0;
  uint64_t checksum = 0;  // xxh3 of the payload
  int64_t shape[kMaxTensorRank] = {};
  uint16_t mm_hash_length = 0;
  char mm_hash[128] = {};
  char reserved[kBlockHeaderBytes - 4 - 2 - 1 - 1 - 8 * 3 - 8 * kMaxTensorRank - 2 - 128] = {};
};
static_assert(sizeof(BlockHeader) == kBlockHeaderBytes);

// Block bytes for a payload: header + payload, rounded up to kBlockAlignment.
uint64_t block_bytes_for(uint64_t payload_length);

// Writes the header for (mm_hash, meta, generation, checksum) at `block`.
void write_block_header(std::byte* block, const MmHash& mm_hash, const TensorMeta& meta,
                        uint64_t generation, uint64_t checksum);

// What the receiver expects to find in a block.
struct BlockExpectation {
  MmHash mm_hash;
  TensorMeta meta;
  uint64_t generation = 0;  // 0 = any
  std::string where;        // "region 3 offset 4096 on agent e-0", for messages
  // false: the payload is not hashed; the caller proved it otherwise (a same-host read
  // checked before and after its copy, ChecksumPolicy in the connector's options).
  bool verify_payload = true;
};

// Checks a received block (header + payload) against what was asked for: magic and
// version (kInternal), mm_hash and generation (kEvicted: the block was reused), dtype
// and shape (kInvalidArgument), payload checksum (kDataLoss).
// `payload_checksum`, when given, is the payload's checksum already computed by the
// caller (e.g. while copying) and is compared instead of hashing the payload again.
Status verify_block(const std::byte* block, uint64_t block_length, const BlockExpectation& expected,
                    std::optional<uint64_t> payload_checksum = std::nullopt);

// Reads the header of a block without trusting it (bounds-checked copy).
BlockHeader read_block_header(const std::byte* block);

}  // namespace ecx::cache
