// A same-host load never serves torn or reused bytes, with the checksum off (the default
// there: docs/SECURITY.md, "Integrity of loaded bytes"). The producer (another process)
// hands out pins that end after 1 ms and, from a second thread, saves other items into a
// pool of one block without pause: it evicts and rewrites each item's block while the
// consumer reads it. Every load either returns exactly the item's bytes or fails as
// evicted; none returns anything else.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "support/connector_peer_process.h"

namespace ecx::connector {
namespace {

const TensorMeta kItem{DType::kBF16, {1024, 2048}};  // 4 MiB: a copy of about a millisecond
constexpr int kLoads = 120;

TEST(TornReads, AProducerRewritingBlocksUnderTheReaderNeverHasItsBytesServed) {
  const std::string tag = std::to_string(::getpid());
  const uint64_t block = kItem.byte_size() + 4096;
  nlohmann::json extra = {{"engine_id", "e-torn-" + tag},
                          {"pool_bytes", block},  // one block: every save evicts the previous item
                          {"lease_ms", 1},
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

  std::mutex producer_mu;  // one command at a time on the producer's pipe
  std::atomic<bool> stop{false};
  std::atomic<int> filler_failures{0};
  std::thread rewriter([&] {
    for (uint64_t j = 0; !stop.load(); ++j) {
      std::lock_guard<std::mutex> lock(producer_mu);
      if (!producer.save(MmHash::sha256_of({tag, "filler", std::to_string(j)}), j, kItem).ok()) {
        filler_failures++;
      }
    }
  });
  std::vector<std::byte> expected(kItem.byte_size());
  int served = 0, evicted = 0, caught_mid_copy = 0, torn = 0, other = 0;
  for (int i = 0; i < kLoads; ++i) {
    const MmHash h = MmHash::sha256_of({tag, "item", std::to_string(i)});
    const uint64_t seed = 1'000'000 + i;
    Result<EcTransferParams> params = InvalidArgument("not saved");
    {
      std::lock_guard<std::mutex> lock(producer_mu);
      params = producer.save(h, seed, kItem);
    }
    ASSERT_TRUE(params.ok()) << params.status().to_string();
    // The read starts at a different moment of the rewriter's cycle each time (its pin
    // ends 1 ms after the save; the rewrite takes about as long).
    std::this_thread::sleep_for(std::chrono::microseconds(250 * (i % 8)));
    const std::string id = "torn-" + std::to_string(i);
    LoadOutcome out = (*consumer)->load({.request_id = id, .items = {{h, kItem, *params}}},
                                        Deadline::after_ms(30000));
    if (out.status.ok()) {
      auto ref = (*consumer)->loaded(id, h);
      ASSERT_TRUE(ref.ok()) << ref.status().to_string();
      fill_pattern(expected.data(), expected.size(), seed);
      (std::memcmp(ref->payload(), expected.data(), expected.size()) == 0 ? served : torn)++;
    } else if (out.status.code() == StatusCode::kEvicted) {
      evicted++;
      if (out.status.message().find("while it was read") != std::string::npos) caught_mid_copy++;
    } else {
      ADD_FAILURE() << "load " << i << ": " << out.status.to_string();
      other++;
    }
    (*consumer)->request_finished(id);
  }
  stop = true;
  rewriter.join();
  std::printf(
      "served %d, evicted %d (%d of them caught after the copy), torn %d, other %d (of %d); "
      "filler saves failed: %d\n",
      served, evicted, caught_mid_copy, torn, other, kLoads, filler_failures.load());
  EXPECT_EQ(torn, 0) << "a load returned bytes that are not its item's";
  EXPECT_EQ(other, 0);
  // The race was run: items were evicted under their readers, and others were served.
  EXPECT_GT(evicted, 0);
  EXPECT_GT(served, 0);
}

}  // namespace
}  // namespace ecx::connector
