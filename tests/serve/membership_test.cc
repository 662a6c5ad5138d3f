// Membership through etcd with real `ecx serve` processes and the test etcd (CTest's
// fixture): instances register under a lease, the proxy routes to what it finds there,
// a newcomer gets requests, a draining instance leaves before it exits, a dead one
// leaves when its lease ends, and what is not a usable value never hurts the proxy.
// The times printed as "[ measure ]" are figures, not assertions (speed is for the
// benchmarks); the assertions are functional bounds.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "ecx/directory/instance.h"
#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"
#include "support/etcd_events.h"
#include "support/poll.h"
#include "support/service_process.h"
#include "support/stack_secret.h"

namespace ecx::serve {
namespace {

using ecx::testing::chat;
using ecx::testing::image_request;
using ecx::testing::KeyRecorder;
using ecx::testing::Service;
using ecx::testing::start;
using nlohmann::json;

constexpr int kTtl = 2;  // seconds: the lease of every instance here

// Flags of a service on any free port; connector "local" (PD encodes) or "p2p".
std::vector<std::string> plain_flags(const std::string& connector) {
  json ec = {{"connector", connector}, {"extra", {{"pool_bytes", "96MiB"}}}};
  return {"--port", "0", "--ec-config", ec.dump(), "--connector", connector};
}

// The same, in etcd under `prefix`.
std::vector<std::string> flags(const std::string& connector, const std::string& prefix) {
  std::vector<std::string> out = plain_flags(connector);
  out.insert(out.end(), {"--etcd", ecx::testing::test_etcd_url(), "--etcd-prefix", prefix,
                         "--etcd-ttl", std::to_string(kTtl)});
  return out;
}

using ecx::testing::poll_until;

// The proxy's GET /v1/upstreams entry for `url`, or null when it is not listed.
json upstream(const Service& proxy, const std::string& url) {
  auto res = proxy.client(5).Get("/v1/upstreams");
  if (!res || res->status != 200) return json();
  json doc = json::parse(res->body, nullptr, false);
  if (!doc.is_object() || !doc["upstreams"].is_array()) return json();
  for (const auto& u : doc["upstreams"]) {
    if (u["url"] == url) return u;
  }
  return json();
}

bool routed_to(const Service& proxy, const Service& s) {
  json u = upstream(proxy, s.url);
  return u.is_object() && u["reachable"] == true;
}

bool alive(Service& s) { return !s.process->wait(Deadline::after_ms(0)).ok(); }

// A PD's count of requests it answered (ecx_requests_total{status="ok"}).
int answered(const Service& pd) {
  auto res = pd.client(5).Get("/metrics");
  if (!res) return -1;
  const std::string key = "ecx_requests_total{status=\"ok\"} ";
  auto at = res->body.find(key);
  return at == std::string::npos ? 0 : std::atoi(res->body.c_str() + at + key.size());
}

double seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

class MembershipThroughEtcd : public ::testing::Test {
 protected:
  void SetUp() override {
    Status health = ecx::testing::test_etcd_health();
    ASSERT_TRUE(health.ok()) << health.message();
    prefix_ = ecx::testing::unique_prefix("serve");
    instances_ = directory::instances_prefix(prefix_, "ecx-tiny-vl");
  }
  void TearDown() override {
    ecx::testing::test_etcd_client().delete_prefix(prefix_).status().ignore_error();
  }

