// Agent: one per process. Registers memory, describes itself as metadata, connects to
// peers once, and moves bytes with batched one-sided READ and WRITE.
//
//   auto agent = Agent::create({.name = "pd-0"}).value();
//   auto buf = agent->allocate(8 * kMiB).value();
//   agent->connect(producer_metadata, {}).ok();
//   TransferDescriptor d{buf.data, region_id, offset, length};
//   agent->read("e-0", {&d, 1}).value().wait(Deadline::after_ms(1000));
//
// Thread-safe: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/transfer/metadata.h"
#include "ecx/transfer/transfer_handle.h"
#include "ecx/transfer/types.h"

namespace ecx::transfer {

// The ucx backend: UCX's ucp API, loaded when the agent starts (docs/TRANSFER.md).
struct UcxConfig {
  // Off by default. On: `auto` picks shm on the same host, then ucx, then tcp. UCX's
  // one-sided reads are not checked per request by this agent (the NIC or UCX enforces
  // the memory key): enable it on a network you trust (docs/SECURITY.md).
  bool enable = false;
  // Which libucp: "system" (Debian's, 1.13: tcp, shared memory and RDMA verbs), "wheel"
  // (libucx-cu13 in the project's .venv, 1.22: tcp, shared memory and CUDA, no verbs),
  // or a path to a libucp.so. One per process: every agent of a process uses the first.
  std::string library = "system";
  // UCX_TLS for this agent ("" = UCX's choice), e.g. "tcp", "posix,cma", "rc,cuda_copy".
  std::string tls;
  // UCX endpoint error handling: "peer" (UCX reports a dead peer; tcp and RDMA only),
  // "none" (the agent's control connection does), or "auto": peer unless every
  // transport in `tls` is shared memory.
  std::string error_mode = "auto";
};

struct AgentConfig {
  std::string name;                    // unique among the agents that talk to each other
  std::string compat_hash = "ecx";     // peers with a different hash are refused
  bool enable_shm = true;              // listen on an abstract unix socket
  bool enable_tcp = true;              // listen on tcp_host:tcp_port
  std::string tcp_host = "127.0.0.1";  // the address tcp binds (0.0.0.0: every address)
  uint16_t tcp_port = 0;               // 0 = any free port
  // The address peers dial, published in this agent's metadata: empty means tcp_host.
  // Needed where tcp_host is not what peers reach: a wildcard bind (0.0.0.0) or a NAT.
  std::string tcp_advertise_host;
  uint64_t tcp_slice_bytes = 4 << 20;   // large reads/writes are split in slices this size...
  int tcp_streams = 2;                  // ...spread over this many connections per peer
  int tcp_socket_buffer = 4 << 20;      // SO_SNDBUF / SO_RCVBUF of data connections
  int64_t connect_timeout_ms = 5000;    // default deadline of connect()
  int64_t transfer_timeout_ms = 30000;  // default deadline of a READ/WRITE with none given
  // The deployment secret. Every handshake proves both sides know it (HMAC challenge-
  // response; it never crosses the wire). Empty: no secret, and the agent listens on
  // loopback only (tcp_host is forced to 127.0.0.1, with a warning).
  std::string auth_secret;
  // Served connections at once, per listener (unix, tcp); more are refused.
  int max_connections = 256;
  // Connections still shaking hands, per listener, counted apart from max_connections:
  // when they are all taken, the oldest is dropped for the newcomer, so peers that never
  // finish a handshake cannot keep the deployment's own agents out.
  int max_handshakes = 32;
  int64_t idle_timeout_ms = 60000;  // a served connection with no frame for this long closes
  // Longest one READ reply or one WRITE's data may take to move; a peer that stalls the
  // stream longer loses the connection (and the server thread is free again).
  int64_t data_timeout_ms = 30000;
  // A caller waiting for a same-host peer's control reply (a CALL, a region query) polls
  // for it this long before it sleeps. Such a reply lands in tens of microseconds, less
  // than a sleep and the wake-up after it cost on a busy or virtualised host (~35 us
  // measured here); a caller polls on its own core, never past its deadline. A peer on
  // another host answers later than that: its callers sleep at once. 0: sleep at once; at
  // most 10000.
  int64_t reply_spin_us = 50;
  UcxConfig ucx;  // the ucx backend (off unless ucx.enable)
};

struct ConnectOptions {
  Backend backend = Backend::kAuto;
  std::optional<Deadline> deadline;  // default: AgentConfig::connect_timeout_ms
  // Dialed by address: whoever answers there (having proved the deployment secret, as
  // every peer does) is taken, under the name `connect` was given, whatever its own
  // name. Otherwise an agent answering under another name is refused (stale metadata).
  bool any_name = false;
};

// A read-only view of a same-host peer's memory (shm backend). The mapping stays valid
// while the view lives, even if the peer dies; whether the bytes are still meaningful is
// for the layer above to decide (block generation checks).
struct RemoteView {
  const std::byte* data = nullptr;
  uint64_t length = 0;
  std::shared_ptr<const void> keepalive;
};

// Who sent a request: the agent name it declared (to address it back), and `holder`,
// the identity of its authenticated process ("name#session", AgentMetadata::holder()).
// Grants and pins handed to a caller are held by `holder`, never by a declared name.
struct Caller {
  std::string name;
  std::string holder;
};
// Serves CALL requests from peers: (caller, request) -> reply or error.
using CallHandler = std::function<Result<std::string>(const Caller&, std::string_view)>;
// Receives notifications on the connection's thread, in order with that peer's calls.
using NotificationHandler = std::function<void(Notification)>;
// Told when a peer that connected to this agent goes away (its process died or closed),
// with the peer's holder identity (Caller::holder).
using PeerGoneHandler = std::function<void(const std::string&)>;

class Agent {
 public:
  // Starts the listeners and returns a running agent. Fails on an empty name or when a
  // listener cannot be bound.
  static Result<std::unique_ptr<Agent>> create(AgentConfig config);
  virtual ~Agent() = default;

