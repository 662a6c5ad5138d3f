// Follows the instances registered under one prefix (ecx/directory/instance.h): reads
// them all, then watches for changes from the next revision, on a thread of its own.
// When the watch breaks (etcd restarted, compaction, connection lost) it reads again and
// watches again, with a bounded backoff. Each time the set of usable instances changes it
// hands the whole set to a callback.
//
// Usable: a value that parses (parse_instance) and names the model and compatibility hash
// expected. Anything else is left out with one log line per key and revision; it never
// stops the watch.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/directory/etcd_client.h"
#include "ecx/directory/instance.h"

namespace ecx::directory {

class EtcdWatch;
struct WatchEvent;

struct MembershipOptions {
  std::string root = "/ecx";  // the key layout's root
  std::string model;          // watches <root>/<model>/instances/
  std::string compat_hash;    // instances with another one are left out
  // When set, records not signed with this deployment secret (verify_instance) are left
  // out: only the deployment's own instances join. (Unset: every well-formed record.)
  std::optional<std::string> secret;
  // Most members followed at once; records past it are left out (logged).
  size_t max_members = 1024;
  std::chrono::milliseconds max_backoff{2000};
  // A watch with no message for this long is read and watched again.
  std::chrono::milliseconds idle_rewatch{60000};
};

class MembershipWatcher {
 public:
  // The usable instances, by key order. Called on the watcher's thread, never
  // concurrently, and only when the set changed.
  using OnChange = std::function<void(const std::vector<Instance>&)>;

  MembershipWatcher(EtcdClient client, MembershipOptions options, OnChange on_change);
  // Stops the watch and joins the thread (bounded by the client's timeout).
  ~MembershipWatcher();
  MembershipWatcher(const MembershipWatcher&) = delete;
  MembershipWatcher& operator=(const MembershipWatcher&) = delete;

  // Waits until the first full read has been handed to the callback, or `deadline`; true
  // if it has.
  bool wait_synced(Deadline deadline);

 private:
  struct Backoff {
    std::chrono::milliseconds wait;
    bool failing;  // etcd unreachable: logged once per outage
  };
  void run();
  bool stopping();
  // Watches from `revision` + 1 until the watch ends: why it ended (Ok when stopping).
  Status follow(int64_t revision, Backoff& backoff);
  void apply(const std::vector<WatchEvent>& events);
  // Reads every key under the prefix; the revision to watch from. Hands over the set.
  Result<int64_t> read_all();
  // The instance at `kv`, or nullopt (logged once) when it is not usable.
  std::optional<Instance> usable(const KeyValue& kv);
  void publish();

  EtcdClient client_;
  const MembershipOptions options_;
  const std::string prefix_;
  const OnChange on_change_;

  // Owned by the thread.
  std::map<std::string, Instance> members_;  // by key
  std::vector<Instance> published_;          // what on_change_ saw last
  std::map<std::string, int64_t> rejected_;  // key -> mod_revision already logged

  Mutex mu_;
  CondVar cv_;
  bool stop_ ECX_GUARDED_BY(mu_) = false;
  bool synced_ ECX_GUARDED_BY(mu_) = false;
  std::shared_ptr<EtcdWatch> watch_ ECX_GUARDED_BY(mu_);  // the watch streaming now
  std::thread thread_;                                    // started last
};

}  // namespace ecx::directory
