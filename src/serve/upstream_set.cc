#include "serve/upstream_set.h"

#include <algorithm>
#include <map>

#include "ecx/common/log.h"
#include "http_server/http_server.h"

namespace ecx::serve {

UpstreamSet::UpstreamSet(UpstreamList static_encoders, UpstreamList static_pds) {
  auto members = std::make_shared<UpstreamMembers>();
  members->encoders = std::move(static_encoders);
  members->pds = std::move(static_pds);
  current_ = std::move(members);
}

std::shared_ptr<const UpstreamMembers> UpstreamSet::snapshot() const {
  MutexLock lock(&mu_);
  return current_;
}

namespace {

// The new list of one role: its static members, then the discovered ones (kept when
// already members).
UpstreamList merge(const UpstreamList& before, const std::string& role,
                   const std::vector<directory::Instance>& instances, MembershipChange& change) {
  UpstreamList out;
  std::map<std::string, std::shared_ptr<Upstream>> discovered_before;  // by URL
  for (const auto& u : before) {
    if (u->source == "static") {
      out.push_back(u);
    } else {
      discovered_before[u->url] = u;
    }
  }
  auto listed = [&](const std::string& url) {
    return std::any_of(out.begin(), out.end(), [&](const auto& u) { return u->url == url; });
  };
  for (const directory::Instance& instance : instances) {
    if (instance.role != role || listed(instance.url)) continue;
    auto kept = discovered_before.find(instance.url);
    // The same instance (a restarted one at the URL proves itself again).
    if (kept != discovered_before.end() && kept->second->instance_id == instance.id) {
      out.push_back(kept->second);
      discovered_before.erase(kept);
      continue;
    }
    auto host_port = parse_url(instance.url);
    if (!host_port.ok()) {  // checked by the directory already; never fatal
      spdlog::warn("event=member_ignored id={} reason=\"{}\"", instance.id,
                   host_port.status().message());
      continue;
    }
    auto prove_at = parse_url(instance.prove_url.empty() ? instance.url : instance.prove_url);
    if (!prove_at.ok()) {
      spdlog::warn("event=member_ignored id={} reason=\"prove_url: {}\"", instance.id,
                   prove_at.status().message());
      continue;
    }
    auto added = std::make_shared<Upstream>(role, instance.url, host_port->first, host_port->second,
                                            "etcd", instance.id);
    added->prove_host = prove_at->first;
    added->prove_port = prove_at->second;
    out.push_back(added);
    change.added.push_back(std::move(added));
  }
  for (auto& [url, gone] : discovered_before) change.removed.push_back(std::move(gone));
  return out;
}

}  // namespace

MembershipChange UpstreamSet::set_discovered(const std::vector<directory::Instance>& instances) {
  MutexLock lock(&mu_);
  MembershipChange change;
  auto next = std::make_shared<UpstreamMembers>();
  next->encoders = merge(current_->encoders, "encoder", instances, change);
  next->pds = merge(current_->pds, "pd", instances, change);
  if (!change.empty()) current_ = std::move(next);
  return change;
}

}  // namespace ecx::serve
