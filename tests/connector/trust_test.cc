// The p2p connector against a client or peer that lies (docs/SECURITY.md): forged or
// tampered ec_transfer_params, a release of someone else's pin, a producer whose replies
// are malformed, and a request deadline shorter than the load timeout. The producer is
// another process (`ecx bench connector-peer`) unless the test needs it to misbehave.
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"
#include "support/connector_peer_process.h"

namespace ecx::connector {
namespace {

using ecx::testing::ConnectorPeer;
using nlohmann::json;

const TensorMeta kItem{DType::kBF16, {400, 2048}};
const std::string kSecret = "trust-test-deployment-secret";

MmHash hash_of(const std::string& tag) { return MmHash::sha256_of({"trust", tag}); }

class P2pTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int counter = 0;
    tag_ = std::to_string(::getpid()) + "-" + std::to_string(counter++);
  }

  json extra(json overrides = json::object()) const {
    json e = {{"engine_id", "e-" + tag_},
              {"pool_bytes", "64MiB"},
              {"load_timeout_ms", 20000},
              {"auth_token", kSecret}};
    e.update(overrides);
    return e;
  }

  void start_producer(json overrides = json::object()) {
    auto p = ConnectorPeer::start(
        {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra(overrides)}});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    producer_.emplace(std::move(*p));
  }

  void make_consumer(json overrides = json::object()) {
    json e = extra(overrides);
    e["engine_id"] = "pd-" + tag_;
    ConnectorConfig config{.connector = "p2p", .role = Role::kConsumer, .extra = e};
    ConnectorContext ctx;
    ctx.recompute = [this](const MmHash& h, const TensorMeta&, std::span<std::byte> out) {
      auto it = seeds_.find(h);
      if (it == seeds_.end()) return NotFound("test encoder does not know " + h.str());
      fill_pattern(out.data(), out.size(), it->second);
      return Status::Ok();
    };
    auto c = create_connector(config, ctx);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    consumer_ = std::move(*c);
  }

  EcTransferParams save(const std::string& tag, uint64_t seed) {
    seeds_[hash_of(tag)] = seed;
    auto p = producer_->save(hash_of(tag), seed, kItem);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? *p : EcTransferParams{};
  }

  LoadOutcome load(const std::string& id, const MmHash& item, std::optional<EcTransferParams> p,
                   Deadline deadline = Deadline::after_ms(60000)) {
    LoadRequest r{.request_id = id, .items = {{item, kItem, std::move(p)}}};
    return consumer_->load(r, deadline);
  }

  // The consumer holds `tag`'s bytes for request `id`.
  void expect_bytes(const std::string& id, const std::string& tag) {
    auto ref = consumer_->loaded(id, hash_of(tag));
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    std::vector<std::byte> want(kItem.byte_size());
    fill_pattern(want.data(), want.size(), seeds_.at(hash_of(tag)));
    EXPECT_EQ(checksum64(ref->payload(), want.size()), checksum64(want.data(), want.size()));
  }

  // Another member of the deployment (it has the secret), connected to the producer of
  // `p`; null if it could not connect.
  std::unique_ptr<transfer::Agent> member_connected_to(const EcTransferParams& p,
                                                       const std::string& name) {
    transfer::AgentConfig ac;
    ac.name = name;
    ac.compat_hash = p.compat_hash;
    ac.auth_secret = kSecret;
    auto agent = transfer::Agent::create(ac);
    auto meta = transfer::AgentMetadata::parse(p.agent);
    if (!agent.ok() || !meta.ok() || !(*agent)->connect(*meta).ok()) return nullptr;
    return std::move(*agent);
  }

  uint64_t producer_pins() {
    auto s = producer_->stats();
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? (*s)["producer_pool"]["pins"].get<uint64_t>() : 0;
  }

  std::string tag_;
  std::map<MmHash, uint64_t> seeds_;
  std::optional<ConnectorPeer> producer_;
  std::unique_ptr<EcConnector> consumer_;
};

