// How an agent connects to its peers (agent_impl.h): the backend engine that reaches a
// peer, its control channel, then the engine's data path; concurrent connects to one
// peer share one handshake; a peer's death hands it to the reaper.
#include "transfer/agent_impl.h"

#include "transfer/memory.h"

namespace ecx::transfer {

// `auto` tries each engine that reaches the peer, in order (shm, ucx, tcp), and takes
// the first that connects; a refusal (incompatible, version, authentication) is final.
Result<std::shared_ptr<Peer>> AgentImpl::open_peer(const AgentMetadata& meta,
                                                   const ConnectOptions& options,
                                                   Deadline deadline) {
  const bool same_host = meta.host_id == host_id_;
  const Backend backend = options.backend;
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
    return open_with(*chosen, meta, same_host, options.any_name, deadline);
  }
  Status last =
      Unavailable("no backend of agent " + config_.name + " reaches agent '" + meta.name + "'");
  for (const auto& e : engines_) {
    if (!e->reaches(meta, same_host)) continue;
    auto peer = open_with(*e, meta, same_host, options.any_name, deadline);
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

// The control channel (unix or tcp, as the engine needs), then the engine's data path.
Result<std::shared_ptr<Peer>> AgentImpl::open_with(BackendEngine& engine, const AgentMetadata& meta,
                                                   bool same_host, bool any_name,
                                                   Deadline deadline) {
  auto peer = std::make_shared<Peer>();
  peer->name = meta.name;
  peer->backend = engine.kind();
  peer->connection_id = next_connection_id_.fetch_add(1);
  AgentMetadata self = metadata();
  self.session = session_with(meta.name);
  ECX_ASSIGN_OR_RETURN(ControlSocket dialed, engine.dial_control(meta, same_host, deadline));
  auto on_death = [this, name = peer->name, id = peer->connection_id](const Status& reason) {
    on_peer_death(name, id, reason);
  };
  ECX_ASSIGN_OR_RETURN(
      peer->control,
      ControlChannel::open(
          std::move(dialed.fd), dialed.unix_socket, self, config_.auth_secret, deadline,
          std::move(on_death),
          // Another host's reply takes longer than a poll would last: the caller sleeps.
          std::chrono::microseconds(same_host ? std::clamp<int64_t>(config_.reply_spin_us, 0, 10000)
                                              : 0)));
  if (!any_name && peer->control->peer().name != meta.name) {
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
  auto opened = open_peer(meta, options, deadline);
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

}  // namespace ecx::transfer
