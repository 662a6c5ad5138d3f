// ecx_fault_peer: the producer of `ecx bench transfer-peer`, misbehaving on purpose. A test
// binary, not part of `ecx`: the multi-process tests start it (PeerProcess with
// PeerFaults) to face a peer that sends part of a READ reply and then hangs.
//
//   ecx_fault_peer --stall-read-after-bytes N [transfer-peer flags...]
#include <poll.h>

#include <CLI/CLI.hpp>

#include "transfer/serve_io.h"
#include "transfer_peer.h"
#include "wire/socket.h"

namespace {

// Sends the first `after` bytes of a longer reply, then holds the connection without
// sending more until the other side or the server's stop shuts it, or the reply's
// deadline passes: a peer that hangs mid-transfer.
class StallAfterBytes final : public ecx::transfer::ServeIo {
 public:
  explicit StallAfterBytes(uint64_t after) : after_(after) {}

  ecx::Status send_read_data(int fd, const std::byte* src, uint64_t length,
                             ecx::Deadline deadline) override {
    if (after_ == 0 || length <= after_) return ServeIo::send_read_data(fd, src, length, deadline);
    ecx::transfer::send_all(fd, src, after_, deadline, "send READ data").ignore_error();
    pollfd p{fd, POLLRDHUP, 0};
    while (!deadline.expired() && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) {
      ::poll(&p, 1, deadline.poll_timeout_ms());
    }
    return ecx::Unavailable("fault: stalled after " + std::to_string(after_) + " bytes");
  }

 private:
  const uint64_t after_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ecx_fault_peer: a transfer peer that stalls READ replies (tests only)"};
  ecx::bench::TransferPeerOptions options;
  ecx::bench::add_transfer_peer_flags(app, options);
  uint64_t stall_after = 0;
  app.add_option("--stall-read-after-bytes", stall_after,
                 "Send this many bytes of a longer READ reply, then hang")
      ->required();
  CLI11_PARSE(app, argc, argv);
  static StallAfterBytes io(stall_after);  // outlives the agent
  return ecx::bench::run_transfer_peer(
      options, [](ecx::transfer::Agent& agent) { ecx::transfer::set_serve_io(agent, io); });
}
