#include "support/etcd_events.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>

namespace ecx::testing {

std::string test_etcd_url() {
  const char* env = std::getenv("ECX_TEST_ETCD");
  return env != nullptr && *env != '\0' ? env : "http://127.0.0.1:23791";
}

directory::EtcdClient test_etcd_client() {
  return directory::EtcdClient::create(test_etcd_url(), std::chrono::milliseconds(2000)).value();
}

Status test_etcd_health() {
  auto client = test_etcd_client();
  auto read = client.get("/ecx-test/health");
  if (read.ok()) return Status::Ok();
  return Unavailable(
      "no etcd at " + test_etcd_url() +
      " (CTest starts one: tests/support/etcd_fixture.sh): " + read.status().message());
}

std::string secure_etcd_url() {
  return "https://127.0.0.1:" + std::to_string(ECX_TEST_ETCD_SECURE_PORT);
}

std::string secure_etcd_dir() { return ECX_TEST_ETCD_SECURE_DIR; }

directory::EtcdAccess secure_etcd_access() {
  std::ifstream in(secure_etcd_dir() + "/ecx.password");
  std::string password;
  std::getline(in, password);
  return {secure_etcd_dir() + "/ca.pem", "ecx", password};
}

std::string unique_prefix(const std::string& what) {
  static std::atomic<int> counter{0};
  return "/ecx-test/" + what + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(counter.fetch_add(1));
}

KeyRecorder::KeyRecorder(std::string prefix)
    : prefix_(std::move(prefix)), client_(test_etcd_client()) {
  auto all = client_.range_prefix(prefix_);
  if (!all.ok()) {
    status_ = all.status();
    return;
  }
  for (const auto& kv : all->kvs) keys_[kv.key] = kv;
  watch_ = std::make_unique<directory::EtcdWatch>(client_.endpoint(), prefix_, all->revision + 1,
                                                  std::chrono::milliseconds(2000),
                                                  std::chrono::minutes(10));
  thread_ = std::thread([this] {
    Status ended = watch_->run([this](const std::vector<directory::WatchEvent>& events, int64_t) {
      std::lock_guard lock(mu_);
      for (const auto& e : events) {
        if (e.type == directory::WatchEvent::kDelete) {
          keys_.erase(e.kv.key);
        } else {
          keys_[e.kv.key] = e.kv;
        }
      }
      changed_at_ = Clock::now();
      cv_.notify_all();
    });
    std::lock_guard lock(mu_);
    if (!ended.ok()) status_ = ended;
    cv_.notify_all();
  });
}

KeyRecorder::~KeyRecorder() {
  if (watch_) watch_->cancel();
  if (thread_.joinable()) thread_.join();
}

Status KeyRecorder::status() const {
  std::lock_guard lock(mu_);
  return status_;
}

bool KeyRecorder::wait(Deadline deadline, const std::function<bool(const Keys&)>& done,
                       Clock::time_point* when) {
  std::unique_lock lock(mu_);
  bool held = cv_.wait_until(lock, deadline.time_point(), [&] {
    return done(keys_) || !status_.ok();
  }) && done(keys_);
  if (held && when != nullptr) *when = changed_at_;
  return held;
}

KeyRecorder::Keys KeyRecorder::keys() const {
  std::lock_guard lock(mu_);
  return keys_;
}

}  // namespace ecx::testing
