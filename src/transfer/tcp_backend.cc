#include "transfer/tcp_backend.h"

#include <sys/socket.h>

#include <algorithm>

#include "transfer/connection.h"
#include "transfer/memory.h"
#include "wire/wire.h"

namespace ecx::transfer {
namespace {
// Requests in flight per connection before the worker reads replies.
constexpr size_t kPipelineDepth = 32;
// A batch smaller than this per connection stays on fewer connections: another stream's
// frame costs more than it saves.
constexpr uint64_t kMinStreamBytes = 256 << 10;
// A READ slice whose bytes are hashed as they land is received in pieces of this size,
// each hashed at once, while it is still in the core's cache.
constexpr uint64_t kDigestPieceBytes = 256 << 10;

// A job's slices in the order its stream moves them, for the digests: an item the next job
// goes on with (its head) first, an item the job before began (its tail) last. A digest
// is taken in the item's order, so a tail that lands before its head waits, and is hashed
// later by the head's stream, out of memory, on top of its own bytes. With three 1600 KiB
// items over two streams, that stream hashed 3200 KiB and the other 1600. Head first and
// tail last, the head is hashed by the time its tail lands, and each stream hashes what it
// receives, while it is in cache.
void order_for_digests(std::vector<TcpDataPool::Job>& jobs) {
  for (size_t j = 0; j < jobs.size(); ++j) {
    auto& slices = jobs[j].slices;
    if (slices.empty() || slices.front().descriptor == slices.back().descriptor) continue;
    const size_t first = slices.front().descriptor;
    const size_t last = slices.back().descriptor;
    const bool tail = slices.front().at != 0;
    const bool head = j + 1 < jobs.size() && !jobs[j + 1].slices.empty() &&
                      jobs[j + 1].slices.front().descriptor == last;
    auto rank = [&](const TcpDataPool::Slice& s) {
      if (head && s.descriptor == last) return 0;
      if (tail && s.descriptor == first) return 2;
      return 1;
    };
    std::stable_sort(slices.begin(), slices.end(),
                     [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
  }
}

}  // namespace

// Cuts a batch into one job per connection of nearly equal bytes, each a run of slices of
// at most `slice` bytes in the batch's order (then ordered for the digests). Three 1600 KiB
// items over two streams are 2400 KiB each, where slicing per item and dealing the slices
// out gave one stream twice the bytes of the other: the batch ends with the slower stream.
std::vector<TcpDataPool::Job> TcpDataPool::split(std::span<const TransferDescriptor> descriptors,
                                                 uint64_t slice, size_t streams) {
  uint64_t total = 0;
  for (const auto& d : descriptors) total += d.length;
  const uint64_t share = std::max(kMinStreamBytes, (total + streams - 1) / streams);
  std::vector<Job> jobs(std::min<uint64_t>(streams, (total + share - 1) / share));
  size_t next = 0;
  uint64_t room = share;
  for (size_t k = 0; k < descriptors.size(); ++k) {
    const TransferDescriptor& d = descriptors[k];
    auto* base = static_cast<std::byte*>(d.local);
    for (uint64_t done = 0; done < d.length;) {
      if (room == 0) {  // bytes are left, so a job is (jobs * share >= total)
        ++next;
        room = share;
      }
      uint64_t n = std::min({slice, d.length - done, room});
      jobs[next].slices.push_back(
          {base + done, d.remote_region, d.remote_offset + done, n, d.capability, k, done});
      room -= n;
      done += n;
    }
  }
  order_for_digests(jobs);
  return jobs;
}

TcpDataPool::TcpDataPool(const AgentConfig& config, AgentMetadata self, AgentMetadata peer,
                         Dialer dial, std::string label, int streams)
    : config_(config),
      self_(std::move(self)),
      peer_(std::move(peer)),
      dial_(std::move(dial)),
      label_(std::move(label)) {
  int n = streams < 1 ? 1 : streams;
  for (int i = 0; i < n; ++i) {
    workers_.push_back(std::make_unique<Worker>());
    Worker* w = workers_.back().get();
    w->thread = std::thread([this, w] { run(w); });
  }
}

TcpDataPool::~TcpDataPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& w : workers_) {
      if (w->current != nullptr && w->fd.valid()) ::shutdown(w->fd.get(), SHUT_RDWR);
    }
  }
  cv_.notify_all();
  for (auto& w : workers_) w->thread.join();
}

