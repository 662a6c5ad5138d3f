// zero_copy: on one host a load reads the producer's sealed block where it lies, held by
// a pin the consumer renews until request_finished. The producer runs in its own process
// (`ecx bench connector-peer`), as E does.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "support/connector_peer_process.h"

namespace ecx::connector {
namespace {

using ecx::testing::ConnectorPeer;
using nlohmann::json;

const TensorMeta kItem{DType::kBF16, {256, 2048}};  // 1 MiB

// The permissions of the mapping of this process that holds `p` ("r--s", ...), or "".
std::string mapping_permissions(const void* p) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms;
    in >> range >> perms;
    auto dash = range.find('-');
    uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (at >= lo && at < hi) return perms;
  }
  return "";
}

class ZeroCopy : public ::testing::Test {
 protected:
  void SetUp() override { tag_ = std::to_string(::getpid()) + "-" + std::to_string(counter_++); }

  void start_producer(json extra = json::object()) {
    extra["engine_id"] = "e-zc-" + tag_;
    if (!extra.contains("pool_bytes")) extra["pool_bytes"] = "64MiB";
    auto p = ConnectorPeer::start({{"connector", "p2p"}, {"role", "producer"}, {"extra", extra}});
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    producer_.emplace(std::move(*p));
  }
  void make_consumer(json extra = json::object()) {
    extra["engine_id"] = "pd-zc-" + tag_;
    extra["zero_copy"] = true;
    extra["failure_policy"] = "fail";
    if (!extra.contains("pool_bytes")) extra["pool_bytes"] = "64MiB";
    auto c = create_connector({.connector = "p2p", .role = Role::kConsumer, .extra = extra});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    consumer_ = std::move(*c);
  }
  MmHash hash_of(const std::string& name) const { return MmHash::sha256_of({tag_, name}); }
  LoadOutcome load(const std::string& id, const EcTransferParams& p) {
    return consumer_->load({.request_id = id, .items = {{p.mm_hash, p.meta, p}}},
                           Deadline::after_ms(30000));
  }
  // The item's bytes as request `id` sees them are exactly those saved with `seed`.
  void expect_bytes(const std::string& id, const MmHash& h, uint64_t seed) {
    auto ref = consumer_->loaded(id, h);
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    std::vector<std::byte> want(kItem.byte_size());
    fill_pattern(want.data(), want.size(), seed);
    ASSERT_EQ(ref->payload_length(), want.size());
    EXPECT_EQ(std::memcmp(ref->payload(), want.data(), want.size()), 0);
  }
  json producer_stats() {
    auto s = producer_->stats();
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? *s : json::object();
  }

  static inline int counter_ = 0;
  std::string tag_;
  std::optional<ConnectorPeer> producer_;
  std::unique_ptr<EcConnector> consumer_;
};

