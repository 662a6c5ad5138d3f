#include "ecx/directory/membership.h"

#include <algorithm>

#include "ecx/common/log.h"
#include "ecx/directory/etcd_watch.h"

namespace ecx::directory {

namespace {

bool same(const Instance& a, const Instance& b) {
  return a.id == b.id && a.url == b.url && a.role == b.role && a.model == b.model &&
         a.compat_hash == b.compat_hash;
}

}  // namespace

MembershipWatcher::MembershipWatcher(EtcdClient client, MembershipOptions options,
                                     OnChange on_change)
    : client_(std::move(client)),
      options_(std::move(options)),
      prefix_(instances_prefix(options_.root, options_.model)),
      on_change_(std::move(on_change)) {
  thread_ = std::thread([this] { run(); });
}

MembershipWatcher::~MembershipWatcher() {
  std::shared_ptr<EtcdWatch> watch;
  {
    MutexLock lock(&mu_);
    stop_ = true;
    watch = watch_;
  }
  cv_.notify_all();
  if (watch) watch->cancel();
  thread_.join();
}

bool MembershipWatcher::wait_synced(Deadline deadline) {
  MutexLock lock(&mu_);
  return cv_.wait_until(&mu_, deadline.time_point(),
                        [this]() ECX_REQUIRES(mu_) { return synced_; });
}

std::optional<Instance> MembershipWatcher::usable(const KeyValue& kv) {
  auto parsed = parse_instance(kv.key, kv.value, prefix_);
  std::string why;
  if (!parsed.ok()) {
    why = parsed.status().message();
  } else if (parsed->model != options_.model) {
    why = "model '" + parsed->model + "' is not '" + options_.model + "'";
  } else if (parsed->compat_hash != options_.compat_hash) {
    why = "compat_hash '" + parsed->compat_hash + "' is not '" + options_.compat_hash + "'";
  } else if (Status signed_by_us = options_.secret
                                       ? verify_instance(*parsed, kv.key, *options_.secret)
                                       : Status::Ok();
             !signed_by_us.ok()) {
    why = signed_by_us.message();
  } else if (!members_.count(kv.key) && members_.size() >= options_.max_members) {
    why = "already " + std::to_string(members_.size()) + " members, the most followed";
  } else {
    rejected_.erase(kv.key);
    return *parsed;
  }
  auto [at, added] = rejected_.emplace(kv.key, kv.mod_revision);
  if (added || at->second != kv.mod_revision) {
    at->second = kv.mod_revision;
    spdlog::warn("event=member_ignored key={} mod_revision={} reason=\"{}\"", kv.key,
                 kv.mod_revision, why);
  }
  return std::nullopt;
}

void MembershipWatcher::publish() {
  std::vector<Instance> now;
  now.reserve(members_.size());
  for (const auto& [key, instance] : members_) now.push_back(instance);
  bool changed = now.size() != published_.size() ||
                 !std::equal(now.begin(), now.end(), published_.begin(), same);
  if (changed) {
    published_ = now;
    on_change_(published_);
  }
}

Result<int64_t> MembershipWatcher::read_all() {
  ECX_ASSIGN_OR_RETURN(RangeResult all, client_.range_prefix(prefix_));
  members_.clear();
  for (const KeyValue& kv : all.kvs) {
    if (auto instance = usable(kv)) members_[kv.key] = std::move(*instance);
  }
  // Forget what was logged about keys that are gone.
  for (auto it = rejected_.begin(); it != rejected_.end();) {
    bool present = std::any_of(all.kvs.begin(), all.kvs.end(),
                               [&](const KeyValue& kv) { return kv.key == it->first; });
    it = present ? std::next(it) : rejected_.erase(it);
  }
  publish();
  return all.revision;
}

void MembershipWatcher::run() {
  Backoff backoff{std::chrono::milliseconds(100), false};
  while (!stopping()) {
    Result<int64_t> revision = read_all();
    Status ended = revision.ok() ? follow(*revision, backoff) : revision.status();
    MutexLock lock(&mu_);
    if (stop_) return;
    if (ended.code() == StatusCode::kDeadlineExceeded) {
      spdlog::debug("event=watch_idle prefix={}: reading again", prefix_);
      continue;  // a quiet watch: read and watch again at once
    }
    if (!backoff.failing) {
      spdlog::warn("event=watch_broken prefix={} error=\"{}\": reading again in {} ms", prefix_,
                   ended.message(), backoff.wait.count());
    }
    backoff.failing = !revision.ok();
    cv_.wait_for(&mu_, backoff.wait, [this]() ECX_REQUIRES(mu_) { return stop_; });
    backoff.wait = std::min(backoff.wait * 2, options_.max_backoff);
  }
}

bool MembershipWatcher::stopping() {
  MutexLock lock(&mu_);
  return stop_;
}

Status MembershipWatcher::follow(int64_t revision, Backoff& backoff) {
  {
    MutexLock lock(&mu_);
    if (!synced_) {
      synced_ = true;
      cv_.notify_all();
    }
  }
  if (backoff.failing) spdlog::info("event=etcd_reachable prefix={} watching again", prefix_);
  backoff.failing = false;
  // read_all() has just authenticated, if etcd wants it: the token is fresh.
  auto token = client_.token();
  auto watch = std::make_shared<EtcdWatch>(
      client_.endpoint(), prefix_, revision + 1, client_.timeout(), options_.idle_rewatch,
      token.ok() ? *token : std::string(), client_.access().ca_file);
  {
    MutexLock lock(&mu_);
    if (stop_) return Status::Ok();
    watch_ = watch;
  }
  auto t0 = Clock::now();
  Status ended =
      watch->run([this](const std::vector<WatchEvent>& events, int64_t) { apply(events); });
  {
    MutexLock lock(&mu_);
    watch_.reset();
  }
  // A watch that ran a while was healthy: start the backoff over.
  if (Clock::now() - t0 > std::chrono::seconds(5)) backoff.wait = std::chrono::milliseconds(100);
  return ended;
}

void MembershipWatcher::apply(const std::vector<WatchEvent>& events) {
  for (const WatchEvent& e : events) {
    if (e.type == WatchEvent::kDelete) {
      members_.erase(e.kv.key);
      rejected_.erase(e.kv.key);
    } else if (auto instance = usable(e.kv)) {
      members_[e.kv.key] = std::move(*instance);
    } else {
      members_.erase(e.kv.key);  // replaced by a value that is not usable
    }
  }
  publish();
}

}  // namespace ecx::directory