std::shared_ptr<TransferState> TcpDataPool::submit(std::span<const TransferDescriptor> descriptors,
                                                   bool write, Deadline deadline,
                                                   std::string description,
                                                   TransferFinalizer finalizer) {
  const uint64_t slice = config_.tcp_slice_bytes == 0 ? (4u << 20) : config_.tcp_slice_bytes;
  std::vector<Job> jobs = split(descriptors, slice, workers_.size());
  std::shared_ptr<ReadDigests> digests = write ? nullptr : ReadDigests::for_batch(descriptors);
  auto state =
      std::make_shared<TransferState>(std::move(description), static_cast<int>(jobs.size()));
  state->set_finalizer(std::move(finalizer));
  TransferState* raw = state.get();
  // A weak reference: the hook may run after the peer (and this pool) went away.
  std::weak_ptr<TcpDataPool> weak = weak_from_this();
  state->set_cancel_hook([weak, raw] {
    if (auto pool = weak.lock()) pool->interrupt(raw);
  });
  MutexLock lock(&mu_);
  if (!failed_.ok() || stopping_) {
    Status why = failed_.ok() ? Unavailable("agent shutting down") : failed_;
    for (size_t i = 0; i < jobs.size(); ++i) state->part_done(why);
    return state;
  }
  // Spread jobs starting at a rotating worker so concurrent small batches share the pool.
  for (auto& job : jobs) {
    job.state = state;
    job.digests = digests;
    job.write = write;
    job.deadline = deadline;
    workers_[next_worker_++ % workers_.size()]->jobs.push_back(std::move(job));
  }
  cv_.notify_all();
  return state;
}

void TcpDataPool::fail_all(const Status& reason) {
  MutexLock lock(&mu_);
  if (failed_.ok()) failed_ = reason;
  for (auto& w : workers_) {
    if (w->current != nullptr && w->fd.valid()) ::shutdown(w->fd.get(), SHUT_RDWR);
  }
  cv_.notify_all();
}

