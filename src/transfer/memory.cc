#include "transfer/memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "ecx/common/log.h"
#include "ecx/transfer/cuda_memory.h"

namespace ecx::transfer {
namespace {
#ifdef F_SEAL_FUTURE_WRITE
constexpr int kSealFutureWrite = F_SEAL_FUTURE_WRITE;
#else
constexpr int kSealFutureWrite = 0x0010;  // Linux 5.1+
#endif

// Whether a grant's `holder` covers the peer of identity `peer` ("name#session"): an
// identity matches only itself; a bare name (no '#') any process that declares it.
bool held_by(const std::string& holder, const std::string& peer) {
  if (holder.empty() || holder == peer) return true;
  return holder.find('#') == std::string::npos && peer.size() > holder.size() &&
         peer.compare(0, holder.size(), holder) == 0 && peer[holder.size()] == '#';
}
}  // namespace

Status check_received_memfd(int fd, uint64_t length, const std::string& what) {
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) return PermissionDenied(what + ": shared memory is not a sealable memfd");
  const int required = F_SEAL_SHRINK | F_SEAL_SEAL;
  if ((seals & required) != required || (seals & (kSealFutureWrite | F_SEAL_WRITE)) == 0) {
    return PermissionDenied(what +
                            ": shared memory is not sealed against shrinking and writing "
                            "(seals 0x" +
                            std::to_string(seals) + "); refusing to map it");
  }
  // Never trust the announced length: a mapping past the end of the file would SIGBUS.
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < length) {
    return PermissionDenied(what + ": shared memory is smaller than its announced " +
                            std::to_string(length) + " bytes");
  }
  return Status::Ok();
}

Status check_memory_kind(const void* data, uint64_t length, MemoryKind kind) {
  // Host memory is taken as it is (asking CUDA would start its driver in every process).
  if (kind == MemoryKind::kCuda) return cuda::check_device_range(data, length);
  return Status::Ok();
}

RegionEntry::~RegionEntry() {
  backends.clear();  // unregistered before the memory goes
  if (owns_mapping && data != nullptr && length > 0) ::munmap(data, length);
}

RegionInfo RegionEntry::info() const {
  RegionInfo info{id, length, kind, access.remote_write, memfd.valid()};
  // A region behind grants hands its data out only for a capability (REGION_QUERY).
  if (!access.require_grant) {
    for (const auto& [backend, r] : backends) {
      if (!r.data.empty()) info.backend_data.emplace(backend, r.data);
    }
  }
  return info;
}

namespace {

// Writes each page of [data, data + length) once, keeping its bytes. The kernel's populate
// only reads a shared mapping's pages in (MADV_POPULATE_WRITE too writes nothing to them),
// and a hypervisor that backs its guest's memory lazily (free page reporting, a balloon:
// this machine's) traps the first write to each page: ~0.4 us a 4 KiB page here, 100 us per
// MiB of the first loads into a new arena, at the time of a copy (docs/results/HISTORY.md §20).
void touch_pages(std::byte* data, uint64_t length) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  for (uint64_t at = 0; at < length; at += page) {
    auto* byte = reinterpret_cast<volatile unsigned char*>(data + at);
    *byte = *byte;
  }
}

}  // namespace