TEST_F(ZeroCopy, AOneHostLoadIsAReadOnlyViewOfTheProducersBlockKeptAsACopyAtItsEnd) {
  start_producer();
  make_consumer();  // keep_loaded: true (the default)
  auto p = producer_->save(hash_of("a"), 7, kItem);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  LoadOutcome out = load("r1", *p);
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  expect_bytes("r1", p->mm_hash, 7);
  ConnectorStats s = consumer_->stats();
  EXPECT_EQ(s.views_held, 1u);
  ASSERT_TRUE(s.consumer_cache.has_value());
  EXPECT_EQ(s.consumer_cache->entries, 0u) << "a view takes no block of the consumer's cache";
  auto ref = consumer_->loaded("r1", p->mm_hash);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(mapping_permissions(ref->payload()), "r--s")
      << "the view is the producer's shared memory, mapped read-only";

  consumer_->request_finished("r1");
  s = consumer_->stats();
  EXPECT_EQ(s.views_held, 0u);
  EXPECT_EQ(s.consumer_cache->entries, 1u) << "keep_loaded: copied before the pin went";
  // The pin went back by RELEASE, not by its lease (30 s).
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  EXPECT_EQ(producer_stats()["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);
  // The same image again: the kept copy, no transfer.
  auto again = producer_->save(hash_of("a"), 7, kItem);
  ASSERT_TRUE(again.ok());
  out = load("r2", *again);
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_TRUE(out.items[0].local_hit);
  expect_bytes("r2", p->mm_hash, 7);
  consumer_->request_finished("r2");
}

TEST_F(ZeroCopy, AViewHeldForManyLeasesKeepsItsBlockFromEvictionUntilTheRequestFinishes) {
  // One block at the producer: a second item can only be saved by evicting the first.
  start_producer(
      {{"pool_bytes", kItem.byte_size() + 4096}, {"lease_ms", 300}, {"save_wait_ms", 100}});
  make_consumer({{"lease_ms", 300}, {"keep_loaded", false}});  // renews every 100 ms
  auto p = producer_->save(hash_of("held"), 11, kItem);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  LoadOutcome out = load("r1", *p);
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // four leases
  auto evicting = producer_->save(hash_of("filler"), 12, kItem);
  EXPECT_EQ(evicting.status().code(), StatusCode::kResourceExhausted)
      << "the producer evicted a block still viewed: " << evicting.status().to_string();
  expect_bytes("r1", p->mm_hash, 11);
  json stats = producer_stats();
  EXPECT_EQ(stats["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);
  EXPECT_GE(stats["renewals_received"].get<uint64_t>(), 4u) << stats.dump();
  EXPECT_EQ(consumer_->stats().view_renewals_failed, 0u);

  consumer_->request_finished("r1");
  EXPECT_FALSE(consumer_->loaded("r1", p->mm_hash).ok()) << "a view ends with its request";
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  auto saved = producer_->save(hash_of("filler"), 12, kItem);
  EXPECT_TRUE(saved.ok()) << saved.status().to_string();
}

TEST_F(ZeroCopy, AReaderKilledWhileHoldingAViewHasItsOwnPinEndedAtOnceNotByLease) {
  start_producer({{"lease_ms", 600000}});
  auto reader =
      ConnectorPeer::start({{"connector", "p2p"},
                            {"role", "consumer"},
                            {"extra", {{"engine_id", "reader-zc-" + tag_}, {"zero_copy", true}}}});
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  auto p = producer_->save(hash_of("r"), 3, kItem);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  auto loaded = reader->command("load r1 " + p->to_json().dump());
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(json::parse(*loaded)["views_held"].get<uint64_t>(), 1u) << *loaded;
  // The view holds the params' pin and a pin of the reader's own, until its request ends.
  EXPECT_EQ(producer_stats()["producer_pool"]["pins"].get<uint64_t>(), 2u);
  ASSERT_TRUE(reader->process().kill(SIGKILL).ok());
  // The reader's own pin ends with the reader, long before the 10-minute lease (the
  // params' pin, which anyone handed the params could hold, is left to its lease).
  uint64_t pins = 2;
  for (Deadline until = Deadline::after_ms(20000); !until.expired() && pins != 1;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    pins = producer_stats()["producer_pool"]["pins"].get<uint64_t>();
  }
  EXPECT_EQ(pins, 1u);
  EXPECT_EQ(producer_stats()["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);
}

// vLLM's scheduler loads, then shares the item with its workers (other processes, here
// other connectors): a viewed item is shared as the producer's own block, so each reader
// reads it from the producer (a view, or a copy), and no byte goes through the
// scheduler's cache.
TEST_F(ZeroCopy, AViewedItemIsSharedAsTheProducersBlockAndEveryPinComesBack) {
  start_producer({{"lease_ms", 600000}});
  make_consumer({{"keep_loaded", false}});
  auto p = producer_->save(hash_of("s"), 9, kItem);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  ASSERT_TRUE(load("r1", *p).status.ok());
  auto shared = consumer_->share_loaded("r1", p->mm_hash, 2);
  ASSERT_TRUE(shared.ok()) << shared.status().to_string();
  ASSERT_EQ(shared->size(), 2u);
  EXPECT_EQ((*shared)[0].engine_id, p->engine_id) << "the producer's block, not this cache";
  EXPECT_EQ((*shared)[0].pin, 0u) << "no reader may end the pin the sharer holds";
  EXPECT_TRUE((*shared)[0].verify("").ok());
  for (bool zero_copy : {true, false}) {
    auto reader =
        create_connector({.connector = "p2p",
                          .role = Role::kConsumer,
                          .extra = {{"engine_id", "w-zc-" + tag_ + (zero_copy ? "-v" : "-c")},
                                    {"zero_copy", zero_copy},
                                    {"keep_loaded", false},
                                    {"failure_policy", "fail"}}});
    ASSERT_TRUE(reader.ok()) << reader.status().to_string();
    const EcTransferParams& mine = (*shared)[zero_copy ? 0 : 1];
    LoadOutcome out = (*reader)->load({.request_id = "w", .items = {{mine.mm_hash, kItem, mine}}},
                                      Deadline::after_ms(30000));
    ASSERT_TRUE(out.status.ok()) << out.status.to_string();
    auto ref = (*reader)->loaded("w", p->mm_hash);
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    std::vector<std::byte> want(kItem.byte_size());
    fill_pattern(want.data(), want.size(), 9);
    EXPECT_EQ(std::memcmp(ref->payload(), want.data(), want.size()), 0);
    EXPECT_EQ((*reader)->stats().views_held, zero_copy ? 1u : 0u);
    EXPECT_EQ((*reader)->stats().items_viewed, zero_copy ? 1u : 0u);
    (*reader)->request_finished("w");
  }
  EXPECT_EQ(consumer_->stats().consumer_cache->entries, 0u);
  consumer_->request_finished("r1");
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  EXPECT_EQ(producer_stats()["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);
}

TEST_F(ZeroCopy, OverTcpTheLoadIsACopyIntoTheConsumersCache) {
  start_producer({{"backend", "tcp"}});
  make_consumer({{"backend", "tcp"}});
  auto p = producer_->save(hash_of("t"), 5, kItem);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  LoadOutcome out = load("r1", *p);
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  expect_bytes("r1", p->mm_hash, 5);
  ConnectorStats s = consumer_->stats();
  EXPECT_EQ(s.views_held, 0u);
  EXPECT_EQ(s.consumer_cache->entries, 1u);
  EXPECT_EQ(s.consumer_cache->pins, 1u);
  // A copy ends on its own too: its cache pin goes, the request stays.
  ASSERT_TRUE(consumer_->item_finished("r1", p->mm_hash).ok());
  EXPECT_EQ(consumer_->stats().consumer_cache->pins, 0u);
  consumer_->request_finished("r1");
}

// What vLLM's worker does with zero_copy: one request loads a step's items (one lookup
// per producer), and each item ends when vLLM frees its entry, the others still held and
// renewed until theirs.
TEST_F(ZeroCopy, OneItemOfARequestEndsAloneAndItsOthersStayHeldAndRenewed) {
  start_producer({{"lease_ms", 300}});
  make_consumer({{"lease_ms", 300}, {"keep_loaded", false}});  // renews every 100 ms
  auto a = producer_->save(hash_of("a"), 21, kItem);
  auto b = producer_->save(hash_of("b"), 22, kItem);
  ASSERT_TRUE(a.ok() && b.ok());
  LoadOutcome out = consumer_->load(
      {.request_id = "r1", .items = {{a->mm_hash, a->meta, *a}, {b->mm_hash, b->meta, *b}}},
      Deadline::after_ms(30000));
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_EQ(consumer_->stats().views_held, 2u);

  ASSERT_TRUE(consumer_->item_finished("r1", a->mm_hash).ok());
  EXPECT_EQ(consumer_->stats().views_held, 1u);
  EXPECT_FALSE(consumer_->view_intact("r1", a->mm_hash).ok()) << "a's view ended";
  EXPECT_EQ(consumer_->item_finished("r1", a->mm_hash).code(), StatusCode::kFailedPrecondition)
      << "ended once";
  // a's two pins at the producer (the params' and the view's own) come back by RELEASE;
  // b's stay, renewed past several leases.
  uint64_t pins = 4;
  for (Deadline until = Deadline::after_ms(20000); !until.expired() && pins != 2;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    pins = producer_stats()["producer_pool"]["pins"].get<uint64_t>();
  }
  EXPECT_EQ(pins, 2u);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  EXPECT_TRUE(consumer_->view_intact("r1", b->mm_hash).ok());
  expect_bytes("r1", b->mm_hash, 22);
  EXPECT_EQ(consumer_->stats().view_renewals_failed, 0u);
  EXPECT_EQ(producer_stats()["producer_pool"]["pins"].get<uint64_t>(), 2u);
  EXPECT_EQ(producer_stats()["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);

  consumer_->request_finished("r1");
  EXPECT_EQ(consumer_->stats().views_held, 0u);
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  EXPECT_EQ(consumer_->item_finished("r1", b->mm_hash).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace ecx::connector
