// `ecx relay`: a delaying TCP relay for test hosts in network namespaces (docs/HOSTS.md).
//
// It accepts connections that netfilter redirected to it (nft `redirect`), reads each
// one's original destination (SO_ORIGINAL_DST), connects onward, and copies both
// directions, holding every chunk `delay` after it arrived (the one-way delay; RTT/2).
// Each direction buffers at most `buffer_bytes`, then stops reading (backpressure). A
// side's EOF is passed on after its data (half-close); a reset or error closes both.
// One thread, epoll; stops on SIGTERM or SIGINT.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <string>

#include "ecx/common/status.h"

namespace CLI {
class App;
}

namespace ecx::relay {

struct RelayOptions {
  std::string listen = "0.0.0.0:7777";  // HOST:PORT the redirected connections arrive on
  std::chrono::nanoseconds delay{0};    // one-way delay of every byte and EOF
  size_t buffer_bytes = 8u << 20;       // per direction of a connection
  int max_connections = 8192;           // relayed at once; more are refused (closed)
};

// Serves until SIGTERM/SIGINT. Prints one line "ecx relay: listening on HOST:PORT ..."
// on stdout once it accepts connections (scripts wait for it).
Status run_relay(const RelayOptions& options);

// `ecx relay --echo`: echoes every connection's bytes back (the far end of a probe).
// Prints "ecx relay: echo on HOST:PORT" once listening; with `once`, exits after its
// first connection closes; else on SIGTERM/SIGINT.
Status run_echo(const std::string& listen, bool once);

// `ecx relay --probe HOST:PORT`: `count` round trips of `message_bytes` with an echo
// server; prints the RTT's min, median, p90 and max in milliseconds (one line, and
// JSON with `json`).
Status run_probe(const std::string& target, int count, size_t message_bytes, bool json);

// Adds `ecx relay` (the three modes above) to `app`.
void add_relay_command(CLI::App& app, int* exit_code);

// TCP_NODELAY on a relayed or probed connection: bytes go as they come.
inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace ecx::relay
