// AgentMetadata: everything a peer needs to reach an agent, as one JSON string.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/transfer/types.h"

namespace ecx::transfer {

struct RegionInfo {
  uint32_t id = 0;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  bool remote_write = false;
  bool shareable = false;  // memfd-backed: can be mapped by a same-host peer
  // Per backend, what a peer needs to reach the region over it (the ucx backend: the
  // region's address and packed memory key), opaque to all but that backend. Only for
  // regions any peer may reach: one that requires a grant hands its own out for a
  // capability (a region query).
  std::map<Backend, std::string> backend_data;

  // This region's data for `backend`; empty when it has none.
  const std::string& data_for(Backend backend) const;
  friend bool operator==(const RegionInfo&, const RegionInfo&) = default;
};

struct AgentMetadata {
  std::string name;
  uint32_t protocol_version = 0;
  std::string compat_hash;
  std::string host_id;  // same value <=> same host (boot id, hostname, net namespace)
  // Per backend, how to reach this agent over it, opaque to all but that backend (shm:
  // an abstract unix socket name; tcp: "host:port"; ucx: the worker address in hex).
  // A backend that is off has none.
  std::map<Backend, std::string> endpoints;
  std::vector<RegionInfo> regions;
  // Sent only in the handshake, never published: a random value of the agent's process
  // (hex), bound to its proof of the secret. With the name it is the peer's identity
  // (holder()), by which a server keys the grants and pins it hands that peer.
  std::string session;

  // "name#session": who holds a peer's grants and pins. A peer that declares another's
  // name does not know its session, so it cannot take or end what that one holds.
  std::string holder() const { return name + "#" + session; }
  // The endpoint for `backend`; empty when it has none.
  const std::string& endpoint(Backend backend) const;
  std::string to_json() const;
  // Parses and validates untrusted text: types, sizes, counts, ports. Never throws.
  static Result<AgentMetadata> parse(std::string_view json);

  friend bool operator==(const AgentMetadata&, const AgentMetadata&) = default;
};

// The host id of this machine and network namespace (whether shm can reach a peer).
std::string local_host_id();

}  // namespace ecx::transfer
