// Server side of an agent: listens on an abstract unix socket (same-host peers, memfd
// passing) and a TCP port, and serves each accepted connection on its own thread: the
// handshake, calls and notifications here; every data frame by the service a backend
// added for it (frame_service.h). It knows no backend.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "ecx/common/mutex.h"
#include "ecx/transfer/agent.h"
#include "transfer/frame_service.h"
#include "transfer/memory.h"
#include "transfer/stats_counters.h"
#include "wire/socket.h"
#include "wire/wire.h"

namespace ecx::transfer {

// What the server needs from its agent.
struct ServerHooks {
  std::function<AgentMetadata()> metadata;
  std::function<void(Notification)> deliver_notification;
  std::function<Result<std::string>(const Caller&, std::string_view)> handle_call;
  std::function<void(const std::string&)> peer_gone;  // the peer's holder identity
  FrameServices services;  // the data frames served, as the backends added them
};

class Server {
 public:
  static Result<std::unique_ptr<Server>> start(const AgentConfig& config, StatsCounters* stats,
                                               ServerHooks hooks);
  ~Server();  // stop()

  // Starts accepting connections. Separate from start() so the owner can publish the
  // server (its endpoints) before the first peer arrives.
  void run();

  // Announces the listeners in `self`: the unix socket as the shm endpoint (same-host
  // peers dial it), the tcp port as the tcp endpoint.
  void describe(AgentMetadata& self) const;
  // Closes listeners and every connection, and joins all threads.
  void stop() ECX_EXCLUDES(mu_);

 private:
  struct Connection {
    UniqueFd fd;
    bool unix_socket = false;
    std::chrono::steady_clock::time_point accepted_at;
    std::thread thread;
    // Guarded by Server::mu_, which ECX_GUARDED_BY cannot name from a nested struct: only
    // read or written with it held.
    bool handshaking = true;
    bool cut = false;  // shut down to make room
    bool finished = false;
  };

  Server(const AgentConfig& config, StatsCounters* stats, ServerHooks hooks);
  void accept_loop(int listen_fd, bool unix_socket) ECX_EXCLUDES(mu_);
  void make_room_for_handshake_locked(bool unix_socket) ECX_REQUIRES(mu_);
  // Handshake done, not finished.
  size_t established_locked(bool unix_socket) const ECX_REQUIRES(mu_);
  void serve(Connection* connection) ECX_EXCLUDES(mu_);
  // Handles one request frame; returns false when the connection must close.
  // Grants are checked against `caller.holder`, the peer's authenticated identity.
  bool handle_frame(Connection* connection, const Caller& caller, Frame& frame);
  bool serve_call(int fd, const Caller& caller, const FrameHeader& h, std::string_view payload);
  void reap_finished() ECX_EXCLUDES(mu_);

  const AgentConfig config_;
  StatsCounters* const stats_;
  const ServerHooks hooks_;
  UniqueFd unix_listener_;
  UniqueFd tcp_listener_;
  std::string unix_endpoint_;
  std::string tcp_endpoint_;
  std::thread unix_acceptor_;
  std::thread tcp_acceptor_;

  Mutex mu_;
  CondVar stop_cv_;  // wakes the accept loop's back-off on stop
  bool stopping_ ECX_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::transfer
