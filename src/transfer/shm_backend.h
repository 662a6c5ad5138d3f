// shm backend: a same-host peer's memfd arenas, mapped read-only into this process on
// first use (the fd arrives once over the unix control socket, and is mapped only if it
// is sealed against shrinking and writing). READ is a memcpy; WRITEs to a same-host peer
// go over a unix data stream, so no peer ever maps another's memory writable.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/transfer/agent.h"
#include "transfer/connection.h"
#include "transfer/data_path.h"
#include "transfer/stats_counters.h"
#include "transfer/tcp_backend.h"

namespace ecx::transfer {

// The shm backend of one agent: reaches peers on this host that listen on a unix socket.
std::unique_ptr<BackendEngine> make_shm_engine(const AgentConfig& config);

class ShmDataPath final : public DataPath {
 public:
  // `writes`: the unix data stream that carries WRITEs to the peer.
  ShmDataPath(std::shared_ptr<ControlChannel> control, StatsCounters* stats,
              std::shared_ptr<TcpDataPool> writes)
      : control_(std::move(control)), stats_(stats), writes_(std::move(writes)) {}
  ~ShmDataPath() override;

  // READs are copied on the calling thread (validated in full before the first byte
  // moves); WRITEs go to the unix data stream.
  std::shared_ptr<TransferState> submit(std::span<const TransferDescriptor> descriptors, bool write,
                                        Deadline deadline, std::string description,
                                        TransferFinalizer finalizer) override;
  Result<RemoteView> view(uint32_t region, uint64_t offset, uint64_t length,
                          const Capability& capability, Deadline deadline) override;
  void fail_all(const Status& reason) override { writes_->fail_all(reason); }
  Backend kind() const override { return Backend::kShm; }

 private:
  Status read(std::span<const TransferDescriptor> descriptors, Deadline deadline);
  struct Mapping {
    std::byte* data = nullptr;
    uint64_t length = 0;
    bool readable = false;
    // One bit per kPopulateChunk of the mapping: its page tables are filled.
    std::unique_ptr<std::atomic<uint64_t>[]> populated;
    ~Mapping();
    // Fills the page tables of [offset, offset + length) (one madvise per chunk, once), so
    // that a read does not take a page fault per 4 KiB page on first touch.
    void populate(uint64_t offset, uint64_t length);
    // Every chunk not filled yet, in turn, until `stop` is set; a few pages per madvise,
    // so that the address space's lock is never held long.
    void populate_all(const std::atomic<bool>& stop);
    bool filled(uint64_t chunk) const {
      return (populated[chunk / 64].load(std::memory_order_relaxed) >> (chunk % 64)) & 1;
    }
    void mark_filled(uint64_t chunk) {
      populated[chunk / 64].fetch_or(uint64_t{1} << (chunk % 64), std::memory_order_relaxed);
    }
    std::atomic<bool> queued{false};  // given to the filler once
  };
  Result<std::shared_ptr<Mapping>> mapping(uint32_t region, const Capability& capability,
                                           Deadline deadline) ECX_EXCLUDES(mu_);
  // Queues each of `maps` not queued yet for the filler, which starts if it is not running.
  void fill_in_background(const std::vector<std::shared_ptr<Mapping>>& maps) ECX_EXCLUDES(mu_);
  // The filler's thread: populate_all of each queued mapping, until none is left.
  void fill_queued() ECX_EXCLUDES(mu_);
  // Resolves and range-checks each descriptor against the peer's mappings.
  Result<std::vector<std::shared_ptr<Mapping>>> resolve(
      std::span<const TransferDescriptor> descriptors, Deadline deadline);

  const std::shared_ptr<ControlChannel> control_;
  StatsCounters* const stats_;
  const std::shared_ptr<TcpDataPool> writes_;
  Mutex mu_;
  std::map<uint32_t, std::shared_ptr<Mapping>> mappings_ ECX_GUARDED_BY(mu_);
  // The filler: one thread at a time, while mappings wait in to_fill_. Each mapping goes
  // there at the end of the first read or view through it, so that the first loads from
  // a peer's arena do not each fill the page tables of theirs (a load still fills any
  // chunk it needs that is not done yet). Stopped and joined by the destructor.
  std::deque<std::shared_ptr<Mapping>> to_fill_ ECX_GUARDED_BY(mu_);
  std::thread filler_ ECX_GUARDED_BY(mu_);
  bool filler_running_ ECX_GUARDED_BY(mu_) = false;
  std::atomic<bool> closing_{false};
};

}  // namespace ecx::transfer
