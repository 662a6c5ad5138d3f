#include "ecx/directory/registration.h"

#include <algorithm>

#include "ecx/common/log.h"

namespace ecx::directory {

Registration::Registration(EtcdClient client, std::string key, std::string value, int64_t ttl_s)
    : client_(std::move(client)),
      key_(std::move(key)),
      value_(std::move(value)),
      ttl_s_(std::max<int64_t>(ttl_s, 1)),
      interval_(std::max<int64_t>(ttl_s_ * 1000 / 3, 100)) {
  thread_ = std::thread([this] { run(); });
}

Registration::~Registration() { deregister(); }

bool Registration::wait_registered(Deadline deadline) {
  MutexLock lock(&mu_);
  return cv_.wait_until(&mu_, deadline.time_point(), [this]() ECX_REQUIRES(mu_) {
    return registered_ || stop_;
  }) && registered_;
}

void Registration::run() {
  MutexLock lock(&mu_);
  while (!stop_) {
    lock.unlock();
    Clock::time_point next = step();
    lock.lock();
    cv_.wait_until(&mu_, next, [this]() ECX_REQUIRES(mu_) { return stop_; });
  }
}

void Registration::unreachable(const Status& s) {
  if (!outage_) {
    spdlog::warn(
        "event=etcd_unreachable key={} error=\"{}\": still serving; registering again when "
        "etcd is back",
        key_, s.message());
  }
  outage_ = true;
}

Clock::time_point Registration::step() {
  if (lease_ != 0) {
    if (auto next = renew()) return *next;
  }
  return register_anew();
}

std::optional<Clock::time_point> Registration::renew() {
  auto ttl = client_.keep_alive(lease_);
  if (!ttl.ok() && ttl.status().code() != StatusCode::kNotFound) return retry_later(ttl.status());
  if (!ttl.ok()) {
    // The lease ended (etcd was away longer than the TTL, or lost its data): the key is
    // gone; register again at once.
    spdlog::warn("event=lease_lost key={} lease={}: registering again", key_, lease_);
    lease_ = 0;
    MutexLock lock(&mu_);
    registered_ = false;
    return std::nullopt;
  }
  Status held = still_ours();
  if (held.code() == StatusCode::kNotFound) {
    // Deleted or overwritten by someone else while our lease lives: put ours back.
    spdlog::warn("event=key_lost key={} lease={} reason=\"{}\": registering again", key_, lease_,
                 held.message());
    held = client_.put(key_, value_, lease_);
    if (held.ok()) spdlog::info("event=reregistered key={} lease={}", key_, lease_);
  }
  if (!held.ok()) return retry_later(held);
  if (outage_) spdlog::info("event=etcd_reachable key={} lease={}", key_, lease_);
  outage_ = false;
  backoff_ = std::chrono::milliseconds(100);
  return Clock::now() + interval_;
}

Clock::time_point Registration::register_anew() {
  auto lease = client_.grant_lease(ttl_s_);
  Status put = lease.ok() ? client_.put(key_, value_, *lease) : lease.status();
  if (!put.ok()) {
    if (lease.ok()) client_.revoke_lease(*lease).ignore_error();  // best effort
    return retry_later(put);
  }
  lease_ = *lease;
  spdlog::info("event={} key={} lease={} ttl_s={} etcd={}",
               was_registered_ ? "reregistered" : "registered", key_, lease_, ttl_s_,
               client_.endpoint().url());
  was_registered_ = true;
  outage_ = false;
  backoff_ = std::chrono::milliseconds(100);
  {
    MutexLock lock(&mu_);
    registered_ = true;
  }
  cv_.notify_all();
  return Clock::now() + interval_;
}

Clock::time_point Registration::retry_later(const Status& why) {
  unreachable(why);
  backoff_ = std::min(backoff_ * 2, interval_);
  return Clock::now() + backoff_;
}

Status Registration::still_ours() {
  ECX_ASSIGN_OR_RETURN(RangeResult now, client_.get(key_));
  if (now.kvs.empty()) return NotFound("the key was deleted");
  if (now.kvs[0].value != value_ || now.kvs[0].lease != lease_) {
    return NotFound("the key holds another value");
  }
  return Status::Ok();
}

void Registration::deregister() {
  {
    MutexLock lock(&mu_);
    if (done_) return;
    done_ = true;
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();  // bounded: the step in progress is one or two calls of the client
  if (lease_ == 0) return;
  Status s = client_.revoke_lease(lease_);
  if (!s.ok()) {
    // The lease will end by itself within the TTL; try deleting the key meanwhile.
    auto deleted = client_.delete_key(key_);
    spdlog::warn("event=deregister_failed key={} error=\"{}\" deleted_key={}", key_, s.message(),
                 deleted.ok() ? "yes" : "no (the lease ends it)");
  } else {
    spdlog::info("event=deregistered key={} lease={}", key_, lease_);
  }
  lease_ = 0;
  MutexLock lock(&mu_);
  registered_ = false;
}

}  // namespace ecx::directory
