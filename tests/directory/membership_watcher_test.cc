// Following the instances of a model in etcd: what joins and leaves reaches the callback,
// values that are not usable are left out (never a crash), and the watcher comes back
// after etcd itself restarts, as does a registration.
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "ecx/directory/instance.h"
#include "ecx/directory/membership.h"
#include "ecx/directory/registration.h"
#include "support/etcd_events.h"

namespace ecx::directory {
namespace {

using ecx::testing::test_etcd_client;
using ecx::testing::unique_prefix;

const std::string kModel = "test-model";
const std::string kCompat = "test-model-0123456789abcdef";

Instance instance(const std::string& role, const std::string& id, int port) {
  return Instance{id, "http://127.0.0.1:" + std::to_string(port), role, kModel, kCompat};
}

// What the watcher's callback was given last, and a wait on it.
class Seen {
 public:
  MembershipWatcher::OnChange callback() {
    return [this](const std::vector<Instance>& all) {
      std::lock_guard lock(mu_);
      last_.clear();
      for (const auto& i : all) last_.push_back(i.id);
      ++calls_;
      cv_.notify_all();
    };
  }
  // Waits until the ids handed over last are exactly `ids` (in key order).
  bool wait_for(const std::vector<std::string>& ids, int64_t ms = 5000) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return last_ == ids; });
  }
  std::vector<std::string> last() {
    std::lock_guard lock(mu_);
    return last_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> last_;
  int calls_ = 0;
};

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status health = ecx::testing::test_etcd_health();
    ASSERT_TRUE(health.ok()) << health.message();
    root_ = unique_prefix("members");
    prefix_ = instances_prefix(root_, kModel);
  }
  void TearDown() override { client_.delete_prefix(root_).status().ignore_error(); }

  void put(const Instance& i) {
    ASSERT_TRUE(client_.put(instance_key(root_, i), instance_value(i)).ok());
  }
  MembershipOptions options() const {
    MembershipOptions o;
    o.root = root_;
    o.model = kModel;
    o.compat_hash = kCompat;
    o.max_backoff = std::chrono::milliseconds(500);
    return o;
  }

  EtcdClient client_ = test_etcd_client();
  std::string root_, prefix_;
};

TEST(InstanceRecord, KeyLayoutAndStrictParsing) {
  Instance e = instance("encoder", "encoder-1", 8001);
  std::string prefix = instances_prefix("/ecx/", kModel);
  EXPECT_EQ(prefix, "/ecx/test-model/instances/");
  EXPECT_EQ(instance_key("/ecx", e), "/ecx/test-model/instances/encoder/encoder-1");
  auto back = parse_instance(instance_key("/ecx", e), instance_value(e), prefix);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->url, e.url);
  EXPECT_EQ(back->compat_hash, kCompat);

  std::string key = instance_key("/ecx", e);
  for (const char* bad : {
           "not json", "[1,2]",
           R"({"id":"encoder-1","url":"http://127.0.0.1:8001","role":"encoder","model":"m"})",
           R"({"id":"encoder-1","url":"http://127.0.0.1:8001","role":"encoder","model":"m",
               "compat_hash":7})",
           R"({"id":"encoder-1","url":"127.0.0.1:8001","role":"encoder","model":"m",
               "compat_hash":"c"})",
           R"({"id":"encoder-1","url":"http://127.0.0.1:0","role":"encoder","model":"m",
               "compat_hash":"c"})",
           R"({"id":"encoder-1","url":"http://h:80/x","role":"encoder","model":"m",
               "compat_hash":"c"})",
           R"({"id":"encoder-1","url":"http://h:80","role":"router","model":"m",
               "compat_hash":"c"})",
           R"({"id":"encoder-2","url":"http://h:80","role":"encoder","model":"m",
               "compat_hash":"c"})",  // another id than the key's
           R"({"id":"encoder-1","url":"http://h:80","role":"pd","model":"m",
               "compat_hash":"c"})",  // another role than the key's
       }) {
    auto parsed = parse_instance(key, bad, prefix);
    EXPECT_FALSE(parsed.ok()) << bad;
    if (!parsed.ok()) {
      EXPECT_NE(parsed.status().message().find(key), std::string::npos);
    }
  }
}

// A sidecar's record names where it proves the deployment secret (prove_url); the
// record's signature covers it, so nobody can point a signed record's challenges at a
// service of their own.
TEST(InstanceRecord, ASidecarsProveUrlIsParsedCheckedAndSigned) {
  Instance e = instance("encoder", "encoder-1", 8001);
  e.prove_url = "http://10.0.0.7:9000";
  std::string prefix = instances_prefix("/ecx", kModel);
  std::string key = instance_key("/ecx", e);
  sign_instance(e, key, "secret");
  auto back = parse_instance(key, instance_value(e), prefix);
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->prove_url, "http://10.0.0.7:9000");
  EXPECT_TRUE(verify_instance(*back, key, "secret").ok());
  Instance moved = *back;
  moved.prove_url = "http://10.0.0.66:9000";
  EXPECT_EQ(verify_instance(moved, key, "secret").code(), StatusCode::kPermissionDenied);
  Instance dropped = *back;
  dropped.prove_url.clear();
  EXPECT_EQ(verify_instance(dropped, key, "secret").code(), StatusCode::kPermissionDenied);
  // Without a prove_url, the record and its signature are what they always were.
  Instance plain = instance("pd", "pd-1", 8002);
  sign_instance(plain, instance_key("/ecx", plain), "secret");
  EXPECT_EQ(instance_value(plain).find("prove_url"), std::string::npos);
  EXPECT_TRUE(verify_instance(plain, instance_key("/ecx", plain), "secret").ok());
  auto bad = parse_instance(
      key,
      R"({"id":"encoder-1","url":"http://h:80","role":"encoder","model":"m","compat_hash":"c",
          "prove_url":"ftp://h:1"})",
      prefix);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("prove_url"), std::string::npos);
}

