#include "transfer/server.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/log.h"
#include "transfer/connection.h"

namespace ecx::transfer {
namespace {

constexpr int64_t kHelloTimeoutMs = 10000;

// Bind attempts, each with a fresh name, before the unix listener gives up.
constexpr int kUnixBindAttempts = 8;

// Abstract unix names have no owner: another user who could guess ours could bind it
// first and keep this agent from starting. 128 random bits cannot be guessed.
std::string unguessable_socket_name(const std::string& agent) {
  std::string nonce = random_bytes(16);
  return "ecx-" + agent.substr(0, 40) + "-" + hex_encode(nonce.data(), nonce.size());
}

Result<std::pair<UniqueFd, std::string>> listen_unix_unguessable(const std::string& agent) {
  Status last;
  for (int attempt = 0; attempt < kUnixBindAttempts; ++attempt) {
    std::string name = unguessable_socket_name(agent);
    auto fd = listen_unix(name);
    if (fd.ok()) return std::make_pair(std::move(*fd), name);
    last = fd.status();
    spdlog::warn("agent {}: {}; retrying with a new name", agent, last.to_string());
  }
  return last.with_context("agent " + agent + ": no unix listener after " +
                           std::to_string(kUnixBindAttempts) + " names");
}

FrameHeader reply_header(FrameType type, uint64_t id) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.id = id;
  return h;
}

}  // namespace

Server::Server(const AgentConfig& config, StatsCounters* stats, ServerHooks hooks)
    : config_(config), stats_(stats), hooks_(std::move(hooks)) {}

Result<std::unique_ptr<Server>> Server::start(const AgentConfig& config, StatsCounters* stats,
                                              ServerHooks hooks) {
  std::unique_ptr<Server> server(new Server(config, stats, std::move(hooks)));
  if (config.enable_shm) {
    ECX_ASSIGN_OR_RETURN(auto listener, listen_unix_unguessable(config.name));
    server->unix_listener_ = std::move(listener.first);
    server->unix_endpoint_ = std::move(listener.second);
  }
  if (config.enable_tcp) {
    ECX_ASSIGN_OR_RETURN(auto listener, listen_tcp(config.tcp_host, config.tcp_port));
    server->tcp_listener_ = std::move(listener.first);
    const std::string& dialed =
        config.tcp_advertise_host.empty() ? config.tcp_host : config.tcp_advertise_host;
    server->tcp_endpoint_ = dialed + ":" + std::to_string(listener.second);
  }
  return server;
}

void Server::describe(AgentMetadata& self) const {
  if (!unix_endpoint_.empty()) self.endpoints[Backend::kShm] = unix_endpoint_;
  if (!tcp_endpoint_.empty()) self.endpoints[Backend::kTcp] = tcp_endpoint_;
}

void Server::run() {
  if (unix_listener_.valid()) {
    unix_acceptor_ = std::thread([this] { accept_loop(unix_listener_.get(), true); });
  }
  if (tcp_listener_.valid()) {
    tcp_acceptor_ = std::thread([this] { accept_loop(tcp_listener_.get(), false); });
  }
}

Server::~Server() { stop(); }

void Server::stop() {
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& c : connections_) {
      if (c.fd.valid()) ::shutdown(c.fd.get(), SHUT_RDWR);
    }
  }
  stop_cv_.notify_all();
  if (unix_listener_.valid()) ::shutdown(unix_listener_.get(), SHUT_RDWR);
  if (tcp_listener_.valid()) ::shutdown(tcp_listener_.get(), SHUT_RDWR);
  if (unix_acceptor_.joinable()) unix_acceptor_.join();
  if (tcp_acceptor_.joinable()) tcp_acceptor_.join();
  std::list<Connection> all;
  {
    MutexLock lock(&mu_);
    all.swap(connections_);
  }
  for (auto& c : all) {
    if (c.thread.joinable()) c.thread.join();
  }
}

