// The upstreams the proxy routes over, as they are now: the static ones (--encoders,
// --pd) and those registered in etcd (docs/SERVING.md, "Membership (etcd)"). The whole
// set is one immutable snapshot, replaced when membership changes; a request reads it
// once and keeps it (and every Upstream in it) for as long as it runs, so an upstream
// that leaves mid-request finishes the requests it has.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/directory/instance.h"
#include "serve/upstream.h"

namespace ecx::serve {

struct UpstreamMembers {
  UpstreamList encoders;
  UpstreamList pds;
};

// What one membership update did.
struct MembershipChange {
  UpstreamList added;
  UpstreamList removed;
  bool empty() const { return added.empty() && removed.empty(); }
};

class UpstreamSet {
 public:
  UpstreamSet(UpstreamList static_encoders, UpstreamList static_pds);

  // The members now. Never null. Thread-safe.
  std::shared_ptr<const UpstreamMembers> snapshot() const ECX_EXCLUDES(mu_);

  // Makes the members found through etcd exactly `instances` (the static ones stay). An
  // instance whose role and URL are already members keeps its Upstream (in-flight count,
  // reachable flag); a static URL is not listed twice. Thread-safe.
  MembershipChange set_discovered(const std::vector<directory::Instance>& instances)
      ECX_EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  std::shared_ptr<const UpstreamMembers> current_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::serve
