#include "ecx/cache/encoder_cache_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "ecx/common/checksum.h"
#include "support/peer_process.h"

namespace ecx::cache {
namespace {

const TensorMeta kSeedItem{DType::kBF16, {400, 2048}};  // 1,638,400 bytes

MmHash hash_of(int i) { return MmHash::sha256_of({"image", std::to_string(i)}); }

std::vector<std::byte> payload(const TensorMeta& meta, uint64_t seed) {
  std::vector<std::byte> p(meta.byte_size());
  fill_pattern(p.data(), p.size(), seed);
  return p;
}

class PoolTest : public ::testing::Test {
 protected:
  void make_pool(uint64_t capacity, std::chrono::milliseconds lease = std::chrono::seconds(30)) {
    pool_.reset();
    auto p = EncoderCachePool::create(agent_.get(),
                                      {.name = "e-0", .capacity_bytes = capacity, .lease = lease});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    pool_ = std::move(*p);
  }
  void SetUp() override {
    agent_ = std::move(transfer::Agent::create(ecx::testing::local_config("pool-agent")).value());
    make_pool(64 << 20);
  }
  void TearDown() override { pool_.reset(); }

  std::unique_ptr<transfer::Agent> agent_;
  std::unique_ptr<EncoderCachePool> pool_;
};

TEST_F(PoolTest, PutFindAndHeaderDescribeTheEntry) {
  auto data = payload(kSeedItem, 1);
  auto ref = pool_->put(hash_of(1), kSeedItem, data);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  auto found = pool_->find(hash_of(1));
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->offset % kBlockAlignment, 0u);
  EXPECT_EQ(std::memcmp(found->payload(), data.data(), data.size()), 0);
  BlockExpectation expect{hash_of(1), kSeedItem, found->generation, "test"};
  EXPECT_TRUE(verify_block(found->block, found->block_length, expect).ok());
  EXPECT_EQ(pool_->find(hash_of(2)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(pool_->put(hash_of(1), kSeedItem, data).status().code(), StatusCode::kAlreadyExists);
}

TEST_F(PoolTest, SeedItemsUseAtMostOnePointZeroOneBytesPerPayloadByte) {
  for (int i = 0; i < 30; ++i)
    ASSERT_TRUE(pool_->put(hash_of(i), kSeedItem, payload(kSeedItem, i)).ok());
  PoolStats s = pool_->stats();
  EXPECT_EQ(s.entries, 30u);
  EXPECT_LE(s.bytes_used_per_payload_byte, 1.01);
  EXPECT_GE(s.bytes_used_per_payload_byte, 1.0);
}

TEST_F(PoolTest, NotReadyUntilCommitted) {
  auto ref = pool_->reserve(hash_of(1), kSeedItem);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(pool_->find(hash_of(1)).status().code(), StatusCode::kNotReady);
  EXPECT_EQ(pool_->wait_ready(hash_of(1), Deadline::after_ms(20)).status().code(),
            StatusCode::kNotReady);
  std::thread writer([&] {
    fill_pattern(ref->payload(), ref->payload_length(), 3);
    ASSERT_TRUE(pool_->commit(hash_of(1), ref->generation).ok());
  });
  auto ready = pool_->wait_ready(hash_of(1), Deadline::after_ms(20000));
  writer.join();
  ASSERT_TRUE(ready.ok()) << ready.status().to_string();
  EXPECT_EQ(pool_->stats().writing_entries, 0u);
}

TEST_F(PoolTest, EvictsLeastRecentlyUsedButNeverPinned) {
  make_pool(4 * block_bytes_for(kSeedItem.byte_size()) + 64);
  for (int i = 0; i < 4; ++i)
    ASSERT_TRUE(pool_->put(hash_of(i), kSeedItem, payload(kSeedItem, i)).ok());
  auto pinned = pool_->pin(hash_of(0), "reader");  // oldest, but pinned
  ASSERT_TRUE(pinned.ok());
  ASSERT_TRUE(pool_->find(hash_of(1)).ok());  // 1 becomes most recent; 2 is now the LRU
  ASSERT_TRUE(pool_->put(hash_of(10), kSeedItem, payload(kSeedItem, 10)).ok());
  EXPECT_TRUE(pool_->find(hash_of(0)).ok());
  EXPECT_TRUE(pool_->find(hash_of(1)).ok());
  EXPECT_EQ(pool_->find(hash_of(2)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(pool_->stats().evictions, 1u);
  // The pinned bytes are intact.
  auto data0 = payload(kSeedItem, 0);
  EXPECT_EQ(std::memcmp(pinned->ref.payload(), data0.data(), data0.size()), 0);
}

TEST_F(PoolTest, FullOfPinsIsResourceExhaustedNotCorruption) {
  make_pool(2 * block_bytes_for(kSeedItem.byte_size()));
  ASSERT_TRUE(pool_->put(hash_of(0), kSeedItem, payload(kSeedItem, 0)).ok());
  ASSERT_TRUE(pool_->put(hash_of(1), kSeedItem, payload(kSeedItem, 1)).ok());
  auto p0 = pool_->pin(hash_of(0), "a");
  auto p1 = pool_->pin(hash_of(1), "b");
  ASSERT_TRUE(p0.ok() && p1.ok());
  auto full = pool_->put(hash_of(2), kSeedItem, payload(kSeedItem, 2));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("pinned"), std::string::npos);
  ASSERT_TRUE(pool_->unpin(p0->pin_id).ok());
  EXPECT_EQ(pool_->unpin(p0->pin_id).code(), StatusCode::kNotFound);  // twice is an error
  EXPECT_TRUE(pool_->put(hash_of(2), kSeedItem, payload(kSeedItem, 2)).ok());
}

TEST_F(PoolTest, OnePeerCannotPileUpPinsWithoutBound) {
  pool_.reset();
  pool_ = std::move(EncoderCachePool::create(agent_.get(), {.name = "e-0",
                                                            .capacity_bytes = 64 << 20,
                                                            .require_grant = true,
                                                            .max_pins_per_holder = 8})
                        .value());
  ASSERT_TRUE(pool_->put(hash_of(1), kSeedItem, payload(kSeedItem, 1)).ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(pool_->pin_for_peer(hash_of(1), "greedy#01").ok());
  auto over = pool_->pin_for_peer(hash_of(1), "greedy#01");
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().to_string();
  // Others are not charged for it, and params' pins have their own, larger share.
  EXPECT_TRUE(pool_->pin_for_peer(hash_of(1), "modest#02").ok());
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(pool_->pin_for_peer(hash_of(1), "").ok());
  // A pin that ends makes room again.
  EXPECT_EQ(pool_->release_holder("greedy#01"), 8u);
  EXPECT_TRUE(pool_->pin_for_peer(hash_of(1), "greedy#01").ok());
  // A peer that calls itself "params" ends none of params' pins.
  EXPECT_EQ(pool_->release_holder("params#03"), 0u);
}

TEST_F(PoolTest, LeasesExpireAndHoldersRelease) {
  make_pool(16 << 20, std::chrono::milliseconds(50));
  ASSERT_TRUE(pool_->put(hash_of(0), kSeedItem, payload(kSeedItem, 0)).ok());
  ASSERT_TRUE(pool_->pin(hash_of(0), "dead-consumer").ok());
  ASSERT_TRUE(pool_->wait_unpinned(Deadline::after_ms(20000)).ok());
  EXPECT_EQ(pool_->stats().lease_expiries, 1u);
  ASSERT_TRUE(pool_->pin(hash_of(0), "pd-1", std::chrono::hours(1)).ok());
  ASSERT_TRUE(pool_->pin(hash_of(0), "pd-1", std::chrono::hours(1)).ok());
  ASSERT_TRUE(pool_->pin(hash_of(0), "pd-2", std::chrono::hours(1)).ok());
  EXPECT_EQ(pool_->release_holder("pd-1"), 2u);
  EXPECT_EQ(pool_->stats().pins, 1u);
  EXPECT_EQ(pool_->erase(hash_of(0)).code(), StatusCode::kFailedPrecondition);
}

// The reaper is woken only for a lease that ends before it wakes by itself. Idle (no pin)
// it wakes one default lease on: a shorter lease taken then still ends on time, and so do
// default ones taken while it sleeps. (A loaded machine under sanitizers has 980 ms of
// slack; without the wake-up the short lease would end about 1.4 s after it was taken.)
TEST_F(PoolTest, LeasesEndOnTimeWhenTheReaperWasIdle) {
  make_pool(16 << 20, std::chrono::milliseconds(1500));
  ASSERT_TRUE(pool_->put(hash_of(0), kSeedItem, payload(kSeedItem, 0)).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the reaper sleeps, no pin
  ASSERT_TRUE(pool_->pin(hash_of(0), "short", std::chrono::milliseconds(20)).ok());
  // Long before the 1.5 s the reaper would sleep on: only the wake-up ends the pin.
  ASSERT_TRUE(pool_->wait_unpinned(Deadline::after_ms(1000)).ok());
  EXPECT_EQ(pool_->stats().lease_expiries, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(pool_->pin(hash_of(0), "default").ok());
  ASSERT_TRUE(pool_->pin(hash_of(0), "default").ok());
  ASSERT_TRUE(pool_->wait_unpinned(Deadline::after_ms(20000)).ok());
  EXPECT_EQ(pool_->stats().lease_expiries, 3u);
}

TEST_F(PoolTest, ReceivedBlocksAreVerifiedBeforeBecomingReady) {
  auto data = payload(kSeedItem, 9);
  // A producer-side block, as a peer would send it.
  std::vector<std::byte> remote(kBlockHeaderBytes + data.size());
  std::memcpy(remote.data() + kBlockHeaderBytes, data.data(), data.size());
  write_block_header(remote.data(), hash_of(9), kSeedItem, 77,
                     checksum64(data.data(), data.size()));

  auto land = [&](int key, std::vector<std::byte> bytes, uint64_t expected_gen) {
    auto ref = pool_->reserve(hash_of(key), kSeedItem);
    EXPECT_TRUE(ref.ok());
    std::memcpy(ref->block, bytes.data(), bytes.size());
    return pool_->commit_received(hash_of(key), ref->generation,
                                  {hash_of(key), kSeedItem, expected_gen, "test"});
  };
  EXPECT_TRUE(land(9, remote, 77).ok());
  EXPECT_TRUE(pool_->find(hash_of(9)).ok());
  // Reused block: generation differs -> evicted, and the entry is dropped.
  Status stale = land(10, remote, 77);
  EXPECT_EQ(stale.code(), StatusCode::kEvicted) << stale.to_string();  // holds mm_hash 9, not 10
  EXPECT_EQ(pool_->find(hash_of(10)).status().code(), StatusCode::kNotFound);
  auto renamed = remote;
  write_block_header(renamed.data(), hash_of(11), kSeedItem, 78,
                     checksum64(data.data(), data.size()));
  Status gen = land(11, renamed, 77);
  EXPECT_EQ(gen.code(), StatusCode::kEvicted);
  EXPECT_NE(gen.message().find("generation 78 != expected 77"), std::string::npos)
      << gen.to_string();
  auto corrupt = renamed;
  corrupt[kBlockHeaderBytes + 1000] ^= std::byte{1};
  EXPECT_EQ(land(11, corrupt, 78).code(), StatusCode::kDataLoss);
}

TEST_F(PoolTest, TenfoldOversubscriptionNeverEvictsPinnedOrServesWrongBytes) {
  const TensorMeta item{DType::kBF16, {100, 2048}};  // 400 KiB
  make_pool(20 * block_bytes_for(item.byte_size()));
  std::mt19937 rng(3);
  std::vector<Pin> held;
  for (int i = 0; i < 200; ++i) {  // 10x the capacity
    auto put = pool_->put(hash_of(i), item, payload(item, i));
    if (!put.ok()) {
      ASSERT_EQ(put.status().code(), StatusCode::kResourceExhausted);
    }
    if (put.ok() && rng() % 4 == 0 && held.size() < 15) {
      auto p = pool_->pin(hash_of(i), "reader");
      ASSERT_TRUE(p.ok());
      held.push_back(*p);
    }
    if (!held.empty() && rng() % 5 == 0) {
      ASSERT_TRUE(pool_->unpin(held.front().pin_id).ok());
      held.erase(held.begin());
    }
    for (const auto& p : held) {  // every pinned entry is still exactly its bytes
      BlockExpectation e{p.ref.mm_hash, item, p.ref.generation, "pinned"};
      ASSERT_TRUE(verify_block(p.ref.block, p.ref.block_length, e).ok());
    }
  }
  EXPECT_GT(pool_->stats().evictions, 150u);
}

}  // namespace
}  // namespace ecx::cache
