// A same-host load never serves torn or reused bytes, with the checksum off (the default
// there: docs/SECURITY.md, "Integrity of loaded bytes"). The producer (another process)
// hands out pins that end after kLease and has a pool of one block: a save of another item
// waits for the pin to end, then evicts and rewrites the block of the item before it. Loads
// come in three kinds, in turn: one with no rewrite (it must be served), one whose item was
// rewritten before the load began (it must fail as evicted), and eight where a second
// thread's save rewrites the block as the pin ends, while the consumer reads it: the load
// starts a little before that moment, by a different margin each time, measured in how
// long an unraced load takes on this build. Every load either returns exactly the item's
// bytes or fails as evicted; none returns anything else.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "support/connector_peer_process.h"

namespace ecx::connector {
namespace {

const TensorMeta kItem{DType::kBF16, {1024, 2048}};  // 4 MiB: a copy of about a millisecond
constexpr int kLoads = 100;
constexpr auto kLease = std::chrono::milliseconds(40);
// How long before the pin ends each raced load starts (kinds 2..9), in tenths of the time
// the last unraced load took: the margins follow the build's speed.
constexpr int kMarginTenths[] = {15, 10, 7, 5, 4, 3, 2, 0};

TEST(TornReads, AProducerRewritingBlocksUnderTheReaderNeverHasItsBytesServed) {
  const std::string tag = std::to_string(::getpid());
  const uint64_t block = kItem.byte_size() + 4096;
  nlohmann::json extra = {{"engine_id", "e-torn-" + tag},
                          {"pool_bytes", block},  // one block: every save evicts the previous item
                          {"lease_ms", kLease.count()},
                          {"save_wait_ms", 10000}};
  auto started = ecx::testing::ConnectorPeer::start(
      {{"connector", "p2p"}, {"role", "producer"}, {"extra", extra}});
  ASSERT_TRUE(started.ok()) << started.status().to_string();
  ecx::testing::ConnectorPeer producer = std::move(*started);
  extra["engine_id"] = "pd-torn-" + tag;
  extra["pool_bytes"] = "64MiB";
  extra["keep_loaded"] = false;
  extra["failure_policy"] = "fail";
  auto consumer = create_connector({.connector = "p2p", .role = Role::kConsumer, .extra = extra});
  ASSERT_TRUE(consumer.ok()) << consumer.status().to_string();

  auto rewrite = [&](uint64_t j) {
    return producer.save(MmHash::sha256_of({tag, "filler", std::to_string(j)}), j, kItem);
  };
  std::vector<std::byte> expected(kItem.byte_size());
  int served = 0, evicted = 0, caught_mid_copy = 0, torn = 0, other = 0;
  int raced = 0, filler_failures = 0;
  auto unraced_load = std::chrono::microseconds(1000);  // until one is measured
  for (int i = 0; i < kLoads; ++i) {
    const MmHash h = MmHash::sha256_of({tag, "item", std::to_string(i)});
    const uint64_t seed = 1'000'000 + i;
    Result<EcTransferParams> params = producer.save(h, seed, kItem);
    const auto saved_at = std::chrono::steady_clock::now();  // the pin ends by saved_at + kLease
    ASSERT_TRUE(params.ok()) << params.status().to_string();
    const int kind = i % 10;  // 0: no rewrite; 1: rewritten before; 2..9: rewritten meanwhile
    if (kind == 1) {
      ASSERT_TRUE(rewrite(i).ok());
    }
    std::thread rewriter;
    if (kind >= 2) {
      raced++;
      rewriter = std::thread([&, i] {
        if (!rewrite(i).ok()) filler_failures++;  // waits for the item's pin to end
      });
      std::this_thread::sleep_until(saved_at + kLease -
                                    unraced_load * kMarginTenths[kind - 2] / 10);
    }
    const std::string id = "torn-" + std::to_string(i);
    const auto began = std::chrono::steady_clock::now();
    LoadOutcome out = (*consumer)->load({.request_id = id, .items = {{h, kItem, *params}}},
                                        Deadline::after_ms(30000));
    if (kind == 0) {
      unraced_load = std::chrono::duration_cast<std::chrono::microseconds>(
          std::chrono::steady_clock::now() - began);
    }
    if (rewriter.joinable()) rewriter.join();
    if (out.status.ok()) {
      auto ref = (*consumer)->loaded(id, h);
      ASSERT_TRUE(ref.ok()) << ref.status().to_string();
      fill_pattern(expected.data(), expected.size(), seed);
      (std::memcmp(ref->payload(), expected.data(), expected.size()) == 0 ? served : torn)++;
      EXPECT_NE(kind, 1) << "load " << i << " was served an item rewritten before it began";
    } else if (out.status.code() == StatusCode::kEvicted) {
      evicted++;
      if (out.status.message().find("while it was read") != std::string::npos) caught_mid_copy++;
      EXPECT_NE(kind, 0) << "load " << i
                         << " of an item nobody rewrote failed: " << out.status.to_string();
    } else {
      ADD_FAILURE() << "load " << i << ": " << out.status.to_string();
      other++;
    }
    (*consumer)->request_finished(id);
  }
  std::printf(
      "served %d, evicted %d (%d of them caught after the copy), torn %d, other %d (of %d, %d "
      "raced); filler saves failed: %d\n",
      served, evicted, caught_mid_copy, torn, other, kLoads, raced, filler_failures);
  EXPECT_EQ(torn, 0) << "a load returned bytes that are not its item's";
  EXPECT_EQ(other, 0);
  EXPECT_EQ(filler_failures, 0);
}

}  // namespace
}  // namespace ecx::connector