TEST_F(P2pTrustTest, ForgedOrTamperedParamsAreIgnoredAndTheItemComputedHere) {
  start_producer();
  make_consumer();
  EcTransferParams a = save("a", 1), b = save("b", 2);
  // A fresh image per forgery: a cached one would be a local hit, not a test of params.
  for (int i = 1; i <= 3; ++i) seeds_[hash_of("victim" + std::to_string(i))] = 2 + i;

  EcTransferParams unsigned_params = b;
  unsigned_params.signature.clear();
  EcTransferParams wrong_key = b;
  wrong_key.sign("an attacker's guess");
  EcTransferParams moved = a;
  moved.offset = b.offset;  // a's params pointed at b's block: the signature breaks
  std::vector<std::pair<std::string, EcTransferParams>> forgeries = {
      {"victim1", unsigned_params}, {"victim2", wrong_key}, {"a", moved}};
  int n = 0;
  for (auto& [tag, params] : forgeries) {
    std::string id = "forged-" + std::to_string(n++);
    auto out = load(id, hash_of(tag), params);
    ASSERT_TRUE(out.status.ok()) << out.status.to_string();
    EXPECT_TRUE(out.items[0].recomputed) << id;  // never loaded from what the params said
    expect_bytes(id, tag);
    consumer_->request_finished(id);
  }
  // Genuine params of another image, presented for this one: ignored as well.
  auto swapped = load("swapped", hash_of("victim3"), b);
  ASSERT_TRUE(swapped.status.ok()) << swapped.status.to_string();
  EXPECT_TRUE(swapped.items[0].recomputed);
  expect_bytes("swapped", "victim3");
  EXPECT_EQ(consumer_->stats().params_rejected, 4u);
  // The genuine params still load, with no recompute.
  auto good = load("good", hash_of("b"), save("b", 2));
  ASSERT_TRUE(good.status.ok()) << good.status.to_string();
  EXPECT_FALSE(good.items[0].recomputed);
  expect_bytes("good", "b");
}

TEST_F(P2pTrustTest, APeerReleasesOnlyThePinsItHolds) {
  start_producer({{"lease_ms", 600000}});  // only a RELEASE can end the pin
  EcTransferParams p = save("a", 1);
  ASSERT_EQ(producer_pins(), 1u);
  // Another member of the deployment (it has the secret) tries to end the pin.
  auto meddler = member_connected_to(p, "meddler-" + tag_);
  ASSERT_NE(meddler, nullptr);
  auto notify_then_sync = [&](const std::string& message) {
    ASSERT_TRUE(meddler->notify(p.engine_id, message).ok());
    // A call on the same connection is handled after the notification: a barrier.
    auto r = meddler->call(p.engine_id, R"({"op":"lookup","items":[]})", Deadline::after_ms(10000));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
  };
  std::string guessed = transfer::Capability::random().hex();
  notify_then_sync(json{{"op", "release"}, {"pins", {{{"pin", p.pin}}}}}.dump());
  notify_then_sync(
      json{{"op", "release"}, {"pins", {{{"pin", p.pin}, {"capability", guessed}}}}}.dump());
  notify_then_sync(R"({"op":"release","pins":[7]})");
  notify_then_sync(R"({"op":"release","pin":1})");
  EXPECT_EQ(producer_pins(), 1u) << "a forged release ended a pin";
  // The holder of the capability can.
  notify_then_sync(
      json{{"op", "release"}, {"pins", {{{"pin", p.pin}, {"capability", p.capability}}}}}.dump());
  EXPECT_EQ(producer_pins(), 0u);
}