void Server::reap_finished() {
  std::list<Connection> done;
  {
    MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      auto next = std::next(it);
      if (it->finished) done.splice(done.end(), connections_, it);
      it = next;
    }
  }
  for (auto& c : done) {
    if (c.thread.joinable()) c.thread.join();
  }
}

void Server::accept_loop(int listen_fd, bool unix_socket) {
  while (true) {
    auto accepted = accept_connection(listen_fd);
    if (!accepted.ok()) {
      // Out of descriptors or similar: back off instead of spinning, but wake on stop.
      spdlog::warn("agent {}: {}", config_.name, accepted.status().to_string());
      {
        MutexLock lock(&mu_);
        if (stop_cv_.wait_for(&mu_, std::chrono::milliseconds(100),
                              [this]() ECX_REQUIRES(mu_) { return stopping_; }))
          return;
      }
      continue;
    }
    if (!accepted->valid()) return;  // listener shut down
    reap_finished();
    if (unix_socket) {
      // Abstract unix names carry no file permissions: refuse other users here.
      if (Status same = check_same_uid(accepted->get(), "agent " + config_.name); !same.ok()) {
        stats_->connections_refused++;
        spdlog::warn("agent {}: refused a unix connection: {}", config_.name, same.message());
        continue;
      }
    }
    MutexLock lock(&mu_);
    if (stopping_) return;
    if (established_locked(unix_socket) >=
        static_cast<size_t>(std::max(1, config_.max_connections))) {
      stats_->connections_refused++;
      send_error(accepted->get(), 0,
                 Status(StatusCode::kResourceExhausted,
                        "agent " + config_.name + " serves at most " +
                            std::to_string(config_.max_connections) + " connections"),
                 Deadline::after_ms(100))
          .ignore_error();
      continue;
    }
    make_room_for_handshake_locked(unix_socket);
    connections_.emplace_back();
    Connection* c = &connections_.back();
    c->fd = std::move(*accepted);
    c->unix_socket = unix_socket;
    c->accepted_at = std::chrono::steady_clock::now();
    if (!unix_socket) tune_tcp_socket(c->fd.get(), config_.tcp_socket_buffer);
    c->thread = std::thread([this, c] { serve(c); });
  }
}

// Peers that never finish their handshake must not keep the deployment's own agents
// out: when this listener's handshake slots are all taken, the oldest one is cut (its
// thread fails the handshake at once and ends).
size_t Server::established_locked(bool unix_socket) const {
  size_t n = 0;
  for (const auto& c : connections_) {
    n += (!c.finished && !c.handshaking && c.unix_socket == unix_socket) ? 1 : 0;
  }
  return n;
}

void Server::make_room_for_handshake_locked(bool unix_socket) {
  Connection* oldest = nullptr;
  size_t handshaking = 0;
  for (auto& c : connections_) {
    if (c.finished || !c.handshaking || c.cut || c.unix_socket != unix_socket) continue;
    handshaking++;
    if (oldest == nullptr || c.accepted_at < oldest->accepted_at) oldest = &c;
  }
  if (oldest == nullptr || handshaking < static_cast<size_t>(std::max(1, config_.max_handshakes)))
    return;
  stats_->connections_refused++;
  oldest->cut = true;
  ::shutdown(oldest->fd.get(), SHUT_RDWR);
}

