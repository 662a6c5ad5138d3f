// The one data-path interface every backend implements (shm, tcp, ucx), and the
// per-agent engine that opens a data path to a peer. The agent chooses an engine per
// peer and then only talks to these interfaces: it never branches on the backend.
//
//   BackendEngine (one per backend per agent): what the backend adds to the agent's
//     metadata and regions, the memory it carries, whether it reaches a peer, how its
//     control connection is dialled, open() -> DataPath, and the frames the agent's
//     server answers for its peers (its serving side, frame_service.h).
//   DataPath (one per connected peer): submit a batch, optional zero-copy view, fail
//     everything when the peer dies.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "ecx/transfer/agent.h"
#include "transfer/frame_service.h"
#include "transfer/stats_counters.h"
#include "transfer/transfer_state.h"
#include "wire/socket.h"

namespace ecx::transfer {

class ControlChannel;
struct RegionEntry;

// Runs once when a batch completes, with its aggregate status; may replace it.
using TransferFinalizer = std::function<Status(const Status&)>;

class DataPath {
 public:
  virtual ~DataPath() = default;

  // Starts a batch (READ, or WRITE when `write`) of descriptors the agent has checked
  // (non-null, non-empty, inside the regions the peer announced). The returned state
  // completes once every byte has moved or the batch failed; the deadline bounds it.
  // Once it completes, no byte of the batch lands in local memory any more.
  virtual std::shared_ptr<TransferState> submit(std::span<const TransferDescriptor> descriptors,
                                                bool write, Deadline deadline,
                                                std::string description,
                                                TransferFinalizer finalizer) = 0;
  // A zero-copy read-only view of the peer's bytes; only where the backend maps them.
  virtual Result<RemoteView> view(uint32_t /*region*/, uint64_t /*offset*/, uint64_t /*length*/,
                                  const Capability& /*capability*/, Deadline /*deadline*/) {
    return Status(StatusCode::kFailedPrecondition, "a zero-copy view needs the shm backend, not " +
                                                       std::string(backend_name(kind())));
  }
  // The backend this path belongs to.
  virtual Backend kind() const = 0;
  // The peer died: in-flight and later batches fail with `reason`.
  virtual void fail_all(const Status& reason) = 0;
};

// A control connection, connected, not yet shaken hands.
struct ControlSocket {
  UniqueFd fd;
  bool unix_socket = false;  // file descriptors can come over it
};

// What an engine needs to open a data path to one peer.
struct PeerLink {
  const AgentConfig* config = nullptr;
  bool same_host = false;                   // the peer runs on this host
  AgentMetadata self;                       // this agent, as announced to the peer
  AgentMetadata peer;                       // the peer, as it answered the handshake
  std::shared_ptr<ControlChannel> control;  // already shaken hands
  StatsCounters* stats = nullptr;
};

class BackendEngine {
 public:
  virtual ~BackendEngine() = default;

  virtual Backend kind() const = 0;
  // Whether this backend can reach `peer` (which is on this host when `same_host`).
  virtual bool reaches(const AgentMetadata& peer, bool same_host) const = 0;
  // Whether its data paths carry memory of `kind` (host memory: every backend).
  virtual bool carries(MemoryKind kind) const { return kind == MemoryKind::kHost; }
  // The control connection to `peer`, connected (not yet shaken hands): over the peer's
  // unix socket (dial_unix_control: same host, and it passes file descriptors) or its
  // tcp port (dial_tcp_control).
  virtual Result<ControlSocket> dial_control(const AgentMetadata& peer, bool same_host,
                                             Deadline deadline) const = 0;
  virtual Result<std::shared_ptr<DataPath>> open(PeerLink link, Deadline deadline) = 0;
  // Adds the frames its peers' data paths send to this agent's server.
  virtual void add_services(FrameServices& /*services*/, const ServeContext& /*context*/) {}

  // Adds this backend's endpoints to the agent's metadata.
  virtual void describe(AgentMetadata& /*self*/) const {}
  // Prepares a new local region for this backend (e.g. registers it with the NIC).
  virtual Status register_region(RegionEntry& /*region*/) { return Status::Ok(); }
  // Stops the engine's threads; data paths it opened are gone by then.
  virtual void stop() {}
};

// The peer's listeners, as its metadata announces them (Server::describe).
Result<ControlSocket> dial_unix_control(const AgentMetadata& peer, Deadline deadline);
Result<ControlSocket> dial_tcp_control(const AgentMetadata& peer, Deadline deadline);

}  // namespace ecx::transfer