// A renew keeps a pin alive past its lease (zero-copy views): only with the capability it
// was granted with, for its own item and pin.
TEST_F(P2pTrustTest, APeerRenewsOnlyThePinsItWasHanded) {
  start_producer({{"lease_ms", 600}});  // renewed every 100 ms: six times within a lease
  EcTransferParams a = save("a", 1), b = save("b", 2);
  auto peer = member_connected_to(a, "renewer-" + tag_);
  ASSERT_NE(peer, nullptr);
  auto renew = [&](const MmHash& h, uint64_t pin, const std::string& capability) {
    json item = {{"mm_hash", h.str()}, {"pin", pin}, {"capability", capability}};
    auto r = peer->call(a.engine_id, json{{"op", "renew"}, {"items", {item}}}.dump(),
                        Deadline::after_ms(10000));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? json::parse(*r)["items"][0]["status"].get<std::string>() : "";
  };
  // Forged renewals of `a`: a guessed capability, b's capability, a's with b's pin.
  const std::string guessed = transfer::Capability::random().hex();
  for (Deadline until = Deadline::after_ms(1800); !until.expired();) {
    EXPECT_NE(renew(a.mm_hash, a.pin, guessed), "ok");
    EXPECT_NE(renew(a.mm_hash, a.pin, b.capability), "ok");
    EXPECT_NE(renew(a.mm_hash, b.pin, a.capability), "ok");
    EXPECT_EQ(renew(b.mm_hash, b.pin, b.capability), "ok");  // the holder of b's
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // Three leases later, a's pin ran out and b's, renewed by its holder, did not.
  auto stats = producer_->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ((*stats)["producer_pool"]["pins"].get<uint64_t>(), 1u) << stats->dump();
  EXPECT_EQ((*stats)["producer_pool"]["lease_expiries"].get<uint64_t>(), 1u);
  EXPECT_GE((*stats)["renewals_received"].get<uint64_t>(), 3u);
}

TEST_F(P2pTrustTest, AnItemAlreadyCachedGivesBackThePinItsParamsCarried) {
  start_producer({{"lease_ms", 600000}});  // only a RELEASE can end these pins
  make_consumer();
  auto first = load("r1", hash_of("a"), save("a", 1));
  ASSERT_TRUE(first.status.ok()) << first.status.to_string();
  consumer_->request_finished("r1");
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  // E hands out fresh params (a new pin) for the same image; PD already has it.
  auto again = load("r2", hash_of("a"), save("a", 1));
  ASSERT_TRUE(again.status.ok()) << again.status.to_string();
  EXPECT_TRUE(again.items[0].local_hit);
  consumer_->request_finished("r2");
  // Released by the consumer long before the 10-minute lease.
  auto drained = producer_->command("wait-unpinned 20000");
  EXPECT_TRUE(drained.ok()) << drained.status().to_string();
  EXPECT_EQ(producer_pins(), 0u);
}

// A producer of the deployment (it has the secret) whose replies are garbage.
class BrokenProducer {
 public:
  BrokenProducer(const std::string& name, const std::string& compat_hash) {
    transfer::AgentConfig ac;
    ac.name = name;
    ac.compat_hash = compat_hash;
    ac.auth_secret = kSecret;
    agent_ = std::move(transfer::Agent::create(ac).value());
    agent_->set_call_handler([this](const transfer::Caller&, std::string_view) {
      std::lock_guard lock(mu_);
      return Result<std::string>(reply_);
    });
  }
  void reply_with(std::string reply) {
    std::lock_guard lock(mu_);
    reply_ = std::move(reply);
  }
  EcTransferParams params_for(const MmHash& mm_hash) const {
    EcTransferParams p;
    p.connector = "p2p";
    p.mode = "pull-2step";
    p.engine_id = agent_->name();
    p.agent = agent_->metadata().to_json();
    p.compat_hash = agent_->config().compat_hash;
    p.mm_hash = mm_hash;
    p.meta = kItem;
    p.region = 1;
    p.length = kItem.byte_size() + 256;
    p.capability = transfer::Capability::random().hex();
    p.sign(kSecret);
    return p;
  }

 private:
  std::unique_ptr<transfer::Agent> agent_;
  std::mutex mu_;
  std::string reply_;  // guarded by mu_
};

TEST_F(P2pTrustTest, MalformedProducerRepliesFailTheLoadAndLeaveNothingWriting) {
  make_consumer({{"mode", "pull-2step"}, {"failure_policy", "fail"}, {"compat_hash", "h"}});
  BrokenProducer broken("broken-" + tag_, "h");
  const std::vector<std::string> replies = {
      R"({"items":[7]})",
      R"({"items":"many"})",
      R"([1,2,3])",
      R"({"items":[{"mm_hash":"zz","status":5}]})",
      R"({"items":[{"mm_hash":"x","status":"ok","region":-1}]})",
      "not json at all",
      std::string(100000, '['),
      R"({"items":[]})"};
  const MmHash item = hash_of("item");
  seeds_[item] = 5;
  int n = 0;
  for (const auto& reply : replies) {
    broken.reply_with(reply);
    for (int attempt = 0; attempt < 2; ++attempt) {  // the second finds nothing stuck
      std::string id = "bad-" + std::to_string(n++);
      auto out = load(id, item, broken.params_for(item));
      ASSERT_FALSE(out.status.ok()) << reply;
      EXPECT_NE(out.status.code(), StatusCode::kNotReady) << out.status.to_string();
      EXPECT_NE(out.status.code(), StatusCode::kDeadlineExceeded) << out.status.to_string();
      consumer_->request_finished(id);
    }
  }
  // With policy recompute the same replies end in a local encode, and right bytes.
  make_consumer({{"mode", "pull-2step"}, {"failure_policy", "recompute"}, {"compat_hash", "h"}});
  for (const auto& reply : replies) {
    broken.reply_with(reply);
    std::string id = "recompute-" + std::to_string(n++);
    const MmHash fresh = hash_of(id);  // not cached by an earlier recompute
    seeds_[fresh] = n;
    auto out = load(id, fresh, broken.params_for(fresh));
    ASSERT_TRUE(out.status.ok()) << reply << ": " << out.status.to_string();
    EXPECT_TRUE(out.items[0].recomputed);
    consumer_->request_finished(id);
  }
}

TEST_F(P2pTrustTest, ARequestDeadlineShorterThanTheLoadTimeoutIsHonoured) {
  start_producer();
  make_consumer({{"load_timeout_ms", 120000}, {"failure_policy", "fail"}, {"mode", "pull-2step"}});
  EcTransferParams p = save("a", 1);
  ASSERT_TRUE(producer_->process().kill(SIGSTOP).ok());
  auto start = Clock::now();
  auto out = load("r1", hash_of("a"), p, Deadline::after_ms(500));
  ASSERT_TRUE(producer_->process().kill(SIGCONT).ok());
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), StatusCode::kDeadlineExceeded) << out.status.to_string();
  // Bounded by the request's deadline, not the 120 s load timeout (a loose bound: tests
  // do not measure speed).
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(60));
}

}  // namespace
}  // namespace ecx::connector