  virtual const std::string& name() const = 0;
  virtual const AgentConfig& config() const = 0;

  // Allocates `length` bytes of zeroed host memory in a memfd arena and registers it.
  // Same-host peers map it directly (shm); others reach it over tcp.
  virtual Result<LocalRegion> allocate(uint64_t length, RegionAccess access = {}) = 0;
  // Registers caller-owned memory. Only tcp peers can reach it (it is not a memfd).
  // REQUIRES: the memory outlives the registration; kind == kHost for now.
  virtual Result<LocalRegion> register_memory(void* data, uint64_t length, MemoryKind kind,
                                              RegionAccess access = {}) = 0;
  // Removes a region. Peers get kNotFound for it from now on. Memory from allocate() is
  // unmapped once no transfer uses it.
  virtual Status deregister(uint32_t region_id) = 0;

  // Lets peers reach [offset, offset + length) of a region with RegionAccess::require_grant:
  // READ (and WRITE when `write`) with the returned capability. `holder` empty: any
  // authenticated peer that presents it; else only the peer of that identity
  // (Caller::holder). Valid until revoke() or deregister(region).
  virtual Result<Capability> grant(uint32_t region_id, uint64_t offset, uint64_t length, bool write,
                                   const std::string& holder) = 0;
  // Ends a grant; later requests with it fail with kPermissionDenied. Idempotent.
  virtual void revoke(const Capability& capability) = 0;

  // This agent's metadata (endpoints and current regions).
  virtual AgentMetadata metadata() const = 0;

  // Connects to a peer (handshake, compatibility check) unless already connected.
  // Concurrent connects to one peer coalesce into one handshake. Returns the peer's
  // current metadata. Errors: kIncompatible naming both hashes, kVersionMismatch,
  // kUnavailable, kDeadlineExceeded.
  virtual Result<AgentMetadata> connect(const AgentMetadata& peer, ConnectOptions options = {}) = 0;
  // Drops the connection to a peer (a later connect makes a new one).
  virtual void disconnect(const std::string& peer) = 0;
  // The backend in use with a connected peer.
  virtual Result<Backend> peer_backend(const std::string& peer) const = 0;

  // Reads every descriptor from `peer` into local memory, as one batch. Descriptors are
  // validated before anything moves; errors name the descriptor, region and offsets.
  virtual Result<TransferHandle> read(const std::string& peer,
                                      std::span<const TransferDescriptor> descriptors,
                                      std::optional<Deadline> deadline = std::nullopt) = 0;
  // Writes every descriptor's local bytes into `peer`'s memory. If `notification` is set,
  // the peer receives it after all the data has landed.
  virtual Result<TransferHandle> write(const std::string& peer,
                                       std::span<const TransferDescriptor> descriptors,
                                       std::optional<std::string> notification = std::nullopt,
                                       std::optional<Deadline> deadline = std::nullopt) = 0;

  // One-way message to a connected peer.
  virtual Status notify(const std::string& peer, std::string message) = 0;
  // Request/response with a connected peer's CallHandler.
  virtual Result<std::string> call(const std::string& peer, std::string request,
                                   Deadline deadline) = 0;
  virtual void set_call_handler(CallHandler handler) = 0;
  virtual void set_peer_gone_handler(PeerGoneHandler handler) = 0;
  // With a handler set, notifications go to it (synchronously, in arrival order) instead
  // of the queue that wait_notification reads.
  virtual void set_notification_handler(NotificationHandler handler) = 0;
  // Next notification from any peer, or kDeadlineExceeded.
  virtual Result<Notification> wait_notification(Deadline deadline) = 0;

  // Zero-copy view of a same-host peer's region bytes (shm backend only). The first view
  // of a region that requires grants presents `capability` to get it mapped.
  virtual Result<RemoteView> view(const std::string& peer, uint32_t region, uint64_t offset,
                                  uint64_t length, const Capability& capability = {}) = 0;

  virtual AgentStats stats() const = 0;

  // Stops serving peers (listeners closed, handler threads joined) and drops every peer
  // connection. Local calls (allocate, deregister) keep working; connect fails after it.
  // Idempotent; the destructor calls it.
  virtual void shutdown() = 0;
};

}  // namespace ecx::transfer