  std::string prefix_;
  std::string instances_;  // <prefix>/ecx-tiny-vl/instances/
};

TEST_F(MembershipThroughEtcd, AnInstanceRegistersAndItsKeyGoesWithinTheTtlAfterSigkill) {
  KeyRecorder keys(instances_);
  ASSERT_TRUE(keys.status().ok()) << keys.status().message();
  Service pd;
  ASSERT_TRUE(start(pd, "pd", flags("local", prefix_)).ok());
  // Registered before its listening line.
  auto record = ecx::testing::test_etcd_client().range_prefix(instances_ + "pd/");
  ASSERT_TRUE(record.ok()) << record.status().message();
  ASSERT_EQ(record->kvs.size(), 1u);
  json value = json::parse(record->kvs[0].value, nullptr, false);
  EXPECT_EQ(value["url"], pd.url) << record->kvs[0].value;
  EXPECT_EQ(value["role"], "pd");
  EXPECT_EQ(value["model"], "ecx-tiny-vl");
  EXPECT_TRUE(value["compat_hash"].is_string() && !value["compat_hash"].empty());
  EXPECT_EQ(record->kvs[0].key, instances_ + "pd/" + value["id"].get<std::string>());
  std::string key = record->kvs[0].key;
  ASSERT_TRUE(keys.wait(Deadline::after_ms(5000), [&](const auto& k) { return k.count(key) > 0; }));

  ASSERT_TRUE(pd.process->kill(SIGKILL).ok());
  auto killed = Clock::now();
  Clock::time_point gone;
  ASSERT_TRUE(keys.wait(
      Deadline::after_ms((kTtl + 5) * 1000), [&](const auto& k) { return !k.count(key); }, &gone));
  std::printf("[ measure ] SIGKILL -> key deleted by etcd: %.2f s (lease TTL %d s)\n",
              seconds(killed, gone), kTtl);
}

TEST_F(MembershipThroughEtcd, AProxyWithOnlyEtcdFindsItsEncoderAndPdAndIgnoresBadValues) {
  Service proxy, encoder, pd;
  auto proxy_flags = flags("p2p", prefix_);
  ASSERT_TRUE(start(proxy, "proxy", proxy_flags).ok());  // no --pd, no --encoders
  auto before = proxy.client(5).Get("/health");
  ASSERT_TRUE(before);
  EXPECT_EQ(before->status, 503) << before->body;  // no PD known yet

  // Values that are not instances, under the proxy's prefix.
  auto etcd = ecx::testing::test_etcd_client();
  ASSERT_TRUE(etcd.put(instances_ + "pd/garbage", "not json").ok());
  ASSERT_TRUE(etcd.put(instances_ + "pd/fields", R"({"id":"fields","url":[1]})").ok());
  ASSERT_TRUE(etcd.put(instances_ + "pd/badurl",
                       R"({"id":"badurl","url":"http://nohost","role":"pd",)"
                       R"("model":"ecx-tiny-vl","compat_hash":"x"})")
                  .ok());

  ASSERT_TRUE(start(encoder, "encoder", flags("p2p", prefix_)).ok());
  ASSERT_TRUE(start(pd, "pd", flags("p2p", prefix_)).ok());
  auto t0 = Clock::now();
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000),
                         [&] { return routed_to(proxy, encoder) && routed_to(proxy, pd); }))
      << upstream(proxy, pd.url) << upstream(proxy, encoder.url);
  std::printf("[ measure ] E and PD listening -> routed to by the proxy: %.3f s\n",
              seconds(t0, Clock::now()));
  json listed = upstream(proxy, pd.url);
  EXPECT_EQ(listed["source"], "etcd");
  EXPECT_EQ(listed["role"], "pd");

  auto res = chat(proxy, image_request(1));
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  // The encoder encoded the image: the PD loaded it, it did not recompute it.
  EXPECT_EQ(json::parse(res->body)["ecx_timings"]["items_recomputed"], 0) << res->body;

  auto all = proxy.client(5).Get("/v1/upstreams");
  ASSERT_TRUE(all);
  EXPECT_EQ(json::parse(all->body)["upstreams"].size(), 2u) << all->body;  // no bad value
  auto metrics = proxy.client(5).Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("ecx_proxy_upstreams{role=\"pd\"} 1"), std::string::npos);
  EXPECT_NE(
      metrics->body.find("ecx_proxy_membership_changes_total{role=\"pd\",change=\"added\"} 1"),
      std::string::npos)
      << metrics->body;
}

