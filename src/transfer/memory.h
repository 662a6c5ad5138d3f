// Registered memory of one agent: memfd arenas and caller-owned buffers, by region id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/transfer/metadata.h"
#include "ecx/transfer/types.h"
#include "transfer/socket.h"

namespace ecx::transfer {

struct RegionEntry {
  uint32_t id = 0;
  std::byte* data = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  RegionAccess access;
  UniqueFd memfd;             // valid for arenas from allocate()
  bool owns_mapping = false;  // munmap on destruction

  RegionEntry() = default;
  RegionEntry(const RegionEntry&) = delete;
  RegionEntry& operator=(const RegionEntry&) = delete;
  ~RegionEntry();

  RegionInfo info() const;
};

// Creates a zeroed memfd arena of `length` bytes, mapped read-write in this process.
Result<std::shared_ptr<RegionEntry>> create_memfd_region(const std::string& label, uint64_t length);

// Describes a one-sided access for error messages:
// "read 1638400 bytes at offset 96 of region 3 on agent e-0".
std::string describe_access(bool write, uint64_t length, uint64_t offset, uint32_t region,
                            const std::string& agent);

class RegionTable {
 public:
  explicit RegionTable(std::string agent_name) : agent_name_(std::move(agent_name)) {}

  // Assigns the next id and adds the region.
  LocalRegion add(std::shared_ptr<RegionEntry> entry);
  Status remove(uint32_t id);
  std::vector<RegionInfo> list() const;
  std::shared_ptr<RegionEntry> find(uint32_t id) const;
  // Validates a peer's request against the region: exists, access allowed, and
  // [offset, offset + length) inside it (overflow-safe). Returns the region, held.
  Result<std::shared_ptr<RegionEntry>> check_access(uint32_t id, uint64_t offset, uint64_t length,
                                                    bool write) const;

 private:
  const std::string agent_name_;
  mutable std::mutex mu_;
  uint32_t next_id_ = 1;                                      // guarded by mu_
  std::map<uint32_t, std::shared_ptr<RegionEntry>> regions_;  // guarded by mu_
};

}  // namespace ecx::transfer
