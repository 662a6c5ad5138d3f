// Pins are given back by their holder on every path, not left to the lease: after a
// load, a local-cache hit, a recompute after a failed load, and a request discarded
// before its load, the producer (another process) holds no pin for the consumer, with
// a lease of ten minutes that cannot be what ended them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "support/connector_peer_process.h"
#include "support/poll.h"

namespace ecx::connector {
namespace {

const TensorMeta kItem{DType::kBF16, {64, 1024}};
const std::string kSecret = "release-test-deployment-secret";

class ReleaseTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    static int counter = 0;
    tag_ = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    nlohmann::json extra = {{"engine_id", "e-" + tag_},
                            {"pool_bytes", "64MiB"},
                            {"lease_ms", 600000},
                            {"auth_token", kSecret}};
    auto p = ecx::testing::ConnectorPeer::start(
        {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra}});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    producer_.emplace(std::move(*p));
    extra["engine_id"] = "pd-" + tag_;
    extra["mode"] = GetParam();
    ConnectorContext ctx;
    ctx.recompute = [](const MmHash&, const TensorMeta&, std::span<std::byte> out) {
      fill_pattern(out.data(), out.size(), 99);
      return Status::Ok();
    };
    auto c = create_connector({.connector = "p2p", .role = Role::kConsumer, .extra = extra}, ctx);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    consumer_ = std::move(*c);
  }

  MmHash hash_of(const std::string& name) const { return MmHash::sha256_of({tag_, name}); }

  EcTransferParams save(const std::string& name) {
    auto p = producer_->save(hash_of(name), 7, kItem);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? *p : EcTransferParams{};
  }

  LoadOutcome load(const std::string& id, const MmHash& h, const TensorMeta& meta,
                   const EcTransferParams& params) {
    auto out = consumer_->load({.request_id = id, .items = {{h, meta, params}}},
                               Deadline::after_ms(30000));
    consumer_->request_finished(id);
    return out;
  }

  // The producer's pins, once the consumer's asynchronous release has arrived (at most
  // 5 s: far below the lease).
  uint64_t producer_pins_settled(uint64_t want = 0) {
    uint64_t pins = UINT64_MAX;
    ecx::testing::poll_until(Deadline::after_ms(5000), [&] {
      auto s = producer_->stats();
      pins = s.ok() ? (*s)["producer_pool"]["pins"].get<uint64_t>() : UINT64_MAX;
      return pins == want;
    });
    return pins;
  }

  std::string tag_;
  std::optional<ecx::testing::ConnectorPeer> producer_;
  std::unique_ptr<EcConnector> consumer_;
};

TEST_P(ReleaseTest, ALoadGivesBackItsPins) {
  auto out = load("r1", hash_of("a"), kItem, save("a"));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_FALSE(out.items[0].recomputed);
  EXPECT_EQ(producer_pins_settled(), 0u);
}

TEST_P(ReleaseTest, ALocalHitGivesBackThePinItsParamsCarried) {
  ASSERT_TRUE(load("r1", hash_of("a"), kItem, save("a")).status.ok());
  // E pins the item again for a second request; PD already has it.
  auto out = load("r2", hash_of("a"), kItem, save("a"));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_TRUE(out.items[0].local_hit);
  EXPECT_EQ(producer_pins_settled(), 0u);
}

TEST_P(ReleaseTest, ARecomputeAfterAFailedLoadGivesBackThePin) {
  // Genuine params, but the request expects another geometry: the load fails and PD
  // encodes the item itself.
  const TensorMeta other{DType::kBF16, {32, 1024}};
  auto out = load("r1", hash_of("a"), other, save("a"));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_TRUE(out.items[0].recomputed);
  EXPECT_EQ(producer_pins_settled(), 0u);
}

TEST_P(ReleaseTest, ADiscardedRequestGivesBackItsPins) {
  LoadRequest request{
      .request_id = "r1",
      .items = {{hash_of("a"), kItem, save("a")}, {hash_of("b"), kItem, save("b")}}};
  consumer_->discard(request);
  EXPECT_EQ(producer_pins_settled(), 0u);
}

// The stop order: a consumer destroyed with a request still open (loaded, never
// finished) gives its pins back before its agent stops, so the producer holds none.
TEST_P(ReleaseTest, AConsumerDestroyedWithARequestOpenGivesBackItsPinsBeforeItsAgentStops) {
  auto out = consumer_->load({.request_id = "open", .items = {{hash_of("a"), kItem, save("a")}}},
                             Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  consumer_.reset();  // no request_finished: the connector's stop must settle it
  EXPECT_EQ(producer_pins_settled(), 0u);
}

TEST_P(ReleaseTest, ForgedParamsReleaseNothing) {
  EcTransferParams p = save("a");
  EcTransferParams forged = p;
  forged.signature.clear();
  // A genuine item in the same request: once its pin has ended, the whole request's
  // release has been sent and handled, the forged item's included.
  EcTransferParams genuine = save("b");
  consumer_->discard({.request_id = "r1",
                      .items = {{hash_of("a"), kItem, forged}, {hash_of("b"), kItem, genuine}}});
  EXPECT_EQ(producer_pins_settled(1), 1u) << "the genuine pin ends, the forged one's stays";
  auto s = producer_->stats();
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ((*s)["releases_received"].get<uint64_t>(), 1u) << "nothing was sent for the forgery";
}

// What E does when the proxy gives back the params of a request that never reached PD.
TEST(ReleaseParamsTest, AProducerEndsThePinOfItsOwnSignedParamsOnly) {
  nlohmann::json extra = {{"engine_id", "e-release-params-" + std::to_string(::getpid())},
                          {"pool_bytes", "16MiB"},
                          {"lease_ms", 600000},
                          {"auth_token", kSecret}};
  auto producer = create_connector({.connector = "p2p", .role = Role::kProducer, .extra = extra});
  ASSERT_TRUE(producer.ok()) << producer.status().to_string();
  std::vector<std::byte> payload(kItem.byte_size());
  auto params = (*producer)->save_caches(MmHash::sha256_of({"release-params"}), kItem, payload);
  ASSERT_TRUE(params.ok()) << params.status().to_string();
  auto pins = [&] { return (*producer)->stats().producer_pool->pins; };
  ASSERT_EQ(pins(), 1u);

  EcTransferParams unsigned_params = *params;
  unsigned_params.signature.clear();
  EXPECT_EQ((*producer)->release_params(unsigned_params).code(), StatusCode::kPermissionDenied);
  EcTransferParams foreign = *params;
  foreign.engine_id = "another-encoder";
  foreign.sign(kSecret);
  EXPECT_EQ((*producer)->release_params(foreign).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pins(), 1u);

  EXPECT_TRUE((*producer)->release_params(*params).ok());
  EXPECT_EQ(pins(), 0u);
  EXPECT_EQ((*producer)->stats().releases_received, 1u);
  // Twice is harmless: the pin has ended.
  EXPECT_TRUE((*producer)->release_params(*params).ok());
  EXPECT_EQ((*producer)->stats().releases_received, 1u);
}

INSTANTIATE_TEST_SUITE_P(Modes, ReleaseTest, ::testing::Values("pull", "pull-2step", "push"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace ecx::connector
