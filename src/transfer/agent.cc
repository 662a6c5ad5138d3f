#include "ecx/transfer/agent.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <thread>
#include <vector>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"
#include "transfer/connection.h"
#include "transfer/data_path.h"
#include "transfer/memory.h"
#include "transfer/serve_io.h"
#include "transfer/server.h"
#include "transfer/shm_backend.h"
#include "transfer/tcp_backend.h"
#include "transfer/ucx_backend.h"
#include "transfer/wire.h"

namespace ecx::transfer {
namespace {

constexpr size_t kMaxQueuedNotifications = 1 << 16;
constexpr size_t kMaxQueuedNotificationBytes = 256u << 20;

// One connected peer and the data path that reaches it.
struct Peer {
  std::string name;
  Backend backend = Backend::kTcp;
  // Shared so a transfer's finalizer can notify without owning the Peer: a worker
  // thread must never drop the last reference to the pool that owns it.
  std::shared_ptr<ControlChannel> control;
  std::shared_ptr<DataPath> data;  // shared: cancel hooks hold weak references
  uint64_t connection_id = 0;      // tells this connection from later ones to the same name

  ~Peer() {
    // Data first (its workers may be mid-transfer), then the control channel.
    data.reset();
    control.reset();
  }
};

// The connection state of a peer name; lets concurrent connects share one handshake.
struct PeerSlot {
  bool connecting = false;
  std::shared_ptr<Peer> peer;  // set once connected
  Status error;                // last connect failure
};

class AgentImpl final : public Agent {
 public:
  explicit AgentImpl(AgentConfig config) : config_(std::move(config)), regions_(config_.name) {}
  ~AgentImpl() override;

  Status start();

  const std::string& name() const override { return config_.name; }
  const AgentConfig& config() const override { return config_; }
  Result<LocalRegion> allocate(uint64_t length, RegionAccess access) override;
  Result<LocalRegion> register_memory(void* data, uint64_t length, MemoryKind kind,
                                      RegionAccess access) override;
  Result<Capability> grant(uint32_t region_id, uint64_t offset, uint64_t length, bool write,
                           const std::string& holder) override {
    return regions_.grant(region_id, offset, length, write, holder);
  }
  void revoke(const Capability& capability) override { regions_.revoke(capability); }
  Status deregister(uint32_t region_id) override { return regions_.remove(region_id); }
  AgentMetadata metadata() const override;
  Result<AgentMetadata> connect(const AgentMetadata& peer, ConnectOptions options) override
      ECX_EXCLUDES(mu_);
  void disconnect(const std::string& peer) override ECX_EXCLUDES(mu_);
  Result<Backend> peer_backend(const std::string& peer) const override;
  Result<TransferHandle> read(const std::string& peer,
                              std::span<const TransferDescriptor> descriptors,
                              std::optional<Deadline> deadline) override {
    return transfer(peer, descriptors, false, std::nullopt, deadline);
  }
  Result<TransferHandle> write(const std::string& peer,
                               std::span<const TransferDescriptor> descriptors,
                               std::optional<std::string> notification,
                               std::optional<Deadline> deadline) override {
    return transfer(peer, descriptors, true, std::move(notification), deadline);
  }
  Status notify(const std::string& peer, std::string message) override;
  Result<std::string> call(const std::string& peer, std::string request,
                           Deadline deadline) override;
  void set_call_handler(CallHandler handler) override ECX_EXCLUDES(mu_);
  void set_peer_gone_handler(PeerGoneHandler handler) override ECX_EXCLUDES(mu_);
  void set_notification_handler(NotificationHandler handler) override ECX_EXCLUDES(mu_);
  Result<Notification> wait_notification(Deadline deadline) override ECX_EXCLUDES(notify_mu_);
  Result<RemoteView> view(const std::string& peer, uint32_t region, uint64_t offset,
                          uint64_t length, const Capability& capability) override;
  AgentStats stats() const override ECX_EXCLUDES(mu_) {
    AgentStats s = stats_.snapshot();
    MutexLock lock(&mu_);
    s.connects_by_backend = connects_by_backend_;
    return s;
  }
  void shutdown() override ECX_EXCLUDES(mu_);
  void set_serve_io(ServeIo& io) { server_->set_serve_io(io); }

