// What `ecx bench epd` and `ecx eval` share: a stack (proxy + E + PD; PD alone for
// `local`) per connector, and a Redis for the store connector when none is running.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ecx/common/status.h"
#include "ecx/common/subprocess.h"

namespace ecx::bench {

// A service process, stopped (SIGTERM, then SIGKILL) when this goes.
struct Proc {
  std::optional<Subprocess> p;
  std::string url;
  ~Proc();
};

struct StackProcs {
  Proc e, pd, proxy;
};

// Starts proxy + E + PD (PD alone for local) for `connector` ("p2p", "p2p:push", "disk",
// "store", "local", ...), on free loopback ports, with a secret of their own.
Status start_stack(const std::string& connector, const std::string& pool_bytes,
                   const std::string& redis, const std::filesystem::path& dir, StackProcs& s);

// A Redis for the store connector: the one at `address` if it answers PING, else a
// redis-server of our own on a free loopback port (stopped with this object).
class RedisForBench {
 public:
  static Result<RedisForBench> ensure(const std::string& address, const std::filesystem::path& dir);
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
