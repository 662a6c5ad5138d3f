// The etcd client against a real etcd (CTest's fixture): keys, prefixes, leases that
// end, revocation, the watch, and a registration that keeps its key alive.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <httplib.h>

#include "directory/etcd_json.h"
#include "ecx/directory/etcd_client.h"
#include "ecx/directory/etcd_watch.h"
#include "ecx/directory/registration.h"
#include "support/etcd_events.h"
#include "support/poll.h"

namespace ecx::directory {
namespace {

using ecx::testing::KeyRecorder;
using ecx::testing::test_etcd_client;
using ecx::testing::unique_prefix;

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status health = ecx::testing::test_etcd_health();
    ASSERT_TRUE(health.ok()) << health.message();
    prefix_ = unique_prefix("client");
  }
  void TearDown() override { client_.delete_prefix(prefix_).status().ignore_error(); }

  EtcdClient client_ = test_etcd_client();
  std::string prefix_;
};

double seconds_since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

TEST(EtcdCodec, Base64RoundTripsBytesAndRejectsWhatIsNotBase64) {
  for (std::string bytes : {std::string(), std::string("a"), std::string("ab"), std::string("abc"),
                            std::string("\0\xff/+=", 5)}) {
    auto back = base64_decode(base64_encode(bytes));
    ASSERT_TRUE(back.ok()) << back.status().message();
    EXPECT_EQ(*back, bytes);
  }
  EXPECT_FALSE(base64_decode("abc").ok());
  EXPECT_FALSE(base64_decode("ab=c").ok());
  EXPECT_FALSE(base64_decode("a!cd").ok());
}

TEST(EtcdCodec, EndpointsAreHttpOrHttpsHostPortOnly) {
  auto two = parse_etcd_endpoints("http://127.0.0.1:2379,http://h2:2380/");
  ASSERT_TRUE(two.ok()) << two.status().message();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[1].host, "h2");
  EXPECT_EQ((*two)[1].port, 2380);
  EXPECT_FALSE((*two)[1].tls);
  auto tls = parse_etcd_endpoints("https://10.0.0.1:2379");
  ASSERT_TRUE(tls.ok()) << tls.status().message();
  EXPECT_TRUE((*tls)[0].tls);
  EXPECT_EQ((*tls)[0].url(), "https://10.0.0.1:2379");
  for (const char* bad : {"", "127.0.0.1:2379", "ftp://h:1", "http://h", "http://h:0",
                          "http://h:99999", "http://h:12/v3", "http://:12", "https://h"}) {
    EXPECT_FALSE(parse_etcd_endpoints(bad).ok()) << bad;
  }
  EXPECT_EQ(prefix_range_end("/a/"), "/a0");
  EXPECT_EQ(prefix_range_end(std::string("a\xff", 2)), "b");
}

TEST_F(EtcdTest, PutGetRangeAndDeleteStayWithinTheirPrefix) {
  ASSERT_TRUE(client_.put(prefix_ + "/x/1", "one").ok());
  ASSERT_TRUE(client_.put(prefix_ + "/x/2", std::string("t\0o", 3)).ok());
  ASSERT_TRUE(client_.put(prefix_ + "/x0", "sibling").ok());  // not under "/x/"

  auto one = client_.get(prefix_ + "/x/1");
  ASSERT_TRUE(one.ok()) << one.status().message();
  ASSERT_EQ(one->kvs.size(), 1u);
  EXPECT_EQ(one->kvs[0].value, "one");
  EXPECT_GT(one->revision, 0);

  auto under = client_.range_prefix(prefix_ + "/x/");
  ASSERT_TRUE(under.ok()) << under.status().message();
  ASSERT_EQ(under->kvs.size(), 2u);
  EXPECT_EQ(under->kvs[1].value, std::string("t\0o", 3));

  auto deleted = client_.delete_prefix(prefix_ + "/x/");
  ASSERT_TRUE(deleted.ok()) << deleted.status().message();
  EXPECT_EQ(*deleted, 2);
  EXPECT_TRUE(client_.get(prefix_ + "/x/1")->kvs.empty());
  EXPECT_EQ(client_.get(prefix_ + "/x0")->kvs.size(), 1u);
}