 private:
  Result<std::shared_ptr<Peer>> connected_peer(const std::string& name) const ECX_EXCLUDES(mu_);
  Result<std::shared_ptr<Peer>> open_peer(const AgentMetadata& meta, Backend backend,
                                          Deadline deadline);
  Result<std::shared_ptr<Peer>> open_with(BackendEngine& engine, const AgentMetadata& meta,
                                          bool same_host, Deadline deadline);
  Result<UniqueFd> dial_control(const AgentMetadata& meta, bool over_unix, Deadline deadline);
  BackendEngine* engine(Backend kind) const;
  Result<TransferHandle> transfer(const std::string& peer,
                                  std::span<const TransferDescriptor> descriptors, bool write,
                                  std::optional<std::string> notification,
                                  std::optional<Deadline> deadline);
  Result<uint64_t> check_descriptors(std::span<const TransferDescriptor> descriptors,
                                     const char* op);
  std::function<Status(const Status&)> transfer_finalizer(
      const std::shared_ptr<ControlChannel>& control, bool write, uint64_t total,
      std::optional<std::string> notification);
  void on_peer_death(const std::string& name, uint64_t connection_id, const Status& reason)
      ECX_EXCLUDES(mu_);
  // Destroys dead peers (joins their threads, unmaps their memory) off their own threads.
  void reap_dead_peers() ECX_EXCLUDES(mu_);

  const AgentConfig config_;
  RegionTable regions_;
  StatsCounters stats_;
  std::unique_ptr<Server> server_;
  // One engine per enabled backend, in the order `auto` tries them.
  std::vector<std::unique_ptr<BackendEngine>> engines_;
  std::string host_id_;
  // Our session with a server (AgentMetadata::session), sent in our handshakes with it
  // only: an HMAC under a key of this process over the server's name. The server keys
  // what it hands us by it, so no other process that declares our name can take or end
  // it, and a server that learns our session with it cannot pose as us to another.
  std::string session_with(const std::string& server) const {
    Mac mac = hmac_sha256(session_key_, {"ecx-session-v1", server});
    return hex_encode(mac.data(), 16);
  }
  const std::string session_key_ = random_bytes(32);
  std::atomic<uint64_t> next_connection_id_{1};

  mutable Mutex mu_;
  CondVar peers_cv_;
  std::map<std::string, PeerSlot> peers_ ECX_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> connects_by_backend_ ECX_GUARDED_BY(mu_);
  CallHandler call_handler_ ECX_GUARDED_BY(mu_);
  PeerGoneHandler peer_gone_handler_ ECX_GUARDED_BY(mu_);
  NotificationHandler notification_handler_ ECX_GUARDED_BY(mu_);
  bool stopped_ ECX_GUARDED_BY(mu_) = false;
  // Peers whose connection died, waiting for the reaper thread to destroy them.
  std::vector<std::shared_ptr<Peer>> dead_peers_ ECX_GUARDED_BY(mu_);
  CondVar reaper_cv_;
  std::thread reaper_;

