#include "ucx_perftest.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <vector>

#include "ecx/common/subprocess.h"
#include "wire/socket.h"

namespace ecx::bench {
namespace {

// A free loopback port, for the server to listen on. Another process may take it before
// the server does: the caller retries with a new one.
Result<uint16_t> free_port() {
  ECX_ASSIGN_OR_RETURN(auto listener, transfer::listen_tcp("127.0.0.1", 0));
  return listener.second;
}

// `argv` under `env UCX_TLS=...` and `timeout`, so the process sees the transports and
// ends by itself even if the bench dies. `line_buffered`: its stdout is a pipe, and the
// server's "Waiting for connection..." line must arrive before it exits.
std::vector<std::string> wrapped(const UcxPerftestOptions& options, bool line_buffered,
                                 std::vector<std::string> argv) {
  std::vector<std::string> out = {"/usr/bin/env"};
  if (!options.tls.empty()) out.push_back("UCX_TLS=" + options.tls);
  if (line_buffered) out.insert(out.end(), {"stdbuf", "-oL"});
  out.insert(out.end(), {"timeout", std::to_string(options.timeout_s)});
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

// Stops a child still running (SIGTERM: `timeout` passes it on to ucx_perftest).
void stop(Subprocess& child) {
  if (child.wait(Deadline::after_ms(5000)).ok()) return;
  (void)child.kill(SIGTERM);
  (void)child.wait(Deadline::after_ms(5000));  // the destructor SIGKILLs a survivor
}

// Starts the server; returns it once it listens on `port`.
Result<Subprocess> start_server(const UcxPerftestOptions& options, const std::string& binary,
                                uint16_t port) {
  ECX_ASSIGN_OR_RETURN(
      auto server, Subprocess::spawn(wrapped(options, true, {binary, "-p", std::to_string(port)})));
  auto deadline = Deadline::after_ms(10000);
  while (true) {
    auto line = server.read_line(deadline);
    if (!line.ok()) {
      return line.status().with_context("ucx_perftest server on port " + std::to_string(port));
    }
    if (line->find("Waiting for connection") != std::string::npos) return server;
  }
}

}  // namespace

Result<std::string> find_ucx_perftest(const std::string& binary) {
  if (binary.find('/') != std::string::npos) {
    if (::access(binary.c_str(), X_OK) == 0) return binary;
    return NotFound(binary + " is not an executable");
  }
  const char* path = std::getenv("PATH");  // the bench's own command line environment
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + binary;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return NotFound(binary + " is not on PATH (Debian package ucx-utils)");
}

Result<UcxPerftestResult> parse_ucx_perftest_line(std::string_view line) {
  std::istringstream in{std::string(line)};
  std::vector<double> fields;
  double v = 0;
  while (in >> v) fields.push_back(v);
  if (!in.eof() || fields.size() != 8) {
    return InvalidArgument("not a ucx_perftest -f line: '" + std::string(line) + "'");
  }
  constexpr double kMiB = 1024.0 * 1024.0;
  return UcxPerftestResult{.p50_us = fields[1], .gbps = fields[5] * kMiB / 1e9};
}

Result<UcxPerftestResult> run_ucx_perftest(const UcxPerftestOptions& options) {
  ECX_ASSIGN_OR_RETURN(std::string binary, find_ucx_perftest(options.binary));
  std::optional<Subprocess> server;
  uint16_t port = 0;
  Status started;
  for (int attempt = 0; attempt < 3 && !server; ++attempt) {
    ECX_ASSIGN_OR_RETURN(port, free_port());
    auto s = start_server(options, binary, port);
    if (s.ok()) {
      server.emplace(std::move(*s));
    } else {
      started = s.status();
    }
  }
  if (!server) return started;

  std::vector<std::string> argv = {binary, "127.0.0.1",
                                   "-p",   std::to_string(port),
                                   "-t",   "ucp_get",
                                   "-s",   std::to_string(options.size),
                                   "-n",   std::to_string(options.iters),
                                   "-w",   std::to_string(options.warmup),
                                   "-f"};
  if (options.error_handling) argv.push_back("-e");
  ECX_ASSIGN_OR_RETURN(auto client, Subprocess::spawn(wrapped(options, false, argv)));
  auto deadline = Deadline::after_ms(static_cast<int64_t>(options.timeout_s) * 1000);
  std::optional<UcxPerftestResult> result;
  std::string last;
  while (true) {
    auto line = client.read_line(deadline);
    if (!line.ok()) break;  // end of output, or the deadline (then `timeout` ends it)
    if (auto parsed = parse_ucx_perftest_line(*line); parsed.ok()) result = *parsed;
    if (!line->empty()) last = *line;
  }
  auto code = client.wait(Deadline::after_ms(10000));
  stop(*server);
  std::string what =
      "ucx_perftest -t ucp_get -s " + std::to_string(options.size) + " with UCX_TLS=" + options.tls;
  if (!code.ok()) return code.status().with_context(what);
  if (*code != 0) return Internal(what + ": exit code " + std::to_string(*code) + " " + last);
  if (!result) return Internal(what + ": no result line (last line: '" + last + "')");
  return *result;
}

}  // namespace ecx::bench
