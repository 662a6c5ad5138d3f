// Telling a consumer early (EcConnector::offer): E's scheduler sends a PD the params it
// issued for a request's items; the PD loads them into its cache before the request
// reaches it, and the request, when it comes, finds them there and gives their pins back.
// Real processes and agents: E's worker (a producer) in a process of its own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"
#include "support/connector_peer_process.h"
#include "support/poll.h"

namespace ecx::connector {
namespace {

const TensorMeta kItem{DType::kBF16, {16, 256}};
const std::string kSecret = "offer-test-secret";

nlohmann::json extra_for(const std::string& engine_id, const std::string& secret = kSecret) {
  return {{"engine_id", engine_id},
          {"pool_bytes", "16MiB"},
          {"lease_ms", 600000},
          {"auth_token", secret}};
}

std::unique_ptr<EcConnector> make(nlohmann::json extra) {
  auto c =
      create_connector({.connector = "p2p", .role = Role::kConsumer, .extra = std::move(extra)});
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? std::move(*c) : nullptr;
}

// Where peers dial `c`'s agent over tcp ("host:port").
std::string tcp_address(const EcConnector& c) {
  auto meta = transfer::AgentMetadata::parse(c.agent_metadata());
  EXPECT_TRUE(meta.ok()) << meta.status().to_string();
  return meta.ok() ? meta->endpoint(transfer::Backend::kTcp) : std::string();
}

bool holds_pattern(const cache::BlockRef& ref, uint64_t seed) {
  std::vector<std::byte> want(kItem.byte_size());
  fill_pattern(want.data(), want.size(), seed);
  return ref.payload_length() == want.size() &&
         std::memcmp(ref.payload(), want.data(), want.size()) == 0;
}

class OfferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int counter = 0;
    tag_ = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    auto p = ecx::testing::ConnectorPeer::start(
        {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra_for("e-w0-" + tag_)}});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    worker_.emplace(std::move(*p));
    pd_ = make(extra_for("pd-sched-" + tag_));
    ASSERT_NE(pd_, nullptr);
  }

  MmHash hash_of(const std::string& name) const { return MmHash::sha256_of({tag_, name}); }

  // E's scheduler, which may offer to `consumers` (offer_to).
  std::unique_ptr<EcConnector> offerer(std::vector<std::string> consumers,
                                       const std::string& secret = kSecret) {
    auto extra = extra_for("e-sched-" + tag_, secret);
    extra["offer_to"] = std::move(consumers);
    return make(extra);
  }

  uint64_t worker_pins() {
    auto s = worker_->stats();
    return s.ok() ? (*s)["producer_pool"]["pins"].get<uint64_t>() : UINT64_MAX;
  }

  // Polls (5 s at most) until `done` holds of the PD's stats.
  bool pd_until(const std::function<bool(const ConnectorStats&)>& done) {
    return ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return done(pd_->stats()); });
  }

  std::string tag_;
  std::optional<ecx::testing::ConnectorPeer> worker_;
  std::unique_ptr<EcConnector> pd_;
};

TEST_F(OfferTest, AnOfferedItemIsHereBeforeItsRequestWhichGivesItsPinBack) {
  auto a = worker_->save(hash_of("a"), 1, kItem);
  auto b = worker_->save(hash_of("b"), 2, kItem);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(worker_pins(), 2u);  // each save's params hold a pin for their reader
  auto e_sched = offerer({tcp_address(*pd_)});
  ASSERT_NE(e_sched, nullptr);
  ASSERT_TRUE(e_sched->offer("tcp://" + tcp_address(*pd_), {*a, *b}).ok());
  // Loaded, and no longer pinned by the offer: kept for the request to come.
  ASSERT_TRUE(pd_until([](const ConnectorStats& s) {
    return s.items_offered == 2 && s.consumer_cache->entries == 2 && s.consumer_cache->pins == 0;
  })) << to_json(pd_->stats()).dump();
  EXPECT_EQ(e_sched->stats().offers_sent, 1u);
  // The params' pins are the request's to give back: still held at the worker.
  EXPECT_EQ(worker_pins(), 2u);

  auto out = pd_->load(
      {.request_id = "r", .items = {{hash_of("a"), kItem, *a}, {hash_of("b"), kItem, *b}}},
      Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  ASSERT_EQ(out.items.size(), 2u);
  for (const auto& item : out.items) EXPECT_TRUE(item.local_hit) << item.mm_hash.str();
  auto got_a = pd_->loaded("r", hash_of("a"));
  auto got_b = pd_->loaded("r", hash_of("b"));
  ASSERT_TRUE(got_a.ok() && got_b.ok());
  EXPECT_TRUE(holds_pattern(*got_a, 1));
  EXPECT_TRUE(holds_pattern(*got_b, 2));
  pd_->request_finished("r");
  uint64_t pins = UINT64_MAX;
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return (pins = worker_pins()) == 0; });
  EXPECT_EQ(pins, 0u);
}

