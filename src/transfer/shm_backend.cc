#include "transfer/shm_backend.h"

#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "transfer/memory.h"

namespace ecx::transfer {

namespace {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

// Granule of ShmDataPath::Mapping::populate.
constexpr uint64_t kPopulateChunk = 2ull << 20;
// What one madvise of Mapping::populate_all covers: 16 pages, ~6 us here. A whole chunk
// per call held the address space's lock ~190 us at a time, and every mmap or munmap of
// the process (a large allocation, a new thread's stack) waited for it.
constexpr uint64_t kBackgroundStep = 64ull << 10;

}  // namespace

ShmDataPath::Mapping::~Mapping() {
  if (data != nullptr) ::munmap(data, length);
}

void ShmDataPath::Mapping::populate(uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return;
  for (uint64_t chunk = offset / kPopulateChunk; chunk <= (offset + bytes - 1) / kPopulateChunk;
       ++chunk) {
    if (filled(chunk)) continue;
    const uint64_t start = chunk * kPopulateChunk;
    // Best effort: on a kernel without MADV_POPULATE_READ the pages fault in as read.
    ::madvise(data + start, std::min(kPopulateChunk, length - start), MADV_POPULATE_READ);
    mark_filled(chunk);
  }
}

void ShmDataPath::Mapping::populate_all(const std::atomic<bool>& stop) {
  for (uint64_t start = 0; start < length; start += kPopulateChunk) {
    const uint64_t chunk = start / kPopulateChunk;
    if (filled(chunk)) continue;  // a load's, already
    const uint64_t end = std::min(start + kPopulateChunk, length);
    for (uint64_t at = start; at < end; at += kBackgroundStep) {
      if (stop.load(std::memory_order_relaxed)) return;
      ::madvise(data + at, std::min(kBackgroundStep, end - at), MADV_POPULATE_READ);
      // Gives way to a thread waiting for this core. Run without a break, the filler
      // kept a vCPU for 1-3 ms while a thread woken there waited and the other vCPU
      // idled (perf sched): a 64 KiB zero-copy load, whose lookup is a round trip between
      // two processes, took that long in the first loads after a connect (BENCHMARKS.md
      // §21). SCHED_IDLE for the filler did not prevent it.
      ::sched_yield();
    }
    mark_filled(chunk);
  }
}

ShmDataPath::~ShmDataPath() {
  closing_ = true;
  std::thread filler;
  {
    MutexLock lock(&mu_);
    filler.swap(filler_);
  }
  if (filler.joinable()) filler.join();
}

void ShmDataPath::fill_in_background(const std::vector<std::shared_ptr<Mapping>>& maps) {
  for (const auto& m : maps) {
    if (m->queued.load(std::memory_order_relaxed) || m->queued.exchange(true)) continue;
    MutexLock lock(&mu_);
    if (closing_) return;
    to_fill_.push_back(m);
    if (filler_running_) continue;
    if (filler_.joinable()) filler_.join();  // it found nothing left and has ended
    try {
      filler_ = std::thread([this] { fill_queued(); });
      filler_running_ = true;
    } catch (const std::system_error&) {
      // No thread to be had (a process at its limit): loads fill their own chunks, as
      // without a filler, and the next new mapping tries again.
      to_fill_.clear();
    }
  }
}

void ShmDataPath::fill_queued() {
  while (true) {
    std::shared_ptr<Mapping> m;
    {
      MutexLock lock(&mu_);
      if (to_fill_.empty() || closing_) {
        filler_running_ = false;
        return;
      }
      m = std::move(to_fill_.front());
      to_fill_.pop_front();
    }
    m->populate_all(closing_);
  }
}

Result<std::shared_ptr<ShmDataPath::Mapping>> ShmDataPath::mapping(uint32_t region,
                                                                   const Capability& capability,
                                                                   Deadline deadline) {
  {
    MutexLock lock(&mu_);
    auto it = mappings_.find(region);
    if (it != mappings_.end()) return it->second;
  }
  ECX_ASSIGN_OR_RETURN(RegionGrant grant, control_->query_region(region, capability, deadline));
  const std::string& peer = control_->peer().name;
  if (!grant.memfd.valid()) {
    return Status(StatusCode::kFailedPrecondition,
                  "region " + std::to_string(region) + " on agent " + peer +
                      " is not a shared-memory arena; use the tcp backend for it");
  }
  // Sealed against shrinking (no SIGBUS, ever) and against writers, and as long as it
  // says: otherwise it is not mapped at all.
  ECX_RETURN_IF_ERROR(check_received_memfd(
      grant.memfd.get(), grant.length, "region " + std::to_string(region) + " of agent " + peer));
  // Read-only, always. Not populated here: a peer's arena can be gigabytes, and populating
  // it all would stall the first load after a connect. Each read populates the 2 MiB
  // chunks it touches, once (Mapping::populate); after the first, a thread populates the
  // rest (fill_in_background). Each 4 KiB page costs ~0.4 us here, which the first loads
  // into the peer's fresh blocks would otherwise pay (docs/results/HISTORY.md §20).
  void* p = ::mmap(nullptr, grant.length, PROT_READ, MAP_SHARED, grant.memfd.get(), 0);
  if (p == MAP_FAILED) {
    return ErrnoError("map region " + std::to_string(region) + " of agent " + peer, errno);
  }
  auto m = std::make_shared<Mapping>();
  m->data = static_cast<std::byte*>(p);
  m->length = grant.length;
  m->readable = grant.remote_read;
  m->populated = std::make_unique<std::atomic<uint64_t>[]>(
      (grant.length + 64 * kPopulateChunk - 1) / (64 * kPopulateChunk));
  MutexLock lock(&mu_);
  auto [it, inserted] = mappings_.emplace(region, m);
  return it->second;  // a concurrent mapper may have won; both views are equivalent
}

Result<std::vector<std::shared_ptr<ShmDataPath::Mapping>>> ShmDataPath::resolve(
    std::span<const TransferDescriptor> descriptors, Deadline deadline) {
  const bool write = false;
  const std::string& peer = control_->peer().name;
  std::vector<std::shared_ptr<Mapping>> maps;
  maps.reserve(descriptors.size());
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    std::string what = "descriptor " + std::to_string(i) + ": " +
                       describe_access(write, d.length, d.remote_offset, d.remote_region, peer);
    auto m = mapping(d.remote_region, d.capability, deadline);
    if (!m.ok()) return m.status().with_context(what);  // counted by the owner if refused
    if (d.remote_offset > (*m)->length || d.length > (*m)->length - d.remote_offset) {
      stats_->rejected_descriptors++;
      return OutOfRange(what + ": outside the region's " + std::to_string((*m)->length) + " bytes");
    }
    if (!(*m)->readable) {
      stats_->rejected_descriptors++;
      return Status(StatusCode::kFailedPrecondition, what + ": region is not remotely readable");
    }
    (*m)->populate(d.remote_offset, d.length);
    maps.push_back(std::move(*m));
  }
  return maps;
}

