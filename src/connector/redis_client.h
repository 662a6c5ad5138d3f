// A small pool of hiredis connections with timeouts. hiredis contexts are not
// thread-safe; each command borrows one.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/common/status.h"

struct redisContext;

namespace ecx::connector {

class RedisClient {
 public:
  // address "host:port".
  static Result<std::unique_ptr<RedisClient>> connect(const std::string& address,
                                                      Deadline deadline);
  ~RedisClient();

  Status set(const std::string& key, std::string_view value, int64_t ttl_s, Deadline deadline);
  // The value, or kNotFound.
  Result<std::string> get(const std::string& key, Deadline deadline);
  Status del(const std::string& key, Deadline deadline);
  Result<bool> exists(const std::string& key, Deadline deadline);

 private:
  RedisClient(std::string host, int port) : host_(std::move(host)), port_(port) {}
  Result<redisContext*> acquire(Deadline deadline);
  void give_back(redisContext* c, bool healthy);

  const std::string host_;
  const int port_;
  Mutex mu_;
  std::vector<redisContext*> idle_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::connector
