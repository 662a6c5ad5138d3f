// ServeIo: how an agent's transfer server puts the bytes of a READ reply on the wire. The
// one seam through which a test makes a server misbehave (a peer that hangs mid-reply),
// in the manner of LevelDB's Env: production code calls the interface, whose standard
// implementation is the real one, and a test wraps it. Nothing test-specific lives here;
// the faulty implementations are in tests/support/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/transfer/agent.h"

namespace ecx::transfer {

class ServeIo {
 public:
  virtual ~ServeIo() = default;
  // Sends the `length` bytes at `src` on `fd` by `deadline` (after the reply's header).
  virtual Status send_read_data(int fd, const std::byte* src, uint64_t length, Deadline deadline);
  // The implementation every agent starts with.
  static ServeIo& standard();
};

// Makes `agent` (one made by Agent::create) serve READ replies through `io`, from the
// next request on. `io` must outlive the agent.
void set_serve_io(Agent& agent, ServeIo& io);

}  // namespace ecx::transfer
