// Client side of an agent connection: the handshake, and ControlChannel, which carries
// CALL / NOTIFY / REGION_QUERY to one peer and detects the peer's death.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/transfer/metadata.h"
#include "transfer/socket.h"

namespace ecx::transfer {

// HELLO flag: this connection carries data only (no peer-gone event when it closes).
constexpr uint16_t kHelloDataConnection = 1;

// Checks that `peer` can talk to an agent with `self`'s version and compatibility hash.
// The messages name both agents and both values.
Status check_compatible(const AgentMetadata& self, const AgentMetadata& peer);

// Sends HELLO(self) on a connected socket and waits for HELLO_OK. Returns the peer's
// metadata as it answered (current regions).
Result<AgentMetadata> client_handshake(int fd, const AgentMetadata& self, uint16_t flags,
                                       Deadline deadline);

struct RegionGrant {
  uint64_t length = 0;
  bool remote_write = false;
  bool remote_read = false;
  UniqueFd memfd;  // set when the region was passed over a unix socket
};

class ControlChannel {
 public:
  using DeathHandler = std::function<void(const Status&)>;

  // Takes a connected socket, shakes hands and starts the reader thread. `on_death` runs
  // once, on the reader thread, when the peer closes or the socket fails.
  static Result<std::unique_ptr<ControlChannel>> open(UniqueFd fd, bool unix_socket,
                                                      const AgentMetadata& self, Deadline deadline,
                                                      DeathHandler on_death);
  ~ControlChannel();

  const AgentMetadata& peer() const { return peer_; }
  bool alive() const { return alive_.load(std::memory_order_acquire); }
  // Like alive(), but also asks the kernel whether the peer has hung up, so a death is
  // seen at once even before the reader thread wakes (one poll(2), no blocking).
  bool alive_now() const;
  // The reason the channel died (ok while alive).
  Status death_status() const;

  Result<std::string> call(const std::string& request, Deadline deadline);
  Status notify(const std::string& message);
  Result<RegionGrant> query_region(uint32_t region, Deadline deadline);
  // Shuts the socket down; pending requests fail with kUnavailable.
  void close();

 private:
  struct Pending {
    bool done = false;
    Status status;
    std::string payload;
    uint64_t length = 0;
    uint16_t flags = 0;
    UniqueFd fd;
  };

  ControlChannel(UniqueFd fd, bool unix_socket, AgentMetadata peer, DeathHandler on_death);
  void reader_loop();
  Result<Pending> request(uint16_t type, uint32_t region, const std::string& payload,
                          Deadline deadline);

  UniqueFd fd_;
  const bool unix_socket_;
  const AgentMetadata peer_;
  DeathHandler on_death_;
  std::atomic<bool> alive_{true};
  std::atomic<uint64_t> next_id_{1};
  std::mutex send_mu_;  // serialises frames written to fd_
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Pending> pending_;  // guarded by mu_
  Status death_;                         // guarded by mu_
  std::thread reader_;
};

}  // namespace ecx::transfer