Result<std::shared_ptr<RegionEntry>> create_memfd_region(const std::string& label,
                                                         uint64_t length) {
  if (length == 0) return InvalidArgument("cannot allocate a region of 0 bytes");
  UniqueFd fd(::memfd_create(("ecx:" + label).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoError("memfd_create for " + label, errno);
  if (::ftruncate(fd.get(), static_cast<off_t>(length)) != 0) {
    return ErrnoError("ftruncate memfd to " + std::to_string(length) + " bytes", errno);
  }
  // Populated now: page faults on the transfer path would cost more than the copy.
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoError("mmap " + std::to_string(length) + " bytes", errno);
  touch_pages(static_cast<std::byte*>(p), length);
  // Peers map it: its size must never change under them (a shrink would SIGBUS them),
  // and no one may map it writable from now on (this process keeps its mapping). A
  // reopened /proc/self/fd/N is sealed too: the seals belong to the file, not the fd.
  if (::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | kSealFutureWrite | F_SEAL_SEAL) != 0) {
    int err = errno;
    ::munmap(p, length);
    return ErrnoError("seal memfd of " + label, err);
  }
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

Status check_announced_regions(std::span<const TransferDescriptor> descriptors,
                               const std::vector<RegionInfo>& regions, bool write,
                               const std::string& peer, Backend backend) {
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    for (const auto& r : regions) {
      if (r.id != d.remote_region) continue;
      auto what = [&] {
        return "descriptor " + std::to_string(i) + ": " +
               describe_access(write, d.length, d.remote_offset, d.remote_region, peer);
      };
      if (d.remote_offset > r.length || d.length > r.length - d.remote_offset) {
        return OutOfRange(what() + ": outside the region's " + std::to_string(r.length) + " bytes");
      }
      if (write && !r.remote_write) {
        return Status(StatusCode::kFailedPrecondition,
                      what() + ": region is not remotely writable");
      }
      if (r.kind == MemoryKind::kCuda && backend != Backend::kUcx) {
        return Status(StatusCode::kFailedPrecondition,
                      what() + ": region is CUDA memory, reached only over ucx (connected over " +
                          std::string(backend_name(backend)) + ")");
      }
    }
  }
  return Status::Ok();
}

LocalRegion RegionTable::add(std::shared_ptr<RegionEntry> entry) {
  MutexLock lock(&mu_);
  entry->id = next_id_++;
  if (entry->kind == MemoryKind::kCuda) cuda_regions_++;
  LocalRegion out{entry->id, entry->data, entry->length};
  regions_.emplace(entry->id, std::move(entry));
  return out;
}

Status RegionTable::remove(uint32_t id) {
  MutexLock lock(&mu_);
  std::vector<Capability> ended;
  for (auto g = grants_.begin(); g != grants_.end();) {
    if (g->second.region == id) {
      ended.push_back(g->first);
      g = grants_.erase(g);
    } else {
      ++g;
    }
  }
  for (const auto& capability : ended) end_writes_locked(capability);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return NotFound("region " + std::to_string(id) + " is not registered on agent " + agent_name_);
  }
  if (it->second->kind == MemoryKind::kCuda) cuda_regions_--;
  regions_.erase(it);
  return Status::Ok();
}

Status RegionTable::check_host_buffers(std::span<const TransferDescriptor> descriptors, bool write,
                                       Backend backend) const {
  if (backend == Backend::kUcx) return Status::Ok();
  MutexLock lock(&mu_);
  if (cuda_regions_ == 0) return Status::Ok();
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto* begin = static_cast<const std::byte*>(descriptors[i].local);
    const uint64_t length = descriptors[i].length;
    for (const auto& [id, entry] : regions_) {
      if (entry->kind != MemoryKind::kCuda) continue;
      const std::byte* end = entry->data + entry->length;
      if (begin < end && entry->data < begin + length) {
        return Status(StatusCode::kFailedPrecondition,
                      std::string(write ? "write" : "read") + ": descriptor " + std::to_string(i) +
                          "'s local buffer is in CUDA region " + std::to_string(id) + " of agent " +
                          agent_name_ + ", which " + std::string(backend_name(backend)) +
                          " cannot reach (CUDA memory moves over ucx only)");
      }
    }
  }
  return Status::Ok();
}

std::vector<RegionInfo> RegionTable::list() const {
  MutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  out.reserve(regions_.size());
  for (const auto& [id, entry] : regions_) out.push_back(entry->info());
  return out;
}

std::shared_ptr<RegionEntry> RegionTable::find(uint32_t id) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<RegionEntry>> RegionTable::check_access(uint32_t id, uint64_t offset,
                                                               uint64_t length, bool write,
                                                               const std::string& peer,
                                                               const Capability& capability) const {
  MutexLock lock(&mu_);
  return check_access_locked(id, offset, length, write, peer, capability);
}

Result<std::shared_ptr<RegionEntry>> RegionTable::begin_write(uint32_t id, uint64_t offset,
                                                              uint64_t length,
                                                              const std::string& peer,
                                                              const Capability& capability,
                                                              int fd) {
  MutexLock lock(&mu_);
  ECX_ASSIGN_OR_RETURN(auto entry,
                       check_access_locked(id, offset, length, /*write=*/true, peer, capability));
  if (entry->access.require_grant) writes_[capability].insert(fd);
  return entry;
}

