// The serving side of the backends: the data frames a peer sends this agent's server (on
// the connection it shook hands on) and who answers them. The server (server.cc) owns
// the listeners, the handshake, calls and notifications, and knows no backend: each
// backend engine adds the frames its peers' data paths send (BackendEngine::add_services).
//   streams (tcp; and the same-host WRITEs of shm): READ and WRITE, the bytes on the
//     connection itself (add_stream_service);
//   shm and ucx: REGION_QUERY, a region's size and access with, for shm over the unix
//     socket, its memfd, and for ucx its registration data (add_region_query_service).
#pragma once

#include <atomic>
#include <functional>
#include <map>

#include "ecx/transfer/agent.h"
#include "transfer/memory.h"
#include "transfer/serve_io.h"
#include "transfer/stats_counters.h"
#include "wire/wire.h"

namespace ecx::transfer {

// How long a reply (not a READ's data) may take to go out.
constexpr int64_t kServeReplyTimeoutMs = 30000;

// One request frame, as the server read it.
struct ServedFrame {
  int fd = -1;
  bool unix_socket = false;
  const Caller* caller = nullptr;  // authenticated by the handshake
  const FrameHeader* header = nullptr;
  const Capability* capability = nullptr;  // the frame's payload, when it is one
};
// Answers one frame; false when the connection must close.
using FrameHandler = std::function<bool(const ServedFrame&)>;
using FrameServices = std::map<FrameType, FrameHandler>;

// What a service may use; lives as long as the agent.
struct ServeContext {
  const AgentConfig* config = nullptr;
  RegionTable* regions = nullptr;
  StatsCounters* stats = nullptr;
  // How READ replies go out (serve_io.h; a test's seam), read at each reply.
  const std::atomic<ServeIo*>* io = nullptr;
};

// READ and WRITE on a stream; a frame type already served is left as it is.
void add_stream_service(FrameServices& services, const ServeContext& context);
// REGION_QUERY; likewise.
void add_region_query_service(FrameServices& services, const ServeContext& context);

}  // namespace ecx::transfer