void Server::serve(Connection* connection) {
  int fd = connection->fd.get();
  // Counted against max_connections once its proof is checked, before it is answered:
  // those that finished their handshake meanwhile may have taken the last places.
  auto admit = [&]() -> Status {
    MutexLock lock(&mu_);
    if (established_locked(connection->unix_socket) >=
        static_cast<size_t>(std::max(1, config_.max_connections))) {
      stats_->connections_refused++;
      return Status(StatusCode::kResourceExhausted, "agent " + config_.name + " serves at most " +
                                                        std::to_string(config_.max_connections) +
                                                        " connections");
    }
    connection->handshaking = false;
    return Status::Ok();
  };
  auto accepted =
      server_handshake(fd, hooks_.metadata(), config_.auth_secret,
                       Deadline::after_ms(kHelloTimeoutMs), &stats_->handshakes_rejected, admit);
  if (!accepted.ok()) {
    const StatusCode code = accepted.status().code();
    if (code != StatusCode::kUnavailable && code != StatusCode::kDeadlineExceeded &&
        code != StatusCode::kResourceExhausted) {
      spdlog::warn("agent {}: refused handshake: {}", config_.name, accepted.status().to_string());
    }
  } else {
    const Caller caller{accepted->metadata.name, accepted->metadata.holder()};
    const std::string& peer = caller.name;
    const bool data_only = (accepted->flags & kHelloDataConnection) != 0;
    const int64_t idle_ms = config_.idle_timeout_ms > 0 ? config_.idle_timeout_ms : 60000;
    while (true) {
      // A connection that sends nothing for idle_timeout_ms is closed; a peer reconnects.
      auto frame = recv_frame(fd, Deadline::after_ms(idle_ms));
      if (!frame.ok()) {
        if (frame.status().code() == StatusCode::kInvalidArgument) {
          stats_->rejected_requests++;
          send_error(fd, 0, frame.status()).ignore_error();
        } else if (frame.status().code() == StatusCode::kDeadlineExceeded) {
          spdlog::debug("agent {}: closed idle connection of {}", config_.name, peer);
        }
        break;
      }
      if (!handle_frame(connection, caller, *frame)) break;
    }
    if (!data_only && hooks_.peer_gone) hooks_.peer_gone(caller.holder);
  }
  MutexLock lock(&mu_);
  connection->fd.reset();  // closed now, not when the next connection reaps this one
  connection->finished = true;
}

bool Server::handle_frame(Connection* connection, const Caller& caller, Frame& frame) {
  int fd = connection->fd.get();
  const FrameHeader& h = frame.header;
  const auto type = static_cast<FrameType>(h.type);
  if (type == FrameType::kCall) return serve_call(fd, caller, h, frame.payload);
  if (type == FrameType::kNotify) {
    stats_->notifications_received++;
    hooks_.deliver_notification(Notification{caller.name, std::move(frame.payload)});
    return true;
  }
  auto service = hooks_.services.find(type);
  if (service == hooks_.services.end()) {
    stats_->rejected_requests++;
    send_error(fd, h.id,
               InvalidArgument(std::string("unexpected frame ") + frame_type_name(h.type) +
                               " from agent " + caller.name))
        .ignore_error();
    return false;
  }
  Capability capability;
  if (frame.payload.size() == capability.bytes.size()) {
    std::memcpy(capability.bytes.data(), frame.payload.data(), capability.bytes.size());
  }
  return service->second({.fd = fd,
                          .unix_socket = connection->unix_socket,
                          .caller = &caller,
                          .header = &h,
                          .capability = &capability});
}

bool Server::serve_call(int fd, const Caller& caller, const FrameHeader& h,
                        std::string_view payload) {
  Result<std::string> answer =
      hooks_.handle_call
          ? hooks_.handle_call(caller, payload)
          : Result<std::string>(Status(StatusCode::kFailedPrecondition,
                                       "agent " + config_.name + " serves no calls"));
  if (!answer.ok()) return send_error(fd, h.id, answer.status()).ok();
  if (answer->size() > kMaxControlPayload) {
    return send_error(fd, h.id,
                      Internal("reply of " + std::to_string(answer->size()) +
                               " bytes exceeds the control payload limit"))
        .ok();
  }
  return send_frame(fd, reply_header(FrameType::kCallReply, h.id), *answer,
                    Deadline::after_ms(kServeReplyTimeoutMs))
      .ok();
}

}  // namespace ecx::transfer