TEST_F(EtcdTest, AKeyUnderALeaseThatIsNotRenewedGoesWhenTheLeaseEnds) {
  KeyRecorder keys(prefix_);
  ASSERT_TRUE(keys.status().ok()) << keys.status().message();
  auto lease = client_.grant_lease(2);
  ASSERT_TRUE(lease.ok()) << lease.status().message();
  ASSERT_TRUE(client_.put(prefix_ + "/leased", "v", *lease).ok());
  auto t0 = Clock::now();
  auto present = [&](const KeyRecorder::Keys& k) { return k.count(prefix_ + "/leased") > 0; };
  ASSERT_TRUE(keys.wait(Deadline::after_ms(2000), present));
  Clock::time_point gone_at;
  ASSERT_TRUE(keys.wait(
      Deadline::after_ms(8000), [&](const auto& k) { return !present(k); }, &gone_at));
  std::printf("[ measure ] lease TTL 2 s: key deleted %.2f s after the put\n",
              seconds_since(t0, gone_at));
  auto renewed = client_.keep_alive(*lease);
  EXPECT_EQ(renewed.status().code(), StatusCode::kNotFound) << renewed.status().message();
}

TEST_F(EtcdTest, RevokingALeaseDeletesItsKeysAtOnceAndKeepAliveThenSaysNotFound) {
  auto lease = client_.grant_lease(60);
  ASSERT_TRUE(lease.ok()) << lease.status().message();
  ASSERT_TRUE(client_.put(prefix_ + "/k", "v", *lease).ok());
  auto ttl = client_.keep_alive(*lease);
  ASSERT_TRUE(ttl.ok()) << ttl.status().message();
  EXPECT_GT(*ttl, 0);
  EXPECT_EQ(client_.get(prefix_ + "/k")->kvs[0].lease, *lease);
  Status revoked = client_.revoke_lease(*lease);
  ASSERT_TRUE(revoked.ok()) << revoked.to_string();
  EXPECT_TRUE(client_.get(prefix_ + "/k")->kvs.empty());
  EXPECT_EQ(client_.keep_alive(*lease).status().code(), StatusCode::kNotFound);
  Status again = client_.revoke_lease(*lease);
  EXPECT_TRUE(again.ok()) << again.to_string();  // ended already: fine
}

TEST_F(EtcdTest, AWatchSeesPutsAndDeletesInOrderFromItsRevision) {
  ASSERT_TRUE(client_.put(prefix_ + "/before", "old").ok());
  auto start = client_.range_prefix(prefix_);
  ASSERT_TRUE(start.ok());
  EtcdWatch watch(client_.endpoint(), prefix_ + "/", start->revision + 1,
                  std::chrono::milliseconds(2000), std::chrono::seconds(30));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<WatchEvent> seen;
  std::thread runner([&] {
    Status s = watch.run([&](const std::vector<WatchEvent>& events, int64_t) {
      std::lock_guard lock(mu);
      seen.insert(seen.end(), events.begin(), events.end());
      cv.notify_all();
    });
    EXPECT_TRUE(s.ok()) << s.message();  // cancelled
  });
  ASSERT_TRUE(client_.put(prefix_ + "/a", "1").ok());
  ASSERT_TRUE(client_.put(prefix_ + "/a", "2").ok());
  ASSERT_TRUE(client_.delete_key(prefix_ + "/a").ok());
  ASSERT_TRUE(client_.put(prefix_ + "/0", "sibling").ok());  // under the prefix
  ASSERT_TRUE(client_.put(prefix_ + "0-outside", "x").ok());
  {
    std::unique_lock lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return seen.size() >= 4; }));
  }
  auto t0 = Clock::now();
  watch.cancel();
  runner.join();
  EXPECT_LT(seconds_since(t0, Clock::now()), 3.0);
  ASSERT_EQ(seen.size(), 4u);  // not "/before" (older), not the key outside the prefix
  EXPECT_EQ(seen[0].type, WatchEvent::kPut);
  EXPECT_EQ(seen[0].kv.value, "1");
  EXPECT_EQ(seen[1].kv.value, "2");
  EXPECT_EQ(seen[2].type, WatchEvent::kDelete);
  EXPECT_EQ(seen[2].kv.key, prefix_ + "/a");
  EXPECT_EQ(seen[3].kv.value, "sibling");
}

TEST_F(EtcdTest, ARegistrationKeepsItsKeyPastTheTtlAndDeregisteringDeletesIt) {
  KeyRecorder keys(prefix_);
  ASSERT_TRUE(keys.status().ok()) << keys.status().message();
  std::string key = prefix_ + "/instance";
  Registration registration(test_etcd_client(), key, "value", 2);
  ASSERT_TRUE(registration.wait_registered(Deadline::after_ms(5000)));
  ASSERT_TRUE(keys.wait(Deadline::after_ms(5000), [&](const auto& k) { return k.count(key) > 0; }));
  // Twice the TTL later it is still there: the keep-alive renewed it.
  EXPECT_FALSE(keys.wait(Deadline::after_ms(4500), [&](const auto& k) { return !k.count(key); }));
  registration.deregister();
  EXPECT_TRUE(client_.get(key)->kvs.empty());
  registration.deregister();  // idempotent
}