  Mutex notify_mu_;
  CondVar notify_cv_;
  std::deque<Notification> notifications_ ECX_GUARDED_BY(notify_mu_);
  size_t notification_bytes_ ECX_GUARDED_BY(notify_mu_) = 0;
};

AgentImpl::~AgentImpl() { shutdown(); }

void AgentImpl::shutdown() {
  // The server first: its handlers may connect to peers. Then the peers, outside mu_,
  // because their threads may call back into on_peer_death.
  {
    MutexLock lock(&mu_);
    stopped_ = true;
  }
  reaper_cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  if (server_) server_->stop();
  std::map<std::string, PeerSlot> peers;
  std::vector<std::shared_ptr<Peer>> dead;
  {
    MutexLock lock(&mu_);
    peers.swap(peers_);
    dead.swap(dead_peers_);
  }
  peers.clear();
  dead.clear();
  for (auto& engine : engines_) engine->stop();
}

void AgentImpl::reap_dead_peers() {
  while (true) {
    std::vector<std::shared_ptr<Peer>> dead;
    {
      MutexLock lock(&mu_);
      reaper_cv_.wait(&mu_,
                      [this]() ECX_REQUIRES(mu_) { return stopped_ || !dead_peers_.empty(); });
      if (stopped_) return;
      dead.swap(dead_peers_);
    }
    dead.clear();  // joins the peer's threads, closes its fds, drops its mappings
  }
}

Status AgentImpl::start() {
  host_id_ = local_host_id();
  ServerHooks hooks;
  hooks.metadata = [this] { return metadata(); };
  hooks.deliver_notification = [this](Notification n) {
    NotificationHandler handler;
    {
      MutexLock lock(&mu_);
      handler = notification_handler_;
    }
    if (handler) {
      handler(std::move(n));
      return;
    }
    {
      MutexLock lock(&notify_mu_);
      // Bounded by count and bytes: a peer cannot exhaust memory; the oldest go first.
      while (!notifications_.empty() &&
             (notifications_.size() >= kMaxQueuedNotifications ||
              notification_bytes_ + n.message.size() > kMaxQueuedNotificationBytes)) {
        notification_bytes_ -= notifications_.front().message.size();
        notifications_.pop_front();
      }
      notification_bytes_ += n.message.size();
      notifications_.push_back(std::move(n));
    }
    notify_cv_.notify_one();
  };
  hooks.handle_call = [this](const Caller& peer, std::string_view request) {
    CallHandler handler;
    {
      MutexLock lock(&mu_);
      handler = call_handler_;
    }
    if (!handler) {
      return Result<std::string>(Status(StatusCode::kFailedPrecondition,
                                        "agent " + config_.name + " has no call handler"));
    }
    return handler(peer, request);
  };
  hooks.peer_gone = [this](const std::string& peer) {
    PeerGoneHandler handler;
    {
      MutexLock lock(&mu_);
      handler = peer_gone_handler_;
    }
    if (handler) handler(peer);
  };
  if (config_.enable_shm) engines_.push_back(make_shm_engine(config_));
  if (config_.ucx.enable) {
    ECX_ASSIGN_OR_RETURN(auto ucx, make_ucx_engine(config_));
    engines_.push_back(std::move(ucx));
  }
  engines_.push_back(make_tcp_engine(config_));
  ECX_ASSIGN_OR_RETURN(server_, Server::start(config_, &regions_, &stats_, std::move(hooks)));
  server_->run();
  reaper_ = std::thread([this] { reap_dead_peers(); });
  return Status::Ok();
}

Result<LocalRegion> AgentImpl::allocate(uint64_t length, RegionAccess access) {
  ECX_ASSIGN_OR_RETURN(auto entry, create_memfd_region(config_.name, length));
  entry->access = access;
  for (auto& engine : engines_) ECX_RETURN_IF_ERROR(engine->register_region(*entry));
  return regions_.add(std::move(entry));
}

Result<LocalRegion> AgentImpl::register_memory(void* data, uint64_t length, MemoryKind kind,
                                               RegionAccess access) {
  if (data == nullptr || length == 0) return InvalidArgument("register_memory: empty buffer");
  // Checked first, so the refusal is the same with or without a GPU on this machine.
  auto needs_ucx = [&] {
    return Status(StatusCode::kFailedPrecondition,
                  "register_memory: " + std::string(memory_kind_name(kind)) +
                      " memory is reached only through the ucx backend, which agent " +
                      config_.name + " does not enable (AgentConfig::ucx.enable)");
  };
  if (kind != MemoryKind::kHost && engine(Backend::kUcx) == nullptr) return needs_ucx();
  ECX_RETURN_IF_ERROR(check_memory_kind(data, length, kind));
  auto entry = std::make_shared<RegionEntry>();
  entry->data = static_cast<std::byte*>(data);
  entry->length = length;
  entry->kind = kind;
  entry->access = access;
  for (auto& engine : engines_) ECX_RETURN_IF_ERROR(engine->register_region(*entry));
  if (kind != MemoryKind::kHost && !entry->backends.contains(Backend::kUcx)) return needs_ucx();
  return regions_.add(std::move(entry));
}

AgentMetadata AgentImpl::metadata() const {
  AgentMetadata m;
  m.name = config_.name;
  m.protocol_version = kProtocolVersion;
  m.compat_hash = config_.compat_hash;
  m.host_id = host_id_;
  // The server's listeners carry the control connections (and the shm and tcp data).
  if (server_ && !server_->shm_endpoint().empty()) {
    m.endpoints[Backend::kShm] = server_->shm_endpoint();
  }
  if (server_ && !server_->tcp_endpoint().empty()) {
    m.endpoints[Backend::kTcp] = server_->tcp_endpoint();
  }
  for (const auto& engine : engines_) engine->describe(m);
  m.regions = regions_.list();
  return m;
}

BackendEngine* AgentImpl::engine(Backend kind) const {
  for (const auto& e : engines_) {
    if (e->kind() == kind) return e.get();
  }
  return nullptr;
}

// `auto` tries each engine that reaches the peer, in order (shm, ucx, tcp), and takes
// the first that connects; a refusal (incompatible, version, authentication) is final.
Result<std::shared_ptr<Peer>> AgentImpl::open_peer(const AgentMetadata& meta, Backend backend,
                                                   Deadline deadline) {
  const bool same_host = meta.host_id == host_id_;
  if (backend != Backend::kAuto) {
    BackendEngine* chosen = engine(backend);
    if (chosen == nullptr) {
      return Unavailable("backend " + std::string(backend_name(backend)) +
                         " is not enabled in agent " + config_.name);
    }
    if (!chosen->reaches(meta, same_host || backend == Backend::kShm)) {
      return Unavailable("backend " + std::string(backend_name(backend)) + " cannot reach agent '" +
                         meta.name + "' (no endpoint for it)");
    }
    return open_with(*chosen, meta, same_host, deadline);
  }
  Status last =
      Unavailable("no backend of agent " + config_.name + " reaches agent '" + meta.name + "'");
  for (const auto& e : engines_) {
    if (!e->reaches(meta, same_host)) continue;
    auto peer = open_with(*e, meta, same_host, deadline);
    StatusCode code = peer.ok() ? StatusCode::kOk : peer.status().code();
    if (peer.ok() || code == StatusCode::kIncompatible || code == StatusCode::kVersionMismatch ||
        code == StatusCode::kPermissionDenied || code == StatusCode::kDeadlineExceeded) {
      return peer;
    }
    spdlog::info("agent {}: {} to {} failed ({}), trying the next backend", config_.name,
                 backend_name(e->kind()), meta.name, peer.status().to_string());
    last = peer.status();
  }
  return last;
}

Result<UniqueFd> AgentImpl::dial_control(const AgentMetadata& meta, bool over_unix,
                                         Deadline deadline) {
  const Backend listener = over_unix ? Backend::kShm : Backend::kTcp;
  const std::string& endpoint = meta.endpoint(listener);
  if (endpoint.empty()) {
    return Unavailable("agent '" + meta.name + "' has no " + std::string(backend_name(listener)) +
                       " endpoint");
  }
  if (over_unix) return connect_unix(endpoint, deadline);
  ECX_ASSIGN_OR_RETURN(HostPort address, parse_host_port(endpoint));
  return connect_tcp(address, deadline);
}

// The control channel (unix or tcp, as the engine needs), then the engine's data path.
Result<std::shared_ptr<Peer>> AgentImpl::open_with(BackendEngine& engine, const AgentMetadata& meta,
                                                   bool same_host, Deadline deadline) {
  auto peer = std::make_shared<Peer>();
  peer->name = meta.name;
  peer->backend = engine.kind();
  peer->connection_id = next_connection_id_.fetch_add(1);
  const bool over_unix = engine.control_over_unix(meta, same_host);
  AgentMetadata self = metadata();
  self.session = session_with(meta.name);
  ECX_ASSIGN_OR_RETURN(UniqueFd fd, dial_control(meta, over_unix, deadline));
  auto on_death = [this, name = peer->name, id = peer->connection_id](const Status& reason) {
    on_peer_death(name, id, reason);
  };
  ECX_ASSIGN_OR_RETURN(
      peer->control,
      ControlChannel::open(
          std::move(fd), over_unix, self, config_.auth_secret, deadline, std::move(on_death),
          // Another host's reply takes longer than a poll would last: the caller sleeps.
          std::chrono::microseconds(same_host ? std::clamp<int64_t>(config_.reply_spin_us, 0, 10000)
                                              : 0)));
  if (peer->control->peer().name != meta.name) {
    return Unavailable("endpoint of agent '" + meta.name + "' is now served by agent '" +
                       peer->control->peer().name + "' (stale metadata)");
  }
  PeerLink link{.config = &config_,
                .same_host = same_host,
                .self = std::move(self),
                .peer = peer->control->peer(),
                .control = peer->control,
                .stats = &stats_};
  ECX_ASSIGN_OR_RETURN(peer->data, engine.open(std::move(link), deadline));
  return peer;
}

Result<AgentMetadata> AgentImpl::connect(const AgentMetadata& meta, ConnectOptions options) {
  if (meta.name.empty()) return InvalidArgument("connect: peer metadata has no name");
  if (meta.name == config_.name) {
    return InvalidArgument("connect: peer '" + meta.name + "' has this agent's own name");
  }
  {
    // Fast path: already connected (the common case on every load).
    MutexLock lock(&mu_);
    auto it = peers_.find(meta.name);
    if (it != peers_.end() && it->second.peer && it->second.peer->control->alive() &&
        it->second.peer->control->peer().compat_hash == meta.compat_hash) {
      return it->second.peer->control->peer();
    }
  }
  AgentMetadata self = metadata();
  if (Status s = check_compatible(self, meta); !s.ok()) {
    stats_.handshakes_rejected++;
    return s;
  }
  Deadline deadline = options.deadline.value_or(Deadline::after_ms(config_.connect_timeout_ms));
  std::shared_ptr<Peer> stale;
  {
    MutexLock lock(&mu_);
    if (stopped_) return Unavailable("agent " + config_.name + " is shut down");
    while (true) {
      PeerSlot& slot = peers_[meta.name];
      if (slot.peer && slot.peer->control->alive()) return slot.peer->control->peer();
      if (!slot.connecting) break;
      if (!peers_cv_.wait_until(&mu_, deadline.time_point(), [&]() ECX_REQUIRES(mu_) {
            return !peers_[meta.name].connecting;
          })) {
        return DeadlineExceeded("connect to agent '" + meta.name + "': deadline passed");
      }
    }
    PeerSlot& slot = peers_[meta.name];
    slot.connecting = true;
    stale = std::move(slot.peer);
  }
  stale.reset();  // a dead previous connection: its threads are joined outside mu_
  auto opened = open_peer(meta, options.backend, deadline);
  MutexLock lock(&mu_);
  PeerSlot& done = peers_[meta.name];
  done.connecting = false;
  if (opened.ok()) {
    done.peer = *opened;
    done.error = Status::Ok();
    stats_.peers_connected++;
    connects_by_backend_[std::string(backend_name(done.peer->backend))]++;
  } else {
    done.error = opened.status();
  }
  peers_cv_.notify_all();
  if (!opened.ok()) {
    return opened.status().with_context("connect to agent '" + meta.name + "'");
  }
  return done.peer->control->peer();
}

void AgentImpl::disconnect(const std::string& name) {
  std::shared_ptr<Peer> peer;
  {
    MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end() || it->second.connecting) return;
    peer = std::move(it->second.peer);
    peers_.erase(it);
  }
}

void AgentImpl::on_peer_death(const std::string& name, uint64_t connection_id,
                              const Status& reason) {
  // Runs on the peer's reader thread. No reference to the Peer is taken here: dropping
  // the last one on this thread would make the channel join its own thread.
  MutexLock lock(&mu_);
  auto it = peers_.find(name);
  if (it == peers_.end() || !it->second.peer || it->second.peer->connection_id != connection_id) {
    return;  // an older connection, or one we dropped on purpose
  }
  stats_.peer_failures++;
  spdlog::debug("agent {}: peer {} gone: {}", config_.name, name, reason.to_string());
  auto& peer = it->second.peer;
  if (peer->data) peer->data->fail_all(reason);
  // Its threads, fds and mappings go now, not at the next connect: a restarted producer
  // must not cost another arena's worth of mapped memory each time.
  it->second.error = reason;
  dead_peers_.push_back(std::move(peer));
  reaper_cv_.notify_one();
}

Result<std::shared_ptr<Peer>> AgentImpl::connected_peer(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = peers_.find(name);
  if (it == peers_.end() || !it->second.peer) {
    if (it != peers_.end() && !it->second.error.ok()) {
      return Unavailable("agent '" + name + "' is disconnected: " + it->second.error.message());
    }
    return Unavailable("agent '" + name + "' is not connected to agent '" + config_.name + "'");
  }
  const auto& peer = it->second.peer;
  if (!peer->control->alive()) {
    return Unavailable("agent '" + name +
                       "' is disconnected: " + peer->control->death_status().message());
  }
  return peer;
}

Result<Backend> AgentImpl::peer_backend(const std::string& name) const {
  ECX_ASSIGN_OR_RETURN(auto peer, connected_peer(name));
  return peer->backend;
}

Result<TransferHandle> AgentImpl::transfer(const std::string& peer_name,
                                           std::span<const TransferDescriptor> descriptors,
                                           bool write, std::optional<std::string> notification,
                                           std::optional<Deadline> deadline_opt) {
  const char* op = write ? "write" : "read";
  ECX_ASSIGN_OR_RETURN(uint64_t total, check_descriptors(descriptors, op));
  ECX_ASSIGN_OR_RETURN(auto peer, connected_peer(peer_name));
  Status inside = check_announced_regions(descriptors, peer->control->peer().regions, write,
                                          peer_name, peer->backend);
  if (inside.ok()) inside = regions_.check_host_buffers(descriptors, write, peer->backend);
  if (!inside.ok()) {
    stats_.rejected_descriptors++;
    return inside;
  }
  Deadline deadline = deadline_opt.value_or(Deadline::after_ms(config_.transfer_timeout_ms));
  std::string description = std::string(op) + " of " + std::to_string(descriptors.size()) +
                            " items (" + std::to_string(total) + " bytes) " +
                            (write ? "to" : "from") + " agent " + peer_name + " over " +
                            std::string(backend_name(peer->backend));
  // The notification follows the batch's last byte: the finalizer sends it.
  auto finalizer = transfer_finalizer(peer->control, write, total, std::move(notification));
  return TransferHandle(
      peer->data->submit(descriptors, write, deadline, description, std::move(finalizer)));
}

// Every descriptor names a buffer and a length; returns their total bytes.
Result<uint64_t> AgentImpl::check_descriptors(std::span<const TransferDescriptor> descriptors,
                                              const char* op) {
  if (descriptors.empty()) return InvalidArgument(std::string(op) + ": no descriptors");
  uint64_t total = 0;
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    if (d.local == nullptr || d.length == 0) {
      stats_.rejected_descriptors++;
      return InvalidArgument(std::string(op) + ": descriptor " + std::to_string(i) +
                             " has a null buffer or zero length");
    }
    if (d.digest_length != 0 &&
        (d.digest_from > d.length || d.digest_length > d.length - d.digest_from)) {
      stats_.rejected_descriptors++;
      return InvalidArgument(std::string(op) + ": descriptor " + std::to_string(i) +
                             " asks a digest of bytes outside its " + std::to_string(d.length));
    }
    total += d.length;
  }
  return total;
}

