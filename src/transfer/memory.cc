#include "transfer/memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace ecx::transfer {

RegionEntry::~RegionEntry() {
  if (owns_mapping && data != nullptr && length > 0) ::munmap(data, length);
}

RegionInfo RegionEntry::info() const {
  return RegionInfo{id, length, kind, access.remote_write, memfd.valid()};
}

Result<std::shared_ptr<RegionEntry>> create_memfd_region(const std::string& label,
                                                         uint64_t length) {
  if (length == 0) return InvalidArgument("cannot allocate a region of 0 bytes");
  UniqueFd fd(::memfd_create(("ecx:" + label).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoError("memfd_create for " + label, errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(length)) != 0) {
    return ErrnoError("ftruncate memfd to " + std::to_string(length) + " bytes", errno);
  }
  // Peers map it: its size must never change under them (a shrink would SIGBUS them).
  ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // Populated now: page faults on the transfer path would cost more than the copy.
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoError("mmap " + std::to_string(length) + " bytes", errno);
  auto entry = std::make_shared<RegionEntry>();
  entry->data = static_cast<std::byte*>(p);
  entry->length = length;
  entry->memfd = std::move(fd);
  entry->owns_mapping = true;
  return entry;
}

std::string describe_access(bool write, uint64_t length, uint64_t offset, uint32_t region,
                            const std::string& agent) {
  return std::string(write ? "write " : "read ") + std::to_string(length) + " bytes at offset " +
         std::to_string(offset) + " of region " + std::to_string(region) + " on agent " + agent;
}

LocalRegion RegionTable::add(std::shared_ptr<RegionEntry> entry) {
  std::lock_guard lock(mu_);
  entry->id = next_id_++;
  LocalRegion out{entry->id, entry->data, entry->length};
  regions_.emplace(entry->id, std::move(entry));
  return out;
}

Status RegionTable::remove(uint32_t id) {
  std::lock_guard lock(mu_);
  if (regions_.erase(id) == 0) {
    return NotFound("region " + std::to_string(id) + " is not registered on agent " + agent_name_);
  }
  return Status::Ok();
}

std::vector<RegionInfo> RegionTable::list() const {
  std::lock_guard lock(mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (const auto& [id, entry] : regions_) out.push_back(entry->info());
  return out;
}

std::shared_ptr<RegionEntry> RegionTable::find(uint32_t id) const {
  std::lock_guard lock(mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<RegionEntry>> RegionTable::check_access(uint32_t id, uint64_t offset,
                                                               uint64_t length, bool write) const {
  auto entry = find(id);
  std::string what = describe_access(write, length, offset, id, agent_name_);
  if (!entry) return NotFound(what + ": no such region");
  if (write && !entry->access.remote_write) {
    return Status(StatusCode::kFailedPrecondition, what + ": region is not remotely writable");
  }
  if (!write && !entry->access.remote_read) {
    return Status(StatusCode::kFailedPrecondition, what + ": region is not remotely readable");
  }
  if (offset > entry->length || length > entry->length - offset) {
    return OutOfRange(what + ": outside the region's " + std::to_string(entry->length) + " bytes");
  }
  return entry;
}

}  // namespace ecx::transfer