// vLLM's scheduler starting the load of a request whose items were offered: the load is
// done when start_load_caches returns (pinned on the caller's thread, no loader, no wait),
// and one that lacks an item goes to a loader, its probe having pinned nothing.
TEST_F(OfferTest, ARequestWhoseItemsAreAllHereIsLoadedWhenItStarts) {
  auto a = worker_->save(hash_of("a"), 4, kItem);
  auto b = worker_->save(hash_of("b"), 5, kItem);
  ASSERT_TRUE(a.ok() && b.ok());
  auto e_sched = offerer({tcp_address(*pd_)});
  ASSERT_NE(e_sched, nullptr);
  ASSERT_TRUE(e_sched->offer(tcp_address(*pd_), {*a}).ok());
  ASSERT_TRUE(pd_until([](const ConnectorStats& s) {
    return s.items_offered == 1 && s.consumer_cache->entries == 1 && s.consumer_cache->pins == 0;
  })) << to_json(pd_->stats()).dump();

  auto start = [&](const LoadRequest& request) {
    for (size_t i = 0; i < request.items.size(); ++i)
      EXPECT_TRUE(pd_->update_state_after_alloc(request, i).ok());
    return pd_->start_load_caches(pd_->build_connector_meta());
  };
  ASSERT_TRUE(start({.request_id = "here", .items = {{hash_of("a"), kItem, *a}}}).ok());
  EXPECT_EQ(pd_->get_finished(), std::vector<std::string>{"here"});  // done, not queued
  auto here = pd_->wait_for_load("here", Deadline::after_ms(0));
  ASSERT_TRUE(here.status.ok()) << here.status.to_string();
  ASSERT_EQ(here.items.size(), 1u);
  EXPECT_TRUE(here.items[0].local_hit);
  auto got = pd_->loaded("here", hash_of("a"));
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(holds_pattern(*got, 4));
  EXPECT_EQ(pd_->stats().items_loaded, 1u);  // the offer's read: the request read nothing
  // The load ended with its params' pin at the worker given back; b's is still held.
  uint64_t pins = UINT64_MAX;
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return (pins = worker_pins()) == 1; });
  EXPECT_EQ(pins, 1u);

  // "b" is not here: the whole load is a loader's (it reads b, finds a).
  ASSERT_TRUE(start({.request_id = "partly",
                     .items = {{hash_of("a"), kItem, *a}, {hash_of("b"), kItem, *b}}})
                  .ok());
  auto partly = pd_->wait_for_load("partly", Deadline::after_ms(30000));
  ASSERT_TRUE(partly.status.ok()) << partly.status.to_string();
  ASSERT_EQ(partly.items.size(), 2u);
  auto got_b = pd_->loaded("partly", hash_of("b"));
  ASSERT_TRUE(got_b.ok());
  EXPECT_TRUE(holds_pattern(*got_b, 5));
  EXPECT_EQ(pd_->stats().items_loaded, 2u);
  EXPECT_EQ(pd_->stats().consumer_cache->pins, 3u);  // here: a; partly: a, b (no probe's)
  pd_->request_finished("here");
  pd_->request_finished("partly");
  EXPECT_EQ(pd_->stats().consumer_cache->pins, 0u);
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return (pins = worker_pins()) == 0; });
  EXPECT_EQ(pins, 0u);  // b's went back with partly's load
}