TEST_F(MembershipTest, JoinsAndLeavesReachTheCallbackAsTheWholeSet) {
  put(instance("encoder", "encoder-a", 9001));
  Seen seen;
  MembershipWatcher watcher(client_, options(), seen.callback());
  ASSERT_TRUE(watcher.wait_synced(Deadline::after_ms(5000)));
  EXPECT_EQ(seen.last(), std::vector<std::string>{"encoder-a"});

  put(instance("pd", "pd-a", 9002));
  EXPECT_TRUE(seen.wait_for({"encoder-a", "pd-a"}));
  ASSERT_TRUE(client_.delete_key(instance_key(root_, instance("encoder", "encoder-a", 0))).ok());
  EXPECT_TRUE(seen.wait_for({"pd-a"}));
}

TEST_F(MembershipTest, ValuesThatAreNotUsableAreLeftOutAndTheWatchGoesOn) {
  Seen seen;
  MembershipWatcher watcher(client_, options(), seen.callback());
  ASSERT_TRUE(watcher.wait_synced(Deadline::after_ms(5000)));
  ASSERT_TRUE(client_.put(prefix_ + "pd/garbage", "\x01not json at all").ok());
  ASSERT_TRUE(client_.put(prefix_ + "pd/fields", R"({"id":"fields","url":5})").ok());
  ASSERT_TRUE(client_
                  .put(prefix_ + "pd/badurl",
                       R"({"id":"badurl","url":"ftp://x","role":"pd","model":"test-model",
                              "compat_hash":")" +
                           kCompat + "\"}")
                  .ok());
  ASSERT_TRUE(client_.put(prefix_ + "whatever", "{}").ok());
  Instance other_compat = instance("pd", "pd-other", 9003);
  other_compat.compat_hash = "another-model-hash";
  put(other_compat);
  Instance other_model = instance("pd", "pd-model", 9004);
  other_model.model = "another-model";  // its own key, under our prefix
  ASSERT_TRUE(client_.put(prefix_ + "pd/pd-model", instance_value(other_model)).ok());
  put(instance("pd", "pd-good", 9005));
  EXPECT_TRUE(seen.wait_for({"pd-good"}));

  // A usable member whose value turns bad leaves; the watch still follows the others.
  put(instance("encoder", "encoder-b", 9006));
  EXPECT_TRUE(seen.wait_for({"encoder-b", "pd-good"}));
  ASSERT_TRUE(client_.put(prefix_ + "encoder/encoder-b", "{broken").ok());
  EXPECT_TRUE(seen.wait_for({"pd-good"}));
}

#ifdef ECX_ETCD_FIXTURE
// A second etcd of this test's own, stopped and started again empty (as if it had lost
// its data): the registration registers again and the watcher follows the new etcd.
TEST(MembershipAcrossEtcdRestart, TheRegistrationAndTheWatcherComeBack) {
  const std::string dir = "/tmp/ecx-etcd-restart-" + std::to_string(::getpid());
  const std::string script = std::string(ECX_ETCD_FIXTURE) + " ";
  const std::string args = " 23795 23796 " + dir;
  ASSERT_EQ(std::system((script + "start" + args).c_str()), 0);
  auto client = EtcdClient::create("http://127.0.0.1:23795", std::chrono::milliseconds(500));
  ASSERT_TRUE(client.ok());
  MembershipOptions o;
  o.root = "/ecx";
  o.model = kModel;
  o.compat_hash = kCompat;
  o.max_backoff = std::chrono::milliseconds(500);
  Instance pd = instance("pd", "pd-r", 9010);
  {
    Seen seen;
    MembershipWatcher watcher(*client, o, seen.callback());
    Registration registration(*client, instance_key("/ecx", pd), instance_value(pd), 2);
    EXPECT_TRUE(seen.wait_for({"pd-r"}));

    ASSERT_EQ(std::system((script + "stop" + args).c_str()), 0);
    EXPECT_TRUE(seen.wait_for({"pd-r"}));                          // etcd away: the last set stands
    ASSERT_EQ(std::system((script + "start" + args).c_str()), 0);  // empty
    // Registered again in the new etcd, and seen there with a newcomer.
    Instance e = instance("encoder", "encoder-r", 9011);
    ASSERT_TRUE(client->put(instance_key("/ecx", e), instance_value(e)).ok());
    EXPECT_TRUE(seen.wait_for({"encoder-r", "pd-r"}, 15000)) << seen.last().size();
    EXPECT_EQ(client->get(instance_key("/ecx", pd))->kvs.size(), 1u);
  }
  ASSERT_EQ(std::system((script + "stop" + args).c_str()), 0);
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}
#endif

}  // namespace
}  // namespace ecx::directory
