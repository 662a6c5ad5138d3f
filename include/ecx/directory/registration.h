// Keeps one key in etcd for as long as this process lives: the key is put under a lease
// of `ttl_s` seconds, renewed every ttl/3 by a thread of its own. When this process dies
// the lease ends and etcd deletes the key; deregister() deletes it at once.
//
// etcd being away does not stop anything else: the thread retries (with backoff, each
// call bounded by the client's timeout), logs when etcd is unreachable and when it is
// back, and registers again (new lease) if the old lease ended meanwhile. Each renewal
// also reads the key back: one deleted or overwritten by someone else is put back.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <thread>

#include "ecx/common/deadline.h"
#include "ecx/common/mutex.h"
#include "ecx/directory/etcd_client.h"

namespace ecx::directory {

class Registration {
 public:
  // Starts registering `key` = `value` in the background. REQUIRES: ttl_s >= 1.
  Registration(EtcdClient client, std::string key, std::string value, int64_t ttl_s);
  // deregister().
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  // Waits until the key is in etcd, or `deadline`; true if it is.
  bool wait_registered(Deadline deadline);
  // Stops renewing and revokes the lease (etcd deletes the key), within about twice the
  // client's timeout. Idempotent.
  void deregister();

  const std::string& key() const { return key_; }

 private:
  void run();
  // One step of the thread; the time of the next one.
  Clock::time_point step();
  // Renews the lease and keeps the key ours (putting it back when someone deleted or
  // replaced it); the time of the next step, or nullopt when the lease has ended.
  std::optional<Clock::time_point> renew();
  // Takes a new lease and puts the key under it.
  Clock::time_point register_anew();
  // etcd failed: logged once per outage, tried again after a growing backoff.
  Clock::time_point retry_later(const Status& why);
  // Ok when the key still holds our value under our lease; NotFound (saying what
  // happened) when it was deleted or replaced; the client's error otherwise.
  Status still_ours();
  // Logs that etcd could not be reached (once per outage).
  void unreachable(const Status& s);

  EtcdClient client_;
  const std::string key_;
  const std::string value_;
  const int64_t ttl_s_;
  const std::chrono::milliseconds interval_;  // between keep-alives: ttl / 3

  // Owned by the thread (and by deregister() once it has joined it).
  int64_t lease_ = 0;            // 0 = none
  bool was_registered_ = false;  // registered at least once: a later one is a re-register
  bool outage_ = false;          // etcd unreachable since the last logged failure
  std::chrono::milliseconds backoff_{100};

  Mutex mu_;
  CondVar cv_;
  bool registered_ ECX_GUARDED_BY(mu_) = false;  // the key is in etcd
  bool stop_ ECX_GUARDED_BY(mu_) = false;
  bool done_ ECX_GUARDED_BY(mu_) = false;  // deregister() has run
  std::thread thread_;                     // started last
};

}  // namespace ecx::directory
