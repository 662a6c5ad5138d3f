// What `ecx bench epd` and `ecx eval` share: a stack (proxy + E + PD; PD alone for
// `local`) per connector, and a Redis for the store connector when none is running.
// A stack may hold several E and PD instances, and may run in the test hosts of
// `scripts/hosts` (network namespaces), one service per host.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/common/subprocess.h"
#include "ecx/serve/services.h"

namespace ecx::bench {

// A service process, stopped (SIGTERM, then SIGKILL) when this goes.
struct Proc {
  std::optional<Subprocess> p;
  std::string url;
  ~Proc();
};

struct StackProcs {
  // Declared first, so it outlives the services it was given to.
  std::optional<serve::StackSecret> secret;
  std::vector<std::unique_ptr<Proc>> encoders, pds;
  Proc proxy;
  const Proc& e() const { return *encoders.at(0); }
  const Proc& pd() const { return *pds.at(0); }
};

// How many instances, and where.
struct StackLayout {
  int encoders = 1;
  int pds = 1;
  // Network namespaces (scripts/hosts) to run in: the proxy on the first, then each E and
  // each PD on the next host, round robin over the others. Empty: all on loopback.
  std::vector<std::string> hosts;
  // Merged into every service's connector config "extra" (e.g. {"ucx": true}).
  std::string extra_json;
  std::string encoder_routing = "content";  // the proxy's --encoder-routing
};

// Starts proxy + E + PD (PD alone for local) for `connector` ("p2p", "p2p:push", "disk",
// "store", "local", ...), on free ports, with a secret of their own.
Status start_stack(const std::string& connector, const std::string& pool_bytes,
                   const std::string& redis, const std::filesystem::path& dir, StackProcs& s,
                   const StackLayout& layout = {});

// A Redis for the store connector: the one at `address` if it answers PING, else a
// redis-server of our own on a free loopback port (stopped with this object).
class RedisForBench {
 public:
  // With `netns`, a server of our own runs in that network namespace, on its address.
  static Result<RedisForBench> ensure(const std::string& address, const std::filesystem::path& dir,
                                      const std::string& netns = "");
  RedisForBench(RedisForBench&&) = default;
  RedisForBench& operator=(RedisForBench&&) = default;
  ~RedisForBench();

  const std::string& address() const { return address_; }
  bool started_here() const { return server_ != nullptr; }

 private:
  RedisForBench() = default;
  std::string address_;
  std::unique_ptr<Subprocess> server_;  // ours, when we started one
};

// Whether a Redis at "host:port" answers PING within `timeout_ms`.
bool redis_answers(const std::string& address, int64_t timeout_ms);

}  // namespace ecx::bench