TEST_F(EtcdTest, ARegistrationWhoseLeaseEndedRegistersAgain) {
  KeyRecorder keys(prefix_);
  std::string key = prefix_ + "/instance";
  Registration registration(test_etcd_client(), key, "value", 2);
  ASSERT_TRUE(registration.wait_registered(Deadline::after_ms(5000)));
  auto first = client_.get(key);
  ASSERT_EQ(first->kvs.size(), 1u);
  // As if etcd had lost it: the lease ends behind the registration's back.
  ASSERT_TRUE(client_.revoke_lease(first->kvs[0].lease).ok());
  ASSERT_TRUE(keys.wait(Deadline::after_ms(5000), [&](const KeyRecorder::Keys& k) {
    auto at = k.find(key);
    return at != k.end() && at->second.mod_revision > first->kvs[0].mod_revision;
  }));
  auto again = client_.get(key);
  ASSERT_EQ(again->kvs.size(), 1u);
  EXPECT_NE(again->kvs[0].lease, first->kvs[0].lease);
}

TEST_F(EtcdTest, ARegistrationPutsBackItsKeyWhenSomeoneDeletesOrReplacesIt) {
  KeyRecorder keys(prefix_);
  std::string key = prefix_ + "/instance";
  Registration registration(test_etcd_client(), key, "mine", 3);
  ASSERT_TRUE(registration.wait_registered(Deadline::after_ms(5000)));
  auto ours = [&](const KeyRecorder::Keys& k) {
    auto at = k.find(key);
    return at != k.end() && at->second.value == "mine";
  };
  // Deleted behind its back (its lease lives on): back within a renewal (TTL / 3).
  ASSERT_EQ(client_.delete_key(key).value(), 1);
  ASSERT_TRUE(keys.wait(Deadline::after_ms(4000),
                        [&](const KeyRecorder::Keys& k) { return !k.count(key); }));
  EXPECT_TRUE(keys.wait(Deadline::after_ms(4000), ours));
  // Replaced by another value: ours again.
  ASSERT_TRUE(client_.put(key, "rogue").ok());
  ASSERT_TRUE(keys.wait(Deadline::after_ms(4000), [&](const KeyRecorder::Keys& k) {
    auto at = k.find(key);
    return at != k.end() && at->second.value == "rogue";
  }));
  EXPECT_TRUE(keys.wait(Deadline::after_ms(4000), ours));
}

TEST(EtcdUnreachable, CallsFailWithinTheirTimeoutAndARegistrationNeverBlocks) {
  // A port nothing listens on (the fixture's peer port + 10).
  auto client = EtcdClient::create("http://127.0.0.1:23802", std::chrono::milliseconds(300));
  ASSERT_TRUE(client.ok());
  auto t0 = Clock::now();
  auto read = client->get("/x");
  EXPECT_EQ(read.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(read.status().message().find("127.0.0.1:23802"), std::string::npos);
  Registration registration(*client, "/x", "v", 3);
  EXPECT_FALSE(registration.wait_registered(Deadline::after_ms(500)));
  registration.deregister();
  EXPECT_LT(seconds_since(t0, Clock::now()), 5.0);
}

// A watch stream whose messages have fields of the wrong type (a peer that is not etcd,
// or a broken one): the watch reads what it can, ends with an error, and nothing throws.
TEST(EtcdWatchInput, FieldsOfTheWrongTypeEndTheWatchWithAStatusNotACrash) {
  httplib::Server fake;
  const std::string key = base64_encode("/ecx/m/instances/pd/pd-1");
  const std::string value = base64_encode("{}");
  fake.Post("/v3/watch", [&](const httplib::Request&, httplib::Response& res) {
    std::string body = R"({"result":{"header":{"revision":"5"},"created":1}})"
                       "\n"
                       R"({"result":{"header":{"revision":[]},"events":[{"type":7,"kv":{"key":")" +
                       key + R"(","value":")" + value +
                       R"(","mod_revision":"6"}},{"type":"DELETE"}]}})"
                       "\n"
                       R"({"result":{"canceled":true,"cancel_reason":5,"compact_revision":{}}})"
                       "\n";
    res.set_content(body, "application/json");
  });
  int port = fake.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread server([&] { fake.listen_after_bind(); });
  ASSERT_TRUE(ecx::testing::poll_until(
      Deadline::after_ms(5000), [&] { return fake.is_running(); }, std::chrono::milliseconds(10)));
  std::vector<WatchEvent> seen;
  Status ended;
  {
    EtcdWatch watch({"127.0.0.1", port}, "/ecx/m/instances/", 1, std::chrono::milliseconds(1000),
                    std::chrono::milliseconds(3000));
    ended = watch.run([&](const std::vector<WatchEvent>& batch, int64_t) {
      seen.insert(seen.end(), batch.begin(), batch.end());
    });
  }
  fake.stop();
  server.join();
  // The event with a numeric type is a put; the one without a kv is skipped; the
  // cancellation with a numeric reason and an object revision still ends the watch.
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].type, WatchEvent::kPut);
  EXPECT_EQ(seen[0].kv.key, "/ecx/m/instances/pd/pd-1");
  EXPECT_FALSE(ended.ok());
  EXPECT_NE(ended.message().find("etcd watch"), std::string::npos) << ended.message();
}

