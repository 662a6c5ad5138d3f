#include "connector/redis_client.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include "wire/socket.h"

namespace ecx::connector {
namespace {

timeval to_timeval(Deadline deadline) {
  auto ns = deadline.is_never() ? int64_t{30'000'000'000} : deadline.remaining().count();
  if (ns < 1000) ns = 1000;
  return timeval{static_cast<time_t>(ns / 1'000'000'000),
                 static_cast<suseconds_t>((ns % 1'000'000'000) / 1000)};
}

}  // namespace

Result<std::unique_ptr<RedisClient>> RedisClient::connect(const std::string& address,
                                                          Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(auto hp, transfer::parse_host_port(address));
  std::unique_ptr<RedisClient> client(new RedisClient(hp.host, hp.port));
  ECX_ASSIGN_OR_RETURN(redisContext * c, client->acquire(deadline));  // fail fast if Redis is down
  client->give_back(c, true);
  return client;
}

RedisClient::~RedisClient() {
  for (redisContext* c : idle_) redisFree(c);
}

Result<redisContext*> RedisClient::acquire(Deadline deadline) {
  {
    MutexLock lock(&mu_);
    if (!idle_.empty()) {
      redisContext* c = idle_.back();
      idle_.pop_back();
      timeval tv = to_timeval(deadline);
      redisSetTimeout(c, tv);
      return c;
    }
  }
  timeval tv = to_timeval(deadline);
  redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, tv);
  if (c == nullptr)
    return Unavailable("redis " + host_ + ":" + std::to_string(port_) + ": out of memory");
  if (c->err) {
    std::string why = c->errstr;
    redisFree(c);
    return Unavailable("redis " + host_ + ":" + std::to_string(port_) + ": " + why);
  }
  redisSetTimeout(c, tv);
  return c;
}

void RedisClient::give_back(redisContext* c, bool healthy) {
  if (!healthy || c->err) {
    redisFree(c);
    return;
  }
  MutexLock lock(&mu_);
  idle_.push_back(c);
}

namespace {

// Runs one command; returns the reply (owned) or the error. Frees broken contexts.
struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

}  // namespace

#define ECX_REDIS_COMMAND(reply_var, deadline, ...)                                        \
  ECX_ASSIGN_OR_RETURN(redisContext* ctx_, acquire(deadline));                             \
  ReplyPtr reply_var(static_cast<redisReply*>(redisCommand(ctx_, __VA_ARGS__)));           \
  if (!reply_var) {                                                                        \
    std::string why = ctx_->errstr;                                                        \
    bool timeout = ctx_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK); \
    give_back(ctx_, false);                                                                \
    return Status(timeout ? StatusCode::kDeadlineExceeded : StatusCode::kUnavailable,      \
                  "redis " + host_ + ":" + std::to_string(port_) + ": " + why);            \
  }                                                                                        \
  give_back(ctx_, true);                                                                   \
  if (reply_var->type == REDIS_REPLY_ERROR) {                                              \
    return Internal("redis error: " + std::string(reply_var->str, reply_var->len));        \
  }

Status RedisClient::set(const std::string& key, std::string_view value, int64_t ttl_s,
                        Deadline deadline) {
  ECX_REDIS_COMMAND(reply, deadline, "SET %b %b EX %lld", key.data(), key.size(), value.data(),
                    value.size(), static_cast<long long>(ttl_s));
  return Status::Ok();
}

Result<std::string> RedisClient::get(const std::string& key, Deadline deadline) {
  ECX_REDIS_COMMAND(reply, deadline, "GET %b", key.data(), key.size());
  if (reply->type == REDIS_REPLY_NIL) return NotFound("redis has no key " + key);
  if (reply->type != REDIS_REPLY_STRING)
    return Internal("redis GET " + key + ": unexpected reply type");
  return std::string(reply->str, reply->len);
}

Status RedisClient::del(const std::string& key, Deadline deadline) {
  ECX_REDIS_COMMAND(reply, deadline, "DEL %b", key.data(), key.size());
  return Status::Ok();
}

Result<bool> RedisClient::exists(const std::string& key, Deadline deadline) {
  ECX_REDIS_COMMAND(reply, deadline, "EXISTS %b", key.data(), key.size());
  return reply->type == REDIS_REPLY_INTEGER && reply->integer > 0;
}

}  // namespace ecx::connector
