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
    std::lock_guard lock(mu_);
    stop_ = true;
    watch = watch_;
  }
  cv_.notify_all();
  if (watch) watch->cancel();
  thread_.join();
}

bool MembershipWatcher::wait_synced(Deadline deadline) {
  std::unique_lock lock(mu_);
  return cv_.wait_until(lock, deadline.time_point(), [&] { return synced_; });
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
  auto backoff = std::chrono::milliseconds(100);
  bool failing = false;  // logged once per outage
  std::unique_lock lock(mu_);
  while (!stop_) {
    lock.unlock();
    Status ended;
    auto revision = read_all();
    if (revision.ok()) {
      lock.lock();
      if (!synced_) {
        synced_ = true;
        cv_.notify_all();
      }
      lock.unlock();
      if (failing) spdlog::info("event=etcd_reachable prefix={} watching again", prefix_);
      failing = false;
      // read_all() has just authenticated, if etcd wants it: the token is fresh.
      auto token = client_.token();
      auto watch = std::make_shared<EtcdWatch>(
          client_.endpoint(), prefix_, *revision + 1, client_.timeout(), options_.idle_rewatch,
          token.ok() ? *token : std::string(), client_.access().ca_file);
      lock.lock();
      if (stop_) break;
      watch_ = watch;
      lock.unlock();
      auto t0 = Clock::now();
      ended = watch->run([&](const std::vector<WatchEvent>& events, int64_t) {
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
      });
      lock.lock();
      watch_.reset();
      lock.unlock();
      // A watch that ran a while was healthy: start the backoff over.
      if (Clock::now() - t0 > std::chrono::seconds(5)) backoff = std::chrono::milliseconds(100);
    } else {
      ended = revision.status();
    }
    lock.lock();
    if (stop_) break;
    if (ended.code() == StatusCode::kDeadlineExceeded) {
      spdlog::debug("event=watch_idle prefix={}: reading again", prefix_);
      continue;  // a quiet watch: read and watch again at once
    }
    if (!failing) {
      spdlog::warn("event=watch_broken prefix={} error=\"{}\": reading again in {} ms", prefix_,
                   ended.message(), backoff.count());
    }
    failing = !revision.ok();
    cv_.wait_for(lock, backoff, [&] { return stop_; });
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace ecx::directory
