// The producer side of `ecx bench transfer` (and of the multi-process tests): a separate
// process with an agent, a source region filled with a known pattern, a writable sink
// region, and a plain-socket baseline server. It prints one JSON line describing itself
// on stdout ({"metadata","host","baseline_port",...}), then serves until its stdin closes.
//
// CALL requests it answers (JSON):
//   {"op":"connect","metadata":"...","backend":"tcp"}      connect back to the caller
//   {"op":"push","peer":"...","items":[{"src","dst_region","dst","len"}]}  WRITE into caller
//   {"op":"addr","item":i,"size":n}                         -> {"region","offset","length"}
//   {"op":"checksum","region":r,"offset":o,"length":n}     -> {"checksum":x}
//   {"op":"notified"}                                       -> {"ok":k,"bad":b}
//   {"op":"stats"}                               -> {"rejected_requests",...} of its agent
// A notification {"region","offset","length","checksum"} is checked against the bytes
// that are in the region when it arrives (notifications must follow their data).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace ecx::transfer {
class Agent;
}  // namespace ecx::transfer

namespace ecx::bench {

// The producer's options, one flag each (`transfer_peer_command` spells them); the bench
// and the multi-process tests both start the producer from this struct.
struct TransferPeerOptions {
  std::string name = "bench-producer";
  std::string compat_hash = "ecx";
  uint64_t region_bytes = 128ull << 20;
  uint64_t seed = 42;
  uint64_t tcp_slice_bytes = 4ull << 20;
  int tcp_streams = 2;
  // Where its agent and baseline server listen; an address other than loopback needs a
  // deployment secret, read from `auth_token_file` (mode 600).
  std::string tcp_host = "127.0.0.1";
  std::string auth_token_file;
  std::string ucx;                      // "" = ucx off; else UcxConfig.tls ("tcp", ...)
  std::string ucx_error_mode = "auto";  // UcxConfig.error_mode
  std::string ucx_library = "system";   // UcxConfig.library
  // Where the source region lives: "host" (an agent arena) or "cuda" (device memory,
  // registered as MemoryKind::kCuda; needs ucx with CUDA support, e.g. library "wheel").
  std::string memory = "host";
};

// The command line that starts a producer with `options`, `exe` being the ecx binary.
inline std::vector<std::string> transfer_peer_command(const std::string& exe,
                                                      const TransferPeerOptions& options) {
  std::vector<std::string> argv = {exe, "bench", "transfer-peer"};
  auto flag = [&argv](const char* name, std::string value) {
    argv.push_back(name);
    argv.push_back(std::move(value));
  };
  flag("--name", options.name);
  flag("--compat-hash", options.compat_hash);
  flag("--region-bytes", std::to_string(options.region_bytes));
  flag("--seed", std::to_string(options.seed));
  flag("--slice-bytes", std::to_string(options.tcp_slice_bytes));
  flag("--streams", std::to_string(options.tcp_streams));
  if (options.tcp_host != "127.0.0.1") flag("--tcp-host", options.tcp_host);
  if (!options.auth_token_file.empty()) flag("--auth-token-file", options.auth_token_file);
  if (!options.ucx.empty()) {
    flag("--ucx", options.ucx);
    flag("--ucx-error-mode", options.ucx_error_mode);
    flag("--ucx-library", options.ucx_library);
  }
  if (options.memory != "host") flag("--memory", options.memory);
  return argv;
}

// The flags of `ecx bench transfer-peer`, one per option, added to `app`.
void add_transfer_peer_flags(CLI::App& app, TransferPeerOptions& options);

// Runs the producer until its stdin closes; the exit code. `prepare`, when given, sees
// the agent before it serves anyone (the tests' misbehaving peer installs its ServeIo).
int run_transfer_peer(const TransferPeerOptions& options,
                      const std::function<void(transfer::Agent&)>& prepare = {});

}  // namespace ecx::bench
