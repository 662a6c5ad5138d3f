// Stream backend (tcp, and unix-socket WRITEs to same-host peers): a pool of data
// connections to one peer, each driven by a worker thread. A batch is cut into one run of
// slices (at most AgentConfig::tcp_slice_bytes each) per connection, of nearly equal
// bytes; each worker pipelines its slices (all requests out, then all replies in). Each request
// carries the descriptor's capability; the serving agent checks it before any byte moves.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/transfer/agent.h"
#include "transfer/data_path.h"
#include "transfer/read_digests.h"
#include "transfer/stats_counters.h"
#include "transfer/transfer_state.h"
#include "wire/socket.h"

namespace ecx::transfer {

// The tcp backend of one agent: reaches any peer with a tcp endpoint.
std::unique_ptr<BackendEngine> make_tcp_engine(const AgentConfig& config);

class TcpDataPool final : public DataPath, public std::enable_shared_from_this<TcpDataPool> {
 public:
  // Opens one data connection (connected, not yet shaken hands) by the deadline.
  using Dialer = std::function<Result<UniqueFd>(Deadline)>;
  // `streams` connections, at most; `label` names the endpoint in errors. (Byte and
  // transfer counts are kept by the agent's finalizer, not here.)
  TcpDataPool(const AgentConfig& config, AgentMetadata self, AgentMetadata peer, Dialer dial,
              std::string label, int streams);
  ~TcpDataPool() override;

  // Starts a batched transfer; the returned state completes when every slice has.
  std::shared_ptr<TransferState> submit(std::span<const TransferDescriptor> descriptors, bool write,
                                        Deadline deadline, std::string description,
                                        TransferFinalizer finalizer) override ECX_EXCLUDES(mu_);
  // Fails in-flight and future work with `reason` (the peer died).
  void fail_all(const Status& reason) override ECX_EXCLUDES(mu_);
  Backend kind() const override { return Backend::kTcp; }

  struct Slice {
    std::byte* local;
    uint32_t region;
    uint64_t offset;
    uint64_t length;
    Capability capability;
    size_t descriptor;  // of the batch
    uint64_t at;        // offset within that descriptor
  };
  struct Job {
    std::shared_ptr<TransferState> state;
    std::shared_ptr<ReadDigests> digests;  // READ: those the batch asked for, or nullptr
    std::vector<Slice> slices;
    bool write = false;
    Deadline deadline = Deadline::never();
  };
  // The batch's jobs, one per connection (split's comment in tcp_backend.cc).
  static std::vector<Job> split(std::span<const TransferDescriptor> descriptors, uint64_t slice,
                                size_t streams);

 private:
  struct Worker {
    std::thread thread;
    UniqueFd fd;  // installed/closed under mu_; shut down by others
    // Guarded by the pool's mu_, which ECX_GUARDED_BY cannot name from a nested struct:
    // only read or written with it held.
    std::deque<Job> jobs;
    TransferState* current = nullptr;
  };

  void run(Worker* worker) ECX_EXCLUDES(mu_);
  Status run_job(Worker* worker, Job& job) ECX_EXCLUDES(mu_);
  Status ensure_connected(Worker* worker, Job& job) ECX_EXCLUDES(mu_);
  static Status receive_slice(int fd, const Slice& s, Job& job);
  void interrupt(TransferState* state) ECX_EXCLUDES(mu_);

  const AgentConfig config_;
  const AgentMetadata self_;
  const AgentMetadata peer_;
  const Dialer dial_;
  const std::string label_;

  Mutex mu_;
  CondVar cv_;
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  Status failed_ ECX_GUARDED_BY(mu_);  // set once the peer is gone
  size_t next_worker_ ECX_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace ecx::transfer