TEST_F(MembershipThroughEtcd, ANewPdGetsRequestsADrainingOneNoneAndADeadOneLeaves) {
  // One PD given on the command line, the others found in etcd.
  Service proxy, pd1, pd2, pd3;
  ASSERT_TRUE(start(pd1, "pd", plain_flags("local")).ok());  // not in etcd
  auto proxy_flags = flags("local", prefix_);
  proxy_flags.insert(proxy_flags.end(), {"--pd", pd1.url});
  ASSERT_TRUE(start(proxy, "proxy", proxy_flags).ok());
  EXPECT_EQ(upstream(proxy, pd1.url)["source"], "static");

  // A newcomer: routed to within about a second, and given requests.
  ASSERT_TRUE(start(pd2, "pd", flags("local", prefix_)).ok());
  auto joined = Clock::now();
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000), [&] { return routed_to(proxy, pd2); }));
  auto routable = Clock::now();
  // Requests in pairs: the least-loaded PD takes each, so one of a pair goes to pd2.
  bool served = poll_until(Deadline::after_ms(20000), [&] {
    std::thread other([&] { chat(proxy, image_request(11, 16)); });
    chat(proxy, image_request(12, 16));
    other.join();
    return answered(pd2) > 0;
  });
  EXPECT_TRUE(served);
  std::printf("[ measure ] PD joined -> routed to: %.3f s; -> first request served: %.3f s\n",
              seconds(joined, routable), seconds(joined, Clock::now()));

  // SIGTERM while pd2 streams a long answer: it leaves the proxy first, then finishes the
  // stream, then exits.
  KeyRecorder keys(instances_);
  ASSERT_TRUE(keys.status().ok()) << keys.status().message();
  auto registered = keys.keys();
  ASSERT_EQ(registered.size(), 1u);  // pd2's (pd1 is static)
  const std::string pd2_key = registered.begin()->first;
  std::atomic<bool> signalled{false};
  std::string streamed;
  std::thread reader([&] {
    httplib::Client cli = pd2.client();
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = image_request(13, 2048, /*stream=*/true);  // about 1.5 s here
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      streamed.append(data, n);
      if (!signalled.exchange(true)) {
        EXPECT_TRUE(pd2.process->kill(SIGTERM).ok());
      }
      return true;
    };
    auto result = cli.send(req);
    EXPECT_TRUE(result) << httplib::to_string(result.error());
  });
  ASSERT_TRUE(poll_until(Deadline::after_ms(20000), [&] { return signalled.load(); }));
  auto term = Clock::now();
  ASSERT_TRUE(
      poll_until(Deadline::after_ms(5000), [&] { return upstream(proxy, pd2.url).is_null(); }));
  auto left = Clock::now();
  bool alive_when_left = alive(pd2);
  reader.join();
  auto exit_code = pd2.process->wait(Deadline::after_ms(30000));
  auto exited = Clock::now();
  ASSERT_TRUE(exit_code.ok());
  EXPECT_EQ(*exit_code, 0);
  EXPECT_NE(streamed.find("data: [DONE]"), std::string::npos)
      << "the in-flight stream was not finished: " << streamed.substr(streamed.size() - 200);
  EXPECT_TRUE(alive_when_left) << "pd2 had exited before the proxy dropped it";
  Clock::time_point key_gone;
  ASSERT_TRUE(keys.wait(
      Deadline::after_ms(1000), [&](const auto& k) { return !k.count(pd2_key); }, &key_gone));
  EXPECT_LT(key_gone, exited) << "pd2's key outlived pd2";
  std::printf("[ measure ] SIGTERM -> left the proxy: %.3f s; -> exited: %.3f s\n",
              seconds(term, left), seconds(term, exited));
  for (int i = 0; i < 4; ++i) {  // nothing goes to it any more
    auto res = chat(proxy, image_request(20 + i));
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  }

  // SIGKILL: gone from the proxy within the lease (plus a second).
  ASSERT_TRUE(start(pd3, "pd", flags("local", prefix_)).ok());
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000), [&] { return routed_to(proxy, pd3); }));
  ASSERT_TRUE(pd3.process->kill(SIGKILL).ok());
  auto killed = Clock::now();
  std::optional<double> unreachable_s;
  ASSERT_TRUE(poll_until(Deadline::after_ms((kTtl + 5) * 1000), [&] {
    json u = upstream(proxy, pd3.url);
    if (!unreachable_s && (u.is_null() || u["reachable"] == false)) {
      unreachable_s = seconds(killed, Clock::now());
    }
    return u.is_null();
  }));
  std::printf("[ measure ] SIGKILL -> marked unreachable: %.3f s; -> removed: %.3f s (TTL %d s)\n",
              unreachable_s.value_or(-1), seconds(killed, Clock::now()), kTtl);
  auto res = chat(proxy, image_request(30));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