void TcpDataPool::interrupt(TransferState* state) {
  std::vector<Job> dropped;
  {
    MutexLock lock(&mu_);
    for (auto& w : workers_) {
      if (w->current == state && w->fd.valid()) ::shutdown(w->fd.get(), SHUT_RDWR);
      // Jobs still queued for this transfer never start.
      for (auto it = w->jobs.begin(); it != w->jobs.end();) {
        if (it->state.get() == state) {
          dropped.push_back(std::move(*it));
          it = w->jobs.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  for (auto& job : dropped) {
    job.state->part_done(Status(StatusCode::kCancelled, job.state->description() + ": cancelled"));
  }
}

void TcpDataPool::run(Worker* worker) {
  while (true) {
    Job job;
    Status failed;
    {
      MutexLock lock(&mu_);
      cv_.wait(&mu_, [&]() ECX_REQUIRES(mu_) { return stopping_ || !worker->jobs.empty(); });
      if (worker->jobs.empty()) return;  // stopping, nothing left
      job = std::move(worker->jobs.front());
      worker->jobs.pop_front();
      worker->current = job.state.get();
      failed = stopping_ ? Unavailable("agent shutting down") : failed_;
    }
    Status result;
    if (!failed.ok()) {
      result = failed;
    } else if (job.state->cancelled()) {
      result = Status(StatusCode::kCancelled, job.state->description() + ": cancelled");
    } else {
      result = run_job(worker, job);
    }
    {
      MutexLock lock(&mu_);
      if (!result.ok()) worker->fd.reset();  // the stream may be mid-frame: start over
      worker->current = nullptr;
      if (!result.ok() && job.state->cancelled() &&
          result.code() != StatusCode::kDeadlineExceeded) {
        result = Status(StatusCode::kCancelled, job.state->description() + ": cancelled");
      } else if (!result.ok() && !failed_.ok() && result.code() != StatusCode::kDeadlineExceeded) {
        result = failed_.with_context(job.state->description());
      }
    }
    job.state->part_done(result);
  }
}

Status TcpDataPool::ensure_connected(Worker* worker, Job& job) {
  if (worker->fd.valid()) return Status::Ok();
  ECX_ASSIGN_OR_RETURN(UniqueFd fd, dial_(job.deadline));
  int raw = fd.get();
  {
    // Installed before the handshake, so a cancel or a peer death can shut it down.
    MutexLock lock(&mu_);
    if (job.state->cancelled()) {
      return Status(StatusCode::kCancelled, job.state->description() + ": cancelled");
    }
    worker->fd = std::move(fd);
  }
  auto peer = client_handshake(raw, self_, config_.auth_secret, kHelloDataConnection, job.deadline);
  if (!peer.ok()) return peer.status();
  if (peer->name != peer_.name) {
    return Unavailable("data stream to " + label_ + " reached agent '" + peer->name + "', not '" +
                       peer_.name + "'");
  }
  return Status::Ok();
}

Status TcpDataPool::run_job(Worker* worker, Job& job) {
  ECX_RETURN_IF_ERROR(ensure_connected(worker, job)
                          .with_context(job.state->description() + ": connect data stream"));
  int fd = worker->fd.get();
  set_io_deadline(fd, job.deadline);
  const FrameType type = job.write ? FrameType::kWrite : FrameType::kRead;
  Status first_error;
  for (size_t start = 0; start < job.slices.size(); start += kPipelineDepth) {
    size_t end = std::min(job.slices.size(), start + kPipelineDepth);
    for (size_t i = start; i < end; ++i) {
      const Slice& s = job.slices[i];
      FrameHeader h;
      h.type = static_cast<uint16_t>(type);
      h.id = i;
      h.region = s.region;
      h.offset = s.offset;
      h.length = s.length;
      std::string what = describe_access(job.write, s.length, s.offset, s.region, peer_.name);
      std::string capability;
      if (!s.capability.empty()) {
        capability.assign(reinterpret_cast<const char*>(s.capability.bytes.data()),
                          s.capability.bytes.size());
      }
      ECX_RETURN_IF_ERROR(send_frame(fd, h, capability, Deadline::never()).with_context(what));
      if (job.write) {
        ECX_RETURN_IF_ERROR(send_all(fd, s.local, s.length, Deadline::never(), "send WRITE data")
                                .with_context(what));
      }
    }
    for (size_t i = start; i < end; ++i) {
      const Slice& s = job.slices[i];
      std::string what = describe_access(job.write, s.length, s.offset, s.region, peer_.name);
      auto reply = recv_frame(fd, Deadline::never());
      if (!reply.ok()) return reply.status().with_context(what);
      const FrameHeader& r = reply->header;
      if (r.type == static_cast<uint16_t>(FrameType::kError)) {
        if (first_error.ok()) first_error = status_from_error_frame(*reply);
        continue;
      }
      if (job.write) {
        if (r.type != static_cast<uint16_t>(FrameType::kWriteAck) || r.id != i) {
          return Internal(what + ": unexpected reply " + frame_type_name(r.type));
        }
        continue;
      }
      if (r.type != static_cast<uint16_t>(FrameType::kReadData) || r.id != i ||
          r.length != s.length) {
        return Internal(what + ": unexpected reply " + frame_type_name(r.type) + " of " +
                        std::to_string(r.length) + " bytes");
      }
      ECX_RETURN_IF_ERROR(receive_slice(fd, s, job).with_context(what));
    }
  }
  return first_error;
}

// A READ slice's bytes, hashed piece by piece as they land when the batch asked for it.
Status TcpDataPool::receive_slice(int fd, const Slice& s, Job& job) {
  if (!job.digests || !job.digests->wants(s.descriptor)) {
    return recv_all(fd, s.local, s.length, Deadline::never(), "receive READ data");
  }
  for (uint64_t done = 0; done < s.length;) {
    uint64_t n = std::min(kDigestPieceBytes, s.length - done);
    ECX_RETURN_IF_ERROR(recv_all(fd, s.local + done, n, Deadline::never(), "receive READ data"));
    job.digests->landed(s.descriptor, s.at + done, n, *job.state);
    done += n;
  }
  return Status::Ok();
}

namespace {

class TcpEngine final : public BackendEngine {
 public:
  explicit TcpEngine(const AgentConfig& config) : config_(config) {}
  Backend kind() const override { return Backend::kTcp; }
  bool reaches(const AgentMetadata& peer, bool) const override {
    return !peer.endpoint(Backend::kTcp).empty();
  }
  Result<ControlSocket> dial_control(const AgentMetadata& peer, bool, Deadline d) const override {
    return dial_tcp_control(peer, d);
  }
  void add_services(FrameServices& services, const ServeContext& context) override {
    add_stream_service(services, context);
  }
  Result<std::shared_ptr<DataPath>> open(PeerLink link, Deadline) override;

 private:
  const AgentConfig& config_;
};

// A pool of tcp data streams that carries both directions.
Result<std::shared_ptr<DataPath>> TcpEngine::open(PeerLink link, Deadline) {
  ECX_ASSIGN_OR_RETURN(HostPort address, parse_host_port(link.peer.endpoint(Backend::kTcp)));
  int buffer = config_.tcp_socket_buffer;
  auto dial = [address, buffer](Deadline d) -> Result<UniqueFd> {
    ECX_ASSIGN_OR_RETURN(UniqueFd fd, connect_tcp(address, d));
    tune_tcp_socket(fd.get(), buffer);
    return fd;
  };
  return std::shared_ptr<DataPath>(std::make_shared<TcpDataPool>(
      config_, link.self, link.peer, dial, address.to_string(), config_.tcp_streams));
}

}  // namespace

std::unique_ptr<BackendEngine> make_tcp_engine(const AgentConfig& config) {
  return std::make_unique<TcpEngine>(config);
}

}  // namespace ecx::transfer