// Runs once the transfer completes: sends `notification` (when given) and counts the
// outcome. Holds the control channel weakly: a finalizer must not keep a peer alive.
std::function<Status(const Status&)> AgentImpl::transfer_finalizer(
    const std::shared_ptr<ControlChannel>& control, bool write, uint64_t total,
    std::optional<std::string> notification) {
  std::weak_ptr<ControlChannel> weak = control;
  StatsCounters* stats = &stats_;
  return [weak, stats, total, write, notification = std::move(notification)](const Status& s) {
    Status result = s;
    if (result.ok() && notification) {
      if (auto control = weak.lock()) {
        result = control->notify(*notification);
      } else {
        result = Unavailable("peer gone before the notification was sent");
      }
    }
    if (result.ok()) {
      (write ? stats->bytes_written : stats->bytes_read) += total;
      stats->transfers_completed++;
    } else {
      stats->transfers_failed++;
    }
    return result;
  };
}

Status AgentImpl::notify(const std::string& peer_name, std::string message) {
  ECX_ASSIGN_OR_RETURN(auto peer, connected_peer(peer_name));
  return peer->control->notify(message);
}

Result<std::string> AgentImpl::call(const std::string& peer_name, std::string request,
                                    Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(auto peer, connected_peer(peer_name));
  return peer->control->call(request, deadline);
}