// etcd as a deployment should run it: TLS with a CA of its own, and authentication on,
// whose tokens expire (2 s here; etcd's default is 300 s).
TEST(EtcdSecure, OverTlsWithAUserWhoseTokenExpiresEveryCallStillWorks) {
  auto client = EtcdClient::create(ecx::testing::secure_etcd_url(), std::chrono::seconds(2),
                                   ecx::testing::secure_etcd_access());
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  const std::string key = unique_prefix("secure") + "/k";
  ASSERT_TRUE(client->put(key, "one").ok());
  // Past the token's life: the next call is refused for its token, authenticates again
  // and is retried. A wait on time itself: etcd's simple tokens live 2 s past their last
  // use, so asking etcd whether it has expired would keep it alive.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  auto read = client->get(key);
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  ASSERT_EQ(read->kvs.size(), 1u);
  EXPECT_EQ(read->kvs[0].value, "one");
  // A watch carries the token too.
  auto token = client->token();
  ASSERT_TRUE(token.ok());
  EtcdWatch watch(client->endpoint(), key, read->revision + 1, std::chrono::seconds(2),
                  std::chrono::seconds(10), *token, ecx::testing::secure_etcd_access().ca_file);
  std::vector<WatchEvent> seen;
  // Written before the watch starts: a watch from read->revision + 1 replays it, so no
  // wait is needed for the watch to be in place first.
  ASSERT_TRUE(client->put(key, "two").ok());
  Status ended = watch.run([&](const std::vector<WatchEvent>& batch, int64_t) {
    seen.insert(seen.end(), batch.begin(), batch.end());
    watch.cancel(std::chrono::milliseconds(0));
  });
  ASSERT_FALSE(seen.empty()) << ended.to_string();
  EXPECT_EQ(seen[0].kv.value, "two");
  EXPECT_TRUE(client->delete_key(key).ok());
}

TEST(EtcdSecure, NoUserAWrongPasswordOrAnUntrustedCertificateIsRefusedWithAClearError) {
  const auto url = ecx::testing::secure_etcd_url();
  const auto access = ecx::testing::secure_etcd_access();
  const std::string key = unique_prefix("secure") + "/k";
  auto anonymous = EtcdClient::create(url, std::chrono::seconds(2), {.ca_file = access.ca_file});
  ASSERT_TRUE(anonymous.ok());
  Status s = anonymous->put(key, "x");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("user name is empty"), std::string::npos) << s.to_string();

  auto wrong = EtcdClient::create(url, std::chrono::seconds(2),
                                  {.ca_file = access.ca_file, .user = "ecx", .password = "nope"});
  ASSERT_TRUE(wrong.ok());
  s = wrong->put(key, "x");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("etcd user 'ecx'"), std::string::npos) << s.to_string();

  // Without the CA, etcd's certificate is not trusted: no request is sent.
  EtcdAccess no_ca = access;
  no_ca.ca_file.clear();
  auto untrusting = EtcdClient::create(url, std::chrono::seconds(2), no_ca);
  ASSERT_TRUE(untrusting.ok());
  s = untrusting->put(key, "x");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();

  // A certificate for another name (the test CA's is for 127.0.0.1 alone): refused too.
  auto other_name = EtcdClient::create(
      "https://localhost:" + std::to_string(parse_etcd_endpoints(url).value()[0].port),
      std::chrono::seconds(2), access);
  ASSERT_TRUE(other_name.ok());
  s = other_name->put(key, "x");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("tls handshake"), std::string::npos) << s.to_string();

  // The user may not touch keys outside its prefix.
  auto user = EtcdClient::create(url, std::chrono::seconds(2), access);
  ASSERT_TRUE(user.ok());
  EXPECT_EQ(user->put("/elsewhere", "x").code(), StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace ecx::directory
