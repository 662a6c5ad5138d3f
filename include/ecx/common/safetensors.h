// Safetensors files: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the data. Used for encoder-cache files
// (the disk connector, same layout as vLLM's example connector) and model weights.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/common/tensor_meta.h"

namespace ecx {

struct SafetensorsEntry {
  std::string name;
  TensorMeta meta;
  uint64_t begin = 0;  // byte range inside the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_offset = 0;                     // file offset of the data section

  const SafetensorsEntry* find(const std::string& name) const;
};

struct SafetensorsTensor {
  std::string name;
  TensorMeta meta;
  std::span<const std::byte> data;  // meta.byte_size() bytes
};

// Writes a complete file at `path` (truncating it).
Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                         const std::map<std::string, std::string>& metadata);
// Reads and validates the header of an open file of `file_size` bytes: header length
// bounds, JSON shape, dtypes, shapes matching byte ranges, ranges inside the file.
Result<SafetensorsHeader> read_safetensors_header(int fd, uint64_t file_size);
// Reads `entry`'s bytes into `out` (exactly entry.end - entry.begin bytes).
Status read_safetensors_tensor(int fd, const SafetensorsHeader& header,
                               const SafetensorsEntry& entry, std::span<std::byte> out);

}  // namespace ecx