Status ShmDataPath::read(std::span<const TransferDescriptor> descriptors, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(auto maps, resolve(descriptors, deadline));
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    std::memcpy(d.local, maps[i]->data + d.remote_offset, d.length);
  }
  // The mapping outlives a dead peer, but a read that overlapped its death is not trusted.
  if (!control_->alive_now()) return control_->death_status();
  fill_in_background(maps);
  return Status::Ok();
}

std::shared_ptr<TransferState> ShmDataPath::submit(std::span<const TransferDescriptor> descriptors,
                                                   bool write, Deadline deadline,
                                                   std::string description,
                                                   TransferFinalizer finalizer) {
  if (write) {
    return writes_->submit(descriptors, write, deadline, std::move(description),
                           std::move(finalizer));
  }
  auto state = std::make_shared<TransferState>(description, 1);
  state->set_finalizer(std::move(finalizer));
  state->part_done(read(descriptors, deadline).with_context(description));
  return state;
}

Result<RemoteView> ShmDataPath::view(uint32_t region, uint64_t offset, uint64_t length,
                                     const Capability& capability, Deadline deadline) {
  TransferDescriptor d{nullptr, region, offset, length, capability};
  ECX_ASSIGN_OR_RETURN(auto maps, resolve({&d, 1}, deadline));
  RemoteView v;
  v.data = maps[0]->data + offset;
  v.length = length;
  v.keepalive = maps[0];
  if (control_->alive_now()) fill_in_background(maps);  // a dead peer's arena: never
  return v;
}

namespace {

class ShmEngine final : public BackendEngine {
 public:
  explicit ShmEngine(const AgentConfig& config) : config_(config) {}
  Backend kind() const override { return Backend::kShm; }
  bool reaches(const AgentMetadata& peer, bool same_host) const override {
    return same_host && !peer.endpoint(Backend::kShm).empty();
  }
  // Same host only: the region's memfd comes over the unix socket.
  Result<ControlSocket> dial_control(const AgentMetadata& peer, bool, Deadline d) const override {
    return dial_unix_control(peer, d);
  }
  // Mappings come from REGION_QUERY's memfd; WRITEs go over a unix stream.
  void add_services(FrameServices& services, const ServeContext& context) override {
    add_region_query_service(services, context);
    add_stream_service(services, context);
  }
  Result<std::shared_ptr<DataPath>> open(PeerLink link, Deadline) override {
    std::string endpoint = link.peer.endpoint(Backend::kShm);
    auto writes = std::make_shared<TcpDataPool>(
        config_, link.self, link.peer, [endpoint](Deadline d) { return connect_unix(endpoint, d); },
        "unix @" + endpoint, 1);
    return std::shared_ptr<DataPath>(
        std::make_shared<ShmDataPath>(std::move(link.control), link.stats, std::move(writes)));
  }

 private:
  const AgentConfig& config_;
};

}  // namespace

std::unique_ptr<BackendEngine> make_shm_engine(const AgentConfig& config) {
  return std::make_unique<ShmEngine>(config);
}

}  // namespace ecx::transfer
