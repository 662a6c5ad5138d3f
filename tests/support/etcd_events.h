// The etcd the tests share (started by CTest: tests/support/etcd_fixture.sh) and a
// recorder of the keys under a prefix, fed by a watch, so a test waits on a key coming or
// going as an event rather than by polling.
#pragma once

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ecx/common/deadline.h"
#include "ecx/directory/etcd_client.h"
#include "ecx/directory/etcd_watch.h"

namespace ecx::testing {

// ECX_TEST_ETCD, or the fixture's http://127.0.0.1:23791.
std::string test_etcd_url();
// A client of the test etcd, each call bounded by 2 s.
directory::EtcdClient test_etcd_client();
// True when the test etcd answers (a test without it fails with this message).
Status test_etcd_health();
// The secure test etcd (fixture etcd_secure, tests/support/etcd_fixture.sh start-secure):
// https:// with a CA of its own, authentication on, user "ecx" limited to /ecx-test/,
// tokens that expire after 2 s.
std::string secure_etcd_url();
std::string secure_etcd_dir();  // ca.pem and ecx.password are here
directory::EtcdAccess secure_etcd_access();
// A key prefix no other test uses: "/ecx-test/<what>-<pid>-<n>".
std::string unique_prefix(const std::string& what);

// The keys under `prefix` as etcd holds them now: read once, then followed by a watch on
// a thread of its own.
class KeyRecorder {
 public:
  using Keys = std::map<std::string, directory::KeyValue>;  // by key

  explicit KeyRecorder(std::string prefix);
  ~KeyRecorder();

  // Ok when the first read and the watch's start worked.
  Status status() const;
  // Waits until `done(keys)` holds, or `deadline`. True if it held; `when` (optional) gets
  // the time the event that made it hold arrived.
  bool wait(Deadline deadline, const std::function<bool(const Keys&)>& done,
            Clock::time_point* when = nullptr);
  Keys keys() const;

 private:
  const std::string prefix_;
  directory::EtcdClient client_;
  std::unique_ptr<directory::EtcdWatch> watch_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Keys keys_;                       // guarded by mu_
  Clock::time_point changed_at_{};  // guarded by mu_
  Status status_;                   // guarded by mu_
  std::thread thread_;
};

}  // namespace ecx::testing