// A request and its offer racing (the offer still loading when the request comes, or
// arriving after it): the item is read from the worker once, whichever reads it, and the
// other finds or joins that read.
TEST_F(OfferTest, ARequestRacingItsOfferReadsTheItemOnce) {
  auto a = worker_->save(hash_of("a"), 3, kItem);
  ASSERT_TRUE(a.ok());
  auto e_sched = offerer({tcp_address(*pd_)});
  ASSERT_NE(e_sched, nullptr);
  ASSERT_TRUE(e_sched->offer(tcp_address(*pd_), {*a}).ok());
  auto out = pd_->load({.request_id = "r", .items = {{hash_of("a"), kItem, *a}}},
                       Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  auto got = pd_->loaded("r", hash_of("a"));
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(holds_pattern(*got, 3));
  pd_->request_finished("r");
  ASSERT_TRUE(ecx::testing::poll_until(Deadline::after_ms(5000),
                                       [&] { return e_sched->stats().offers_sent == 1; }));
  ASSERT_TRUE(pd_until([](const ConnectorStats& s) { return s.consumer_cache->pins == 0; }));
  EXPECT_EQ(pd_->stats().items_loaded, 1u);
  EXPECT_EQ(pd_->stats().consumer_cache->entries, 1u);
  uint64_t pins = UINT64_MAX;
  ecx::testing::poll_until(Deadline::after_ms(5000), [&] { return (pins = worker_pins()) == 0; });
  EXPECT_EQ(pins, 0u);
}

TEST_F(OfferTest, ParamsThisDeploymentDidNotSignAreNotLoaded) {
  auto a = worker_->save(hash_of("a"), 4, kItem);
  ASSERT_TRUE(a.ok());
  EcTransferParams forged = *a;
  forged.offset += 64;  // another place in the worker's memory: the signature no longer holds
  auto e_sched = offerer({tcp_address(*pd_)});
  ASSERT_NE(e_sched, nullptr);
  ASSERT_TRUE(e_sched->offer(tcp_address(*pd_), {forged}).ok());
  ASSERT_TRUE(pd_until([](const ConnectorStats& s) { return s.offered_refused == 1; }));
  EXPECT_EQ(pd_->stats().items_offered, 0u);
  EXPECT_EQ(pd_->stats().consumer_cache->entries, 0u);
  EXPECT_EQ(pd_->stats().params_rejected, 1u);
}

TEST_F(OfferTest, AnOffererWithoutTheDeploymentSecretIsNotHeard) {
  auto a = worker_->save(hash_of("a"), 5, kItem);
  ASSERT_TRUE(a.ok());
  auto stranger = offerer({tcp_address(*pd_)}, "another-secret");
  ASSERT_NE(stranger, nullptr);
  ASSERT_TRUE(stranger->offer(tcp_address(*pd_), {*a}).ok());
  ASSERT_TRUE(ecx::testing::poll_until(Deadline::after_ms(5000),
                                       [&] { return stranger->stats().offers_failed == 1; }));
  EXPECT_EQ(stranger->stats().offers_sent, 0u);
  EXPECT_EQ(pd_->stats().items_offered, 0u);
  EXPECT_EQ(pd_->stats().consumer_cache->entries, 0u);
}

// offer() only queues: an offer to a consumer nobody listens for is counted as failed
// (sent from the connector's thread); a malformed address is refused, naming it.
TEST_F(OfferTest, AnUnreachableConsumerIsCountedAndAMalformedAddressRefused) {
  auto a = worker_->save(hash_of("a"), 6, kItem);
  ASSERT_TRUE(a.ok());
  auto e_sched = offerer({"127.0.0.1:1"});
  ASSERT_NE(e_sched, nullptr);
  EXPECT_TRUE(e_sched->offer("127.0.0.1:1", {*a}).ok());
  EXPECT_TRUE(e_sched->offer("127.0.0.1:1", {*a}).ok());  // not dialed again for a while
  ASSERT_TRUE(ecx::testing::poll_until(Deadline::after_ms(5000),
                                       [&] { return e_sched->stats().offers_failed == 2; }));
  EXPECT_EQ(e_sched->stats().offers_sent, 0u);
  for (const char* bad : {"", "no-port", "10.0.0.1:99999", "tcp://", "a b:80", "[::1]:80"}) {
    Status s = e_sched->offer(bad, {*a});
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad << ": " << s.to_string();
  }
}

// The address comes from the request E is sent: E offers only to the consumers its own
// configuration lists (offer_to), and dials no other address (an agent's handshake
// relayed by whoever listens there would reach another agent of the deployment as E).
TEST_F(OfferTest, OnlyTheConsumersOfOfferToAreOfferedTo) {
  auto a = worker_->save(hash_of("a"), 7, kItem);
  ASSERT_TRUE(a.ok());
  auto none = offerer({});
  ASSERT_NE(none, nullptr);
  Status s = none->offer(tcp_address(*pd_), {*a});
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  auto other = offerer({"127.0.0.1:1"});
  ASSERT_NE(other, nullptr);
  s = other->offer(tcp_address(*pd_), {*a});
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  EXPECT_EQ(none->stats().offers_sent + none->stats().offers_failed, 0u);
  EXPECT_EQ(other->stats().offers_sent + other->stats().offers_failed, 0u);
  EXPECT_EQ(pd_->stats().items_offered, 0u);
  // A malformed offer_to is refused at start, naming the entry.
  auto extra = extra_for("e-bad-" + tag_);
  extra["offer_to"] = {"10.0.0.1:99999"};
  auto bad = create_connector({.connector = "p2p", .role = Role::kConsumer, .extra = extra});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("offer_to"), std::string::npos) << bad.status().to_string();
}

// A push consumer refuses offers: its producer would end the request's pin as it writes.
TEST_F(OfferTest, APushConsumerRefusesOffers) {
  auto a = worker_->save(hash_of("a"), 8, kItem);
  ASSERT_TRUE(a.ok());
  auto extra = extra_for("pd-push-" + tag_);
  extra["mode"] = "push";
  auto push_pd = make(extra);
  ASSERT_NE(push_pd, nullptr);
  auto e_sched = offerer({tcp_address(*push_pd)});
  ASSERT_NE(e_sched, nullptr);
  ASSERT_TRUE(e_sched->offer(tcp_address(*push_pd), {*a}).ok());
  ASSERT_TRUE(ecx::testing::poll_until(Deadline::after_ms(5000),
                                       [&] { return push_pd->stats().offered_refused == 1; }));
  EXPECT_EQ(push_pd->stats().items_offered, 0u);
  EXPECT_EQ(worker_pins(), 1u);  // the request's, untouched
}

}  // namespace
}  // namespace ecx::connector
