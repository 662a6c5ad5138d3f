// `ecx relay --echo` and `ecx relay --probe`: a TCP ping-pong that measures the round
// trip between two test hosts (scripts/hosts probe).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "ecx/common/log.h"
#include "relay.h"
#include "wire/socket.h"

namespace ecx::relay {
namespace {

using transfer::UniqueFd;

constexpr int64_t kIoTimeoutMs = 10000;

// Sends back whatever arrives until the peer closes or goes quiet for kIoTimeoutMs.
void echo_connection(int fd) {
  set_nodelay(fd);
  std::vector<std::byte> buf(64 << 10);
  while (true) {
    size_t got = 0;
    Status s =
        transfer::recv_all(fd, buf.data(), 1, Deadline::after_ms(kIoTimeoutMs), "echo", &got);
    if (!s.ok()) return;
    ssize_t more = ::recv(fd, buf.data() + 1, buf.size() - 1, MSG_DONTWAIT);
    size_t n = 1 + static_cast<size_t>(std::max<ssize_t>(more, 0));
    if (!transfer::send_all(fd, buf.data(), n, Deadline::after_ms(kIoTimeoutMs), "echo").ok()) {
      return;
    }
  }
}

double percentile(const std::vector<double>& sorted, double p) {
  size_t i = static_cast<size_t>(p * static_cast<double>(sorted.size() - 1) + 0.5);
  return sorted[std::min(i, sorted.size() - 1)];
}

}  // namespace

Status run_echo(const std::string& listen, bool once) {
  ECX_ASSIGN_OR_RETURN(transfer::HostPort hp, transfer::parse_host_port(listen));
  ECX_ASSIGN_OR_RETURN(auto listening, transfer::listen_tcp(hp.host, hp.port));
  std::printf("ecx relay: echo on %s:%u\n", hp.host.c_str(), unsigned(listening.second));
  std::fflush(stdout);
  while (true) {
    ECX_ASSIGN_OR_RETURN(UniqueFd conn, transfer::accept_connection(listening.first.get()));
    if (!conn.valid()) return Status::Ok();
    echo_connection(conn.get());
    if (once) return Status::Ok();
  }
}

Status run_probe(const std::string& target, int count, size_t message_bytes, bool json) {
  if (count < 1 || count > 100000) return InvalidArgument("--count must be in 1..100000");
  if (message_bytes < 1 || message_bytes > (1u << 20)) {
    return InvalidArgument("--bytes must be in 1..1048576");
  }
  ECX_ASSIGN_OR_RETURN(transfer::HostPort hp, transfer::parse_host_port(target));
  ECX_ASSIGN_OR_RETURN(UniqueFd fd, transfer::connect_tcp(hp, Deadline::after_ms(kIoTimeoutMs)));
  set_nodelay(fd.get());
  std::vector<std::byte> out(message_bytes, std::byte{0x5a}), in(message_bytes);
  std::vector<double> rtts_ms;
  // The first round trip also pays for the relay's onward connect: not counted.
  for (int i = 0; i <= count; ++i) {
    auto t0 = Clock::now();
    Deadline deadline = Deadline::after_ms(kIoTimeoutMs);
    ECX_RETURN_IF_ERROR(transfer::send_all(fd.get(), out.data(), out.size(), deadline, "probe"));
    ECX_RETURN_IF_ERROR(transfer::recv_all(fd.get(), in.data(), in.size(), deadline, "probe echo"));
    if (in != out) return Status(StatusCode::kDataLoss, "probe: the echo differs from the message");
    if (i > 0) {
      rtts_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  std::sort(rtts_ms.begin(), rtts_ms.end());
  double median = percentile(rtts_ms, 0.5), p90 = percentile(rtts_ms, 0.9);
  if (json) {
    nlohmann::json j = {{"target", target},        {"round_trips", count},
                        {"bytes", message_bytes},  {"min_ms", rtts_ms.front()},
                        {"median_ms", median},     {"p90_ms", p90},
                        {"max_ms", rtts_ms.back()}};
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf(
        "probe %s: %d round trips of %zu bytes: rtt min %.3f ms, median %.3f ms, p90 %.3f ms, "
        "max %.3f ms\n",
        target.c_str(), count, message_bytes, rtts_ms.front(), median, p90, rtts_ms.back());
  }
  return Status::Ok();
}

}  // namespace ecx::relay
