// Registered memory of one agent: memfd arenas and caller-owned buffers, by region id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/common/status.h"
#include "ecx/transfer/metadata.h"
#include "ecx/transfer/types.h"
#include "wire/socket.h"

namespace ecx::transfer {

struct RegionEntry {
  uint32_t id = 0;
  std::byte* data = nullptr;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  RegionAccess access;
  UniqueFd memfd;             // valid for arenas from allocate()
  bool owns_mapping = false;  // munmap on destruction
  // What each backend that registered this memory keeps of it (BackendEngine::
  // register_region): its registration, released before the memory is, and the opaque
  // data a peer needs to reach the region over it (RegionInfo::backend_data).
  struct BackendRegistration {
    std::shared_ptr<void> handle;
    std::string data;
  };
  std::map<Backend, BackendRegistration> backends;

  RegionEntry() = default;
  RegionEntry(const RegionEntry&) = delete;
  RegionEntry& operator=(const RegionEntry&) = delete;
  ~RegionEntry();

  RegionInfo info() const;
};

// Creates a zeroed memfd arena of `length` bytes, mapped read-write in this process, then
// sealed so that nobody can map it writable again, nor resize it (F_SEAL_FUTURE_WRITE,
// SHRINK, GROW, SEAL): the fd can be handed to peers, who can only read.
Result<std::shared_ptr<RegionEntry>> create_memfd_region(const std::string& label, uint64_t length);

// The seals a receiver requires before it maps a peer's memfd: nobody can shrink it (no
// SIGBUS) and nobody else can write through a new mapping.
Status check_received_memfd(int fd, uint64_t length, const std::string& what);

// Checks that [data, data + length) is memory of `kind`: host memory, or (in a build
// with CUDA) device memory of this process's CUDA context.
Status check_memory_kind(const void* data, uint64_t length, MemoryKind kind);

// Describes a one-sided access for error messages:
// "read 1638400 bytes at offset 96 of region 3 on agent e-0".
std::string describe_access(bool write, uint64_t length, uint64_t offset, uint32_t region,
                            const std::string& agent);

// Checks a batch against the regions agent `peer` announced, before any byte moves: a
// descriptor naming an announced region lies inside it, for a write that region is
// remotely writable, and CUDA regions are reached over ucx only (`backend`). (The peer
// re-checks each request, and alone checks regions it added after announcing these.)
Status check_announced_regions(std::span<const TransferDescriptor> descriptors,
                               const std::vector<RegionInfo>& regions, bool write,
                               const std::string& peer, Backend backend);

class RegionTable {
 public:
  explicit RegionTable(std::string agent_name) : agent_name_(std::move(agent_name)) {}

  // Assigns the next id and adds the region.
  LocalRegion add(std::shared_ptr<RegionEntry> entry) ECX_EXCLUDES(mu_);
  Status remove(uint32_t id) ECX_EXCLUDES(mu_);
  std::vector<RegionInfo> list() const ECX_EXCLUDES(mu_);
  std::shared_ptr<RegionEntry> find(uint32_t id) const ECX_EXCLUDES(mu_);
  // Validates a peer's request against the region: exists, access allowed, and
  // [offset, offset + length) inside it (overflow-safe); for a region that requires
  // grants, `capability` must be a grant of that region covering the range, for `peer`
  // (or any peer); a CUDA region is refused (the caller copies with the CPU). Returns
  // the region, held.
  Result<std::shared_ptr<RegionEntry>> check_access(uint32_t id, uint64_t offset, uint64_t length,
                                                    bool write, const std::string& peer = {},
                                                    const Capability& capability = {}) const
      ECX_EXCLUDES(mu_);
  // check_access for a WRITE whose data arrives on `fd`: when it passes under a grant,
  // the write is registered in flight on that grant (in the same lock) until end_write.
  // revoke() of the grant shuts `fd` down and waits for end_write, so no byte of the
  // write lands in the window after revoke() returns.
  Result<std::shared_ptr<RegionEntry>> begin_write(uint32_t id, uint64_t offset, uint64_t length,
                                                   const std::string& peer,
                                                   const Capability& capability, int fd)
      ECX_EXCLUDES(mu_);
  void end_write(const Capability& capability, int fd) ECX_EXCLUDES(mu_);
  // Over shm and tcp the CPU copies the bytes: no local buffer of a batch may lie in a
  // CUDA region of this agent (kFailedPrecondition naming the descriptor and region).
  Status check_host_buffers(std::span<const TransferDescriptor> descriptors, bool write,
                            Backend backend) const ECX_EXCLUDES(mu_);
  // Whether `peer` may have the region's memfd: the region needs no grant, or
  // `capability` is a grant of `peer` (or of any peer) in it.
  Status check_region_grant(uint32_t id, const std::string& peer,
                            const Capability& capability) const ECX_EXCLUDES(mu_);

  // `holder`: a peer identity ("name#session": that process only), a bare agent name
  // (any process that declares it) or empty (any authenticated peer).
  Result<Capability> grant(uint32_t id, uint64_t offset, uint64_t length, bool write,
                           const std::string& holder) ECX_EXCLUDES(mu_);
  // Ends the grant; WRITEs in flight on it are aborted and waited for (begin_write).
  void revoke(const Capability& capability) ECX_EXCLUDES(mu_);
  size_t grant_count() const ECX_EXCLUDES(mu_);

 private:
  struct Grant {
    uint32_t region = 0;
    uint64_t offset = 0;
    uint64_t length = 0;
    bool write = false;
    std::string holder;  // empty: any authenticated peer
  };
  Status check_grant_locked(uint32_t id, uint64_t offset, uint64_t length, bool write,
                            const std::string& peer, const Capability& capability,
                            const std::string& what) const ECX_REQUIRES(mu_);
  // Cuts the WRITEs in flight on `capability` and waits (releasing mu_) until they end.
  void end_writes_locked(const Capability& capability) ECX_REQUIRES(mu_);
  Result<std::shared_ptr<RegionEntry>> check_access_locked(uint32_t id, uint64_t offset,
                                                           uint64_t length, bool write,
                                                           const std::string& peer,
                                                           const Capability& capability) const
      ECX_REQUIRES(mu_);

  const std::string agent_name_;
  mutable Mutex mu_;
  uint32_t next_id_ ECX_GUARDED_BY(mu_) = 1;
  std::map<uint32_t, std::shared_ptr<RegionEntry>> regions_ ECX_GUARDED_BY(mu_);
  size_t cuda_regions_ ECX_GUARDED_BY(mu_) = 0;
  std::map<Capability, Grant> grants_ ECX_GUARDED_BY(mu_);
  std::map<Capability, std::set<int>> writes_ ECX_GUARDED_BY(mu_);  // fds in flight
  CondVar write_ended_;                                             // a write left writes_
};

}  // namespace ecx::transfer
