#include "transfer/agent_impl.h"

#include "transfer/memory.h"
#include "transfer/server.h"
#include "transfer/shm_backend.h"
#include "transfer/tcp_backend.h"
#include "transfer/ucx_backend.h"

namespace ecx::transfer {
namespace {

constexpr size_t kMaxQueuedNotifications = 1 << 16;
constexpr size_t kMaxQueuedNotificationBytes = 256u << 20;

}  // namespace

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

// The server's view of this agent: its metadata, its handlers, and the data frames its
// backends serve.
ServerHooks AgentImpl::server_hooks() {
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
  const ServeContext serving{
      .config = &config_, .regions = &regions_, .stats = &stats_, .io = &serve_io_};
  for (auto& engine : engines_) engine->add_services(hooks.services, serving);
  return hooks;
}

Status AgentImpl::start() {
  host_id_ = local_host_id();
  if (config_.enable_shm) engines_.push_back(make_shm_engine(config_));
  if (config_.ucx.enable) {
    ECX_ASSIGN_OR_RETURN(auto ucx, make_ucx_engine(config_));
    engines_.push_back(std::move(ucx));
  }
  engines_.push_back(make_tcp_engine(config_));
  ECX_ASSIGN_OR_RETURN(server_, Server::start(config_, &stats_, server_hooks()));
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
  auto carried = [&](const RegionEntry* entry) {
    for (const auto& e : engines_) {
      if (e->carries(kind) && (entry == nullptr || entry->backends.contains(e->kind())))
        return true;
    }
    return kind == MemoryKind::kHost;
  };
  auto not_carried = [&] {
    return Status(StatusCode::kFailedPrecondition,
                  "register_memory: no backend agent " + config_.name + " enables carries " +
                      std::string(memory_kind_name(kind)) +
                      " memory (device memory needs ucx: AgentConfig::ucx.enable)");
  };
  if (!carried(nullptr)) return not_carried();
  ECX_RETURN_IF_ERROR(check_memory_kind(data, length, kind));
  auto entry = std::make_shared<RegionEntry>();
  entry->data = static_cast<std::byte*>(data);
  entry->length = length;
  entry->kind = kind;
  entry->access = access;
  for (auto& engine : engines_) ECX_RETURN_IF_ERROR(engine->register_region(*entry));
  if (!carried(entry.get())) return not_carried();
  return regions_.add(std::move(entry));
}

AgentMetadata AgentImpl::metadata() const {
  AgentMetadata m;
  m.name = config_.name;
  m.protocol_version = kProtocolVersion;
  m.compat_hash = config_.compat_hash;
  m.host_id = host_id_;
  // The server's listeners carry the control connections (and the stream data).
  if (server_) server_->describe(m);
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
  const auto submitted = std::chrono::steady_clock::now();
  return [weak, stats, total, write, submitted,
          notification = std::move(notification)](const Status& s) {
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
    (write ? stats->write_seconds : stats->read_seconds)
        .observe(std::chrono::steady_clock::now() - submitted);
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

namespace {

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost"; }

// Where the agent's tcp listener binds and what peers are told to dial. Without a secret
// it listens on loopback only; an agent that listens on loopback only advertises that
// (whatever tcp_advertise_host said); a wildcard bind needs an address peers can dial.
Status settle_tcp_addresses(AgentConfig& config) {
  if (config.auth_secret.empty() && config.enable_tcp && !is_loopback(config.tcp_host)) {
    spdlog::error(
        "agent {}: no deployment secret: listening on 127.0.0.1 only, not {}, so no peer on "
        "another host can reach it. Fix: give every instance the same secret (auth_token_file, "
        "ECX_AUTH_TOKEN_FILE or ECX_AUTH_TOKEN; docs/SECURITY.md, \"Deploying the secret\")",
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