void AgentImpl::set_call_handler(CallHandler handler) {
  MutexLock lock(&mu_);
  call_handler_ = std::move(handler);
}

void AgentImpl::set_peer_gone_handler(PeerGoneHandler handler) {
  MutexLock lock(&mu_);
  peer_gone_handler_ = std::move(handler);
}

void AgentImpl::set_notification_handler(NotificationHandler handler) {
  MutexLock lock(&mu_);
  notification_handler_ = std::move(handler);
}

Result<Notification> AgentImpl::wait_notification(Deadline deadline) {
  MutexLock lock(&notify_mu_);
  if (!notify_cv_.wait_until(&notify_mu_, deadline.time_point(), [this]() ECX_REQUIRES(notify_mu_) {
        return !notifications_.empty();
      })) {
    return DeadlineExceeded("agent " + config_.name + ": no notification before the deadline");
  }
  Notification n = std::move(notifications_.front());
  notifications_.pop_front();
  notification_bytes_ -= n.message.size();
  return n;
}

Result<RemoteView> AgentImpl::view(const std::string& peer_name, uint32_t region, uint64_t offset,
                                   uint64_t length, const Capability& capability) {
  ECX_ASSIGN_OR_RETURN(auto peer, connected_peer(peer_name));
  return peer->data->view(region, offset, length, capability,
                          Deadline::after_ms(config_.connect_timeout_ms));
}

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost"; }

