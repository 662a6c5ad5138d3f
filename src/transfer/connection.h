// Client side of an agent connection: the handshake, and ControlChannel, which carries
// CALL / NOTIFY / REGION_QUERY to one peer and detects the peer's death.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/common/status.h"
#include "ecx/transfer/metadata.h"
#include "wire/socket.h"

namespace ecx::transfer {

// HELLO flag: this connection carries data only (no peer-gone event when it closes).
constexpr uint16_t kHelloDataConnection = 1;

// Checks that `peer` can talk to an agent with `self`'s version and compatibility hash.
// The messages name both agents and both values (for this process's own log: a server
// answers a peer with server_refusal instead, which does not reveal its hash).
Status check_compatible(const AgentMetadata& self, const AgentMetadata& peer);

// The handshake (protocol version 2): the server sends CHALLENGE(32-byte nonce); the
// client answers HELLO(client nonce | HMAC_secret("client", both nonces, metadata) |
// metadata JSON); the server verifies it and answers HELLO_OK(HMAC_secret("server", both
// nonces, its metadata) | its metadata JSON), which the client verifies. Both sides
// prove they hold the deployment secret without sending it, and each side's metadata is
// bound to the proof. Authentication comes before the compatibility check, so an
// outsider learns nothing about the deployment.
constexpr size_t kNonceBytes = 32;

// Client side, on a connected socket. Returns the peer's metadata as it answered
// (current regions). kPermissionDenied when either side's proof fails.
Result<AgentMetadata> client_handshake(int fd, const AgentMetadata& self, const std::string& secret,
                                       uint16_t flags, Deadline deadline);

struct AcceptedPeer {
  AgentMetadata metadata;
  uint16_t flags = 0;  // HELLO flags (kHelloDataConnection)
};
// Server side: challenges, verifies the client's proof and compatibility, answers. On
// failure the client gets an ERROR frame that reveals neither the secret nor our hash,
// and `refused` (if set) is counted before it is sent. `admit` (if set) is asked last,
// before the answer: a peer it refuses gets its status as an ERROR frame, so a peer whose
// handshake succeeded has already been counted by the server.
Result<AcceptedPeer> server_handshake(int fd, const AgentMetadata& self, const std::string& secret,
                                      Deadline deadline, std::atomic<uint64_t>* refused = nullptr,
                                      const std::function<Status()>& admit = {});

struct RegionGrant {
  uint64_t length = 0;
  bool remote_write = false;
  bool remote_read = false;
  UniqueFd memfd;  // set when the region was passed over a unix socket
  // Set when asked for (query_region's `backend_data`) and the region has some.
  std::string backend_data;
};

class ControlChannel {
 public:
  using DeathHandler = std::function<void(const Status&)>;

  // Takes a connected socket, shakes hands and starts the reader thread. `on_death` runs
  // once, on the reader thread, when the peer closes or the socket fails. A caller polls
  // for its reply for `reply_spin` before it sleeps (AgentConfig::reply_spin_us).
  static Result<std::unique_ptr<ControlChannel>> open(UniqueFd fd, bool unix_socket,
                                                      const AgentMetadata& self,
                                                      const std::string& secret, Deadline deadline,
                                                      DeathHandler on_death,
                                                      std::chrono::microseconds reply_spin = {});
  ~ControlChannel();

  const AgentMetadata& peer() const { return peer_; }
  bool alive() const { return alive_.load(std::memory_order_acquire); }
  // Like alive(), but also asks the kernel whether the peer has hung up, so a death is
  // seen at once even before the reader thread wakes (one poll(2), no blocking).
  bool alive_now() const;
  // The reason the channel died (ok while alive).
  Status death_status() const ECX_EXCLUDES(mu_);

  Result<std::string> call(const std::string& request, Deadline deadline) ECX_EXCLUDES(mu_);
  Status notify(const std::string& message) ECX_EXCLUDES(mu_, send_mu_);
  // Asks for a region's length and access (and, over unix, its memfd; or with
  // `backend_data`, that backend's data of the region), presenting `capability` for regions
  // that require a grant.
  Result<RegionGrant> query_region(uint32_t region, const Capability& capability, Deadline deadline,
                                   std::optional<Backend> backend_data = std::nullopt)
      ECX_EXCLUDES(mu_);
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

  ControlChannel(UniqueFd fd, bool unix_socket, AgentMetadata peer, DeathHandler on_death,
                 std::chrono::microseconds reply_spin);
  void reader_loop() ECX_EXCLUDES(mu_);
  // Polls until request `id` is answered, reply_spin_ has passed or the deadline comes;
  // `seen` is replies_ before its frame was sent.
  void poll_for_reply(uint64_t id, uint64_t seen, Deadline deadline) ECX_EXCLUDES(mu_);
  Result<Pending> request(uint16_t type, uint32_t region, const std::string& payload,
                          Deadline deadline, uint16_t flags = 0) ECX_EXCLUDES(mu_, send_mu_);
  // Whether a frame from the peer is a reply this channel can take.
  static bool is_reply(uint16_t type);

  UniqueFd fd_;
  const bool unix_socket_;
  const AgentMetadata peer_;
  DeathHandler on_death_;
  std::atomic<bool> alive_{true};
  std::atomic<uint64_t> next_id_{1};
  const std::chrono::microseconds reply_spin_;
  // Requests answered (or failed by the channel's death) so far: a polling caller looks
  // under mu_ only when it moves.
  std::atomic<uint64_t> replies_{0};
  Mutex send_mu_;  // serialises frames written to fd_
  mutable Mutex mu_;
  CondVar cv_;
  std::map<uint64_t, Pending> pending_ ECX_GUARDED_BY(mu_);
  Status death_ ECX_GUARDED_BY(mu_);
  std::thread reader_;
};

}  // namespace ecx::transfer