void RegionTable::end_write(const Capability& capability, int fd) {
  {
    MutexLock lock(&mu_);
    auto it = writes_.find(capability);
    if (it == writes_.end()) return;
    it->second.erase(fd);
    if (it->second.empty()) writes_.erase(it);
  }
  write_ended_.notify_all();
}

Result<std::shared_ptr<RegionEntry>> RegionTable::check_access_locked(
    uint32_t id, uint64_t offset, uint64_t length, bool write, const std::string& peer,
    const Capability& capability) const {
  std::string what = describe_access(write, length, offset, id, agent_name_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return NotFound(what + ": no such region");
  std::shared_ptr<RegionEntry> entry = it->second;
  // Served here means copied by the CPU (tcp, shm's write stream): never device memory.
  if (entry->kind == MemoryKind::kCuda) {
    return Status(StatusCode::kFailedPrecondition,
                  what + ": region is CUDA memory, reached only over ucx");
  }
  if (entry->access.require_grant) {
    ECX_RETURN_IF_ERROR(check_grant_locked(id, offset, length, write, peer, capability, what));
  }
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

Status RegionTable::check_grant_locked(uint32_t id, uint64_t offset, uint64_t length, bool write,
                                       const std::string& peer, const Capability& capability,
                                       const std::string& what) const {
  // One message for every refusal: a prober learns nothing about which tokens exist.
  Status denied = PermissionDenied(what + ": no grant of agent " + agent_name_ +
                                   " covers it for agent '" + peer + "'");
  if (capability.empty()) return denied;
  auto it = grants_.find(capability);
  if (it == grants_.end()) return denied;
  const Grant& g = it->second;
  if (g.region != id || (write && !g.write) || !held_by(g.holder, peer)) {
    return denied;
  }
  if (offset < g.offset || length > g.length || offset - g.offset > g.length - length) {
    return denied;
  }
  return Status::Ok();
}

Status RegionTable::check_region_grant(uint32_t id, const std::string& peer,
                                       const Capability& capability) const {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return NotFound("region " + std::to_string(id) + " on agent " + agent_name_ +
                    ": no such region");
  }
  if (!it->second->access.require_grant) return Status::Ok();
  auto g = grants_.find(capability);
  if (capability.empty() || g == grants_.end() || g->second.region != id ||
      !held_by(g->second.holder, peer)) {
    return PermissionDenied("map region " + std::to_string(id) + " of agent " + agent_name_ +
                            ": agent '" + peer + "' holds no grant in it");
  }
  return Status::Ok();
}

Result<Capability> RegionTable::grant(uint32_t id, uint64_t offset, uint64_t length, bool write,
                                      const std::string& holder) {
  MutexLock lock(&mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return NotFound("grant on region " + std::to_string(id) + " of agent " + agent_name_ +
                    ": no such region");
  }
  if (offset > it->second->length || length > it->second->length - offset) {
    return OutOfRange("grant of " + std::to_string(length) + " bytes at offset " +
                      std::to_string(offset) + " outside region " + std::to_string(id));
  }
  Capability cap = Capability::random();
  grants_.emplace(cap, Grant{id, offset, length, write, holder});
  return cap;
}

void RegionTable::revoke(const Capability& capability) {
  MutexLock lock(&mu_);
  grants_.erase(capability);
  end_writes_locked(capability);
}

void RegionTable::end_writes_locked(const Capability& capability) {
  auto in_flight = writes_.find(capability);
  if (in_flight == writes_.end()) return;
  // Their streams are cut, so each server thread leaves its recv at once and ends its
  // write; the bound only guards against a bug there.
  for (int fd : in_flight->second) ::shutdown(fd, SHUT_RDWR);
  if (!write_ended_.wait_for(&mu_, std::chrono::seconds(10),
                             [&]() ECX_REQUIRES(mu_) { return writes_.count(capability) == 0; })) {
    spdlog::error("agent {}: a WRITE on a revoked grant did not end within 10 s", agent_name_);
  }
}

size_t RegionTable::grant_count() const {
  MutexLock lock(&mu_);
  return grants_.size();
}

}  // namespace ecx::transfer
