#include "ecx/cache/block_header.h"

#include <cstring>

#include "ecx/common/checksum.h"

namespace ecx::cache {

uint64_t block_bytes_for(uint64_t payload_length) {
  uint64_t raw = kBlockHeaderBytes + payload_length;
  return (raw + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;
}

void write_block_header(std::byte* block, const MmHash& mm_hash, const TensorMeta& meta,
                        uint64_t generation, uint64_t checksum) {
  BlockHeader h;
  h.dtype = static_cast<uint8_t>(meta.dtype);
  h.rank = static_cast<uint8_t>(meta.shape.size());
  h.generation = generation;
  h.payload_length = meta.byte_size();
  h.checksum = checksum;
  for (size_t i = 0; i < meta.shape.size() && i < kMaxTensorRank; ++i) h.shape[i] = meta.shape[i];
  h.mm_hash_length =
      static_cast<uint16_t>(std::min<size_t>(mm_hash.str().size(), sizeof(h.mm_hash)));
  std::memcpy(h.mm_hash, mm_hash.str().data(), h.mm_hash_length);
  std::memcpy(block, &h, sizeof(h));
}

BlockHeader read_block_header(const std::byte* block) {
  BlockHeader h;
  std::memcpy(&h, block, sizeof(h));
  return h;
}

Status verify_block(const std::byte* block, uint64_t block_length, const BlockExpectation& e,
                    std::optional<uint64_t> payload_checksum) {
  const std::string& where = e.where;
  if (block_length < kBlockHeaderBytes) {
    return InvalidArgument("block at " + where + " is shorter than its header");
  }
  BlockHeader h = read_block_header(block);
  if (h.magic != kBlockMagic) {
    return Status(StatusCode::kEvicted, "block at " + where + ": no block header (magic " +
                                            std::to_string(h.magic) + "), entry is gone");
  }
  if (h.version != kBlockVersion) {
    return Status(StatusCode::kVersionMismatch, "block at " + where + ": header version " +
                                                    std::to_string(h.version) +
                                                    " != " + std::to_string(kBlockVersion));
  }
  std::string found(h.mm_hash, std::min<size_t>(h.mm_hash_length, sizeof(h.mm_hash)));
  if (found != e.mm_hash.str()) {
    return Status(StatusCode::kEvicted,
                  "block at " + where + " holds mm_hash " + found.substr(0, 16) + ", expected " +
                      e.mm_hash.str().substr(0, 16) + " (evicted and reused)");
  }
  if (e.generation != 0 && h.generation != e.generation) {
    return Status(StatusCode::kEvicted, "block at " + where + ": generation " +
                                            std::to_string(h.generation) + " != expected " +
                                            std::to_string(e.generation) + " (evicted)");
  }
  TensorMeta found_meta;
  auto dtype = dtype_from_wire(h.dtype);
  if (!dtype.ok() || h.rank > kMaxTensorRank) {
    return InvalidArgument("block at " + where + ": corrupt dtype or rank in header");
  }
  found_meta.dtype = *dtype;
  found_meta.shape.assign(h.shape, h.shape + h.rank);
  if (!(found_meta == e.meta)) {
    return InvalidArgument("block at " + where + " is " + found_meta.to_string() + ", expected " +
                           e.meta.to_string());
  }
  if (h.payload_length != e.meta.byte_size() ||
      h.payload_length > block_length - kBlockHeaderBytes) {
    return InvalidArgument("block at " + where + ": payload length " +
                           std::to_string(h.payload_length) + " does not match " +
                           e.meta.to_string());
  }
  if (!e.verify_payload) return Status::Ok();
  uint64_t sum = payload_checksum ? *payload_checksum
                                  : checksum64(block + kBlockHeaderBytes, h.payload_length);
  if (sum != h.checksum) {
    return Status(StatusCode::kDataLoss, "block at " + where + ": payload checksum mismatch");
  }
  return Status::Ok();
}

}  // namespace ecx::cache