// Where the agent's tcp listener binds and what peers are told to dial. Without a secret
// it listens on loopback only; an agent that listens on loopback only advertises that
// (whatever tcp_advertise_host said); a wildcard bind needs an address peers can dial.
Status settle_tcp_addresses(AgentConfig& config) {
  if (config.auth_secret.empty() && config.enable_tcp && !is_loopback(config.tcp_host)) {
    spdlog::warn(
        "agent {}: no deployment secret (auth_token) configured: listening on 127.0.0.1 only, "
        "not {}",
        config.name, config.tcp_host);
    config.tcp_host = "127.0.0.1";
  }
  std::string& advertised = config.tcp_advertise_host;
  if (!advertised.empty() && is_loopback(config.tcp_host) && !is_loopback(advertised)) {
    spdlog::warn("agent {}: listening on {} only: peers dial that, not tcp_advertise_host {}",
                 config.name, config.tcp_host, advertised);
    advertised.clear();
  }
  if (config.auth_secret.empty()) advertised.clear();  // peers dial where it listens
  if (config.enable_tcp && advertised.empty() && config.tcp_host == "0.0.0.0") {
    return InvalidArgument("agent '" + config.name +
                           "': tcp_host 0.0.0.0 listens on every address, which peers cannot "
                           "dial: set tcp_advertise_host to the address they reach");
  }
  if (advertised == "0.0.0.0") {
    return InvalidArgument("agent '" + config.name +
                           "': tcp_advertise_host 0.0.0.0 is no address a peer can dial");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Agent>> Agent::create(AgentConfig config) {
  if (config.name.empty()) return InvalidArgument("agent config needs a name");
  if (config.name.size() > 200) return InvalidArgument("agent name longer than 200 characters");
  if (config.name.find('#') != std::string::npos) {
    return InvalidArgument("agent name '" + config.name + "' contains '#'");
  }
  if (!config.enable_shm && !config.enable_tcp) {
    return InvalidArgument("agent '" + config.name + "' has neither shm nor tcp enabled");
  }
  ECX_RETURN_IF_ERROR(settle_tcp_addresses(config));
  auto agent = std::make_unique<AgentImpl>(std::move(config));
  ECX_RETURN_IF_ERROR(agent->start());
  return std::unique_ptr<Agent>(std::move(agent));
}

void set_serve_io(Agent& agent, ServeIo& io) { static_cast<AgentImpl&>(agent).set_serve_io(io); }

}  // namespace ecx::transfer