// Flags of a service that reaches the secure test etcd (https, user and password).
std::vector<std::string> secure_flags(const std::string& connector, const std::string& prefix) {
  std::vector<std::string> out = plain_flags(connector);
  const std::string dir = ecx::testing::secure_etcd_dir();
  out.insert(out.end(), {"--etcd", ecx::testing::secure_etcd_url(), "--etcd-prefix", prefix,
                         "--etcd-ttl", std::to_string(kTtl), "--etcd-cacert", dir + "/ca.pem",
                         "--etcd-user", "ecx", "--etcd-password-file", dir + "/ecx.password"});
  return out;
}

// What an attacker who can write to etcd (but does not hold the deployment secret) tries:
// records of its own, a real record pointed elsewhere, the proxy listed as a PD, the
// real PD's key deleted and overwritten. Only the deployment's instances get traffic,
// and the real PD puts its key back.
TEST(MembershipThroughSecureEtcd, OnlyInstancesThatProveTheSecretGetTrafficAndKeysComeBack) {
  ecx::testing::use_new_stack_secret();  // E, PD and the proxy share it; nobody else knows it
  const std::string secret = std::getenv("ECX_AUTH_TOKEN");
  const std::string prefix = ecx::testing::unique_prefix("secure-serve");
  const std::string instances = directory::instances_prefix(prefix, "ecx-tiny-vl");
  auto etcd = directory::EtcdClient::create(
      ecx::testing::secure_etcd_url(), std::chrono::seconds(2), ecx::testing::secure_etcd_access());
  ASSERT_TRUE(etcd.ok()) << etcd.status().to_string();

  // The attacker's service: answers anything, and counts what reaches it.
  httplib::Server rogue;
  std::atomic<int> rogue_hits{0};
  auto answer = [&](const httplib::Request&, httplib::Response& res) {
    rogue_hits++;
    res.set_content(R"({"choices":[{"message":{"content":"rogue"}}]})", "application/json");
  };
  rogue.Get(".*", answer);
  rogue.Post(".*", answer);
  int rogue_port = rogue.bind_to_any_port("127.0.0.1");
  ASSERT_GT(rogue_port, 0);
  std::thread rogue_thread([&] { rogue.listen_after_bind(); });
  const std::string rogue_url = "http://127.0.0.1:" + std::to_string(rogue_port);

  Service proxy, encoder, pd;
  ASSERT_TRUE(start(proxy, "proxy", secure_flags("p2p", prefix)).ok());
  ASSERT_TRUE(start(encoder, "encoder", secure_flags("p2p", prefix)).ok());
  ASSERT_TRUE(start(pd, "pd", secure_flags("p2p", prefix)).ok());
  auto joined = Clock::now();
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000),
                         [&] { return routed_to(proxy, encoder) && routed_to(proxy, pd); }));
  std::printf("[ measure ] PD listening -> proven and routed to: %.3f s\n",
              seconds(joined, Clock::now()));
  auto registered = etcd->range_prefix(instances + "pd/");
  ASSERT_TRUE(registered.ok() && registered->kvs.size() == 1u);
  const directory::KeyValue real_pd = registered->kvs[0];
  auto real = directory::parse_instance(real_pd.key, real_pd.value, instances).value();
  EXPECT_FALSE(real.mac.empty());

  // (a) records of its own, unsigned, for a PD and an encoder;
  for (const char* role : {"pd", "encoder"}) {
    directory::Instance fake{std::string(role) + "-rogue", rogue_url, role, "ecx-tiny-vl",
                             real.compat_hash};
    ASSERT_TRUE(
        etcd->put(directory::instance_key(prefix, fake), directory::instance_value(fake)).ok());
  }
  // (b) the real PD's signed record, copied with the rogue's URL;
  directory::Instance moved = real;
  moved.id = "pd-moved";
  moved.url = rogue_url;
  ASSERT_TRUE(
      etcd->put(directory::instance_key(prefix, moved), directory::instance_value(moved)).ok());
  // (c) the proxy itself as a PD, even signed with the secret (a misconfiguration).
  directory::Instance self{"pd-self", proxy.url, "pd", "ecx-tiny-vl", real.compat_hash};
  const std::string self_key = directory::instance_key(prefix, self);
  directory::sign_instance(self, self_key, secret);
  ASSERT_TRUE(etcd->put(self_key, directory::instance_value(self)).ok());

  // The proxy challenged (c) and refused it; (a) and (b) never became members.
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000), [&] {
    json u = upstream(proxy, proxy.url);
    return u.is_object() && u["proven"] == false && !u["last_error"].get<std::string>().empty();
  })) << upstream(proxy, proxy.url);
  EXPECT_EQ(upstream(proxy, proxy.url)["reachable"], false);
  EXPECT_TRUE(upstream(proxy, rogue_url).is_null());
  for (int i = 0; i < 6; ++i) {
    auto res = chat(proxy, image_request(40 + i));
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
    EXPECT_EQ(res->body.find("rogue"), std::string::npos);
  }

  // The real PD's key deleted, then overwritten: the PD puts its own back each time.
  auto pd_record = [&] {
    auto now = etcd->get(real_pd.key);
    return now.ok() && now->kvs.size() == 1u ? now->kvs[0].value : std::string();
  };
  ASSERT_EQ(etcd->delete_key(real_pd.key).value(), 1);
  auto deleted = Clock::now();
  EXPECT_TRUE(poll_until(Deadline::after_ms((kTtl + 1) * 1000),
                         [&] { return pd_record() == real_pd.value; }));
  std::printf("[ measure ] PD key deleted -> put back: %.3f s (TTL %d s)\n",
              seconds(deleted, Clock::now()), kTtl);
  directory::Instance hijack = real;
  hijack.url = rogue_url;
  hijack.mac.clear();
  ASSERT_TRUE(etcd->put(real_pd.key, directory::instance_value(hijack)).ok());
  auto replaced = Clock::now();
  EXPECT_TRUE(poll_until(Deadline::after_ms((kTtl + 1) * 1000),
                         [&] { return pd_record() == real_pd.value; }));
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000), [&] { return routed_to(proxy, pd); }));
  std::printf("[ measure ] PD key replaced -> put back and routed to again: %.3f s\n",
              seconds(replaced, Clock::now()));
  auto res = chat(proxy, image_request(50));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(rogue_hits.load(), 0) << "the rogue service was sent traffic";

  // A PD that dies leaves within the lease (plus a second), proof or not.
  ASSERT_TRUE(pd.process->kill(SIGKILL).ok());
  auto killed = Clock::now();
  EXPECT_TRUE(poll_until(Deadline::after_ms((kTtl + 1) * 1000),
                         [&] { return upstream(proxy, pd.url).is_null(); }));
  std::printf("[ measure ] PD SIGKILL -> removed from the proxy: %.3f s (TTL %d s)\n",
              seconds(killed, Clock::now()), kTtl);

  rogue.stop();
  rogue_thread.join();
  etcd->delete_prefix(prefix).status().ignore_error();
}

}  // namespace
}  // namespace ecx::serve
