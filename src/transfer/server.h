// Server side of an agent: listens on an abstract unix socket (same-host peers, memfd
// passing) and a TCP port, and serves each accepted connection on its own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ecx/transfer/agent.h"
#include "transfer/memory.h"
#include "transfer/socket.h"
#include "transfer/stats_counters.h"
#include "transfer/test_hooks.h"
#include "transfer/wire.h"

namespace ecx::transfer {

// What the server needs from its agent.
struct ServerHooks {
  std::function<AgentMetadata()> metadata;
  std::function<void(Notification)> deliver_notification;
  std::function<Result<std::string>(const Caller&, std::string_view)> handle_call;
  std::function<void(const std::string&)> peer_gone;  // the peer's holder identity
};

class Server {
 public:
  static Result<std::unique_ptr<Server>> start(const AgentConfig& config, RegionTable* regions,
                                               StatsCounters* stats, ServerHooks hooks);
  ~Server();  // stop()

  // Starts accepting connections. Separate from start() so the owner can publish the
  // server (its endpoints) before the first peer arrives.
  void run();

  const std::string& shm_endpoint() const { return shm_endpoint_; }
  const std::string& tcp_endpoint() const { return tcp_endpoint_; }
  // Closes listeners and every connection, and joins all threads.
  void stop();
  void set_test_faults(const TestFaults& faults) {
    stall_read_after_bytes_.store(faults.stall_read_after_bytes, std::memory_order_relaxed);
  }

 private:
  struct Connection {
    UniqueFd fd;
    bool unix_socket = false;
    std::chrono::steady_clock::time_point accepted_at;
    std::thread thread;
    bool handshaking = true;  // guarded by Server::mu_
    bool cut = false;         // guarded by Server::mu_; shut down to make room
    bool finished = false;    // guarded by Server::mu_
  };

  Server(const AgentConfig& config, RegionTable* regions, StatsCounters* stats, ServerHooks hooks);
  void accept_loop(int listen_fd, bool unix_socket);
  void make_room_for_handshake_locked(bool unix_socket);
  size_t established_locked(bool unix_socket) const;  // handshake done, not finished
  void serve(Connection* connection);
  // Handles one request frame; returns false when the connection must close.
  // Grants are checked against `caller.holder`, the peer's authenticated identity.
  bool handle_frame(Connection* connection, const Caller& caller, Frame& frame);
  // The region a READ or WRITE `h` may access; a refusal counts as a rejected request.
  Result<std::shared_ptr<RegionEntry>> accessible_region(const std::string& peer,
                                                         const FrameHeader& h,
                                                         const Capability& capability, bool write);
  // One per request type, as handle_frame: false when the connection must close.
  bool serve_read(int fd, const std::string& peer, const FrameHeader& h,
                  const Capability& capability);
  bool serve_write(int fd, const std::string& peer, const FrameHeader& h,
                   const Capability& capability);
  bool serve_region_query(const Connection& connection, const std::string& peer,
                          const FrameHeader& h, const Capability& capability);
  bool serve_call(int fd, const Caller& caller, const FrameHeader& h, std::string_view payload);
  void reap_finished();

  const AgentConfig config_;
  RegionTable* const regions_;
  StatsCounters* const stats_;
  const ServerHooks hooks_;
  UniqueFd unix_listener_;
  UniqueFd tcp_listener_;
  std::string shm_endpoint_;
  std::string tcp_endpoint_;
  std::thread unix_acceptor_;
  std::thread tcp_acceptor_;

  std::mutex mu_;
  std::condition_variable stop_cv_;                  // wakes fault-injection stalls on stop
  bool stopping_ = false;                            // guarded by mu_
  std::list<Connection> connections_;                // guarded by mu_
  std::atomic<uint64_t> stall_read_after_bytes_{0};  // TestFaults
};

}  // namespace ecx::transfer
