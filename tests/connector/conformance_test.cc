// One conformance suite for every connector and mode. The producer runs in its own
// process (`ecx bench connector-peer`); the consumer is this process.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <thread>

#include "connector/options.h"
#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "support/connector_peer_process.h"

namespace ecx::connector {
namespace {

using ecx::testing::ConnectorPeer;
using nlohmann::json;

const TensorMeta kSeedItem{DType::kBF16, {400, 2048}};

struct Case {
  std::string label;       // test name suffix
  std::string connector;   // p2p, disk, store, local
  std::string mode;        // p2p mode
  std::string backend;     // p2p backend: "" (auto: shm here), "tcp" or "ucx"
  std::string ucx_tls;     // ucx: UCX_TLS of both sides
  bool zero_copy = false;  // the consumer reads same-host blocks where they lie
  bool transfers() const { return connector != "local"; }
  bool p2p() const { return connector == "p2p"; }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.label; }

std::string redis_address() {
  const char* env = std::getenv("ECX_TEST_REDIS");
  return env ? env : "127.0.0.1:6391";
}

MmHash hash_of(const std::string& tag) { return MmHash::sha256_of({"conformance", tag}); }

std::vector<std::byte> pattern(const TensorMeta& meta, uint64_t seed) {
  std::vector<std::byte> p(meta.byte_size());
  fill_pattern(p.data(), p.size(), seed);
  return p;
}

class ConformanceTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    static int counter = 0;
    tag_ = std::to_string(::getpid()) + "-" + std::to_string(counter++);
    root_ = std::filesystem::temp_directory_path() / ("ecx-conformance-" + tag_);
  }
  void TearDown() override {
    consumer_.reset();
    producer_.reset();
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }

  json extra(json overrides) const {
    json e = {{"engine_id", "e-" + tag_}, {"pool_bytes", "160MiB"}, {"load_timeout_ms", 20000}};
    if (GetParam().p2p()) e["mode"] = GetParam().mode;
    if (!GetParam().backend.empty()) e["backend"] = GetParam().backend;
    if (!GetParam().ucx_tls.empty()) e["ucx_tls"] = GetParam().ucx_tls;
    if (GetParam().zero_copy) e["zero_copy"] = true;
    if (GetParam().connector == "disk") e["root"] = root_.string();
    if (GetParam().connector == "store") e["redis"] = redis_address();
    if (overrides.is_object()) e.update(overrides);
    return e;
  }

  void start_producer(json overrides = json::object()) {
    json config = {
        {"connector", GetParam().connector}, {"role", "producer"}, {"extra", extra(overrides)}};
    if (GetParam().connector == "local") return;  // nothing produces for local
    auto p = ConnectorPeer::start(config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    producer_.emplace(std::move(*p));
  }

  void make_consumer(json overrides = json::object(), bool can_recompute = false) {
    json e = extra(overrides);
    e["engine_id"] = "pd-" + tag_;
    ConnectorConfig config;
    config.connector = GetParam().connector;
    config.role = Role::kConsumer;
    config.extra = e;
    ConnectorContext ctx;
    if (can_recompute) {
      // "Encoding" reproduces the producer's bytes: the seed is in the tag's registry.
      ctx.recompute = [this](const MmHash& h, const TensorMeta&, std::span<std::byte> out) {
        auto it = seeds_.find(h);
        if (it == seeds_.end()) return NotFound("test encoder does not know " + h.str());
        fill_pattern(out.data(), out.size(), it->second);
        recomputed_++;
        return Status::Ok();
      };
    }
    ctx.on_not_ready = [this](const MmHash&) {
      std::lock_guard lock(mu_);
      if (!not_ready_seen_) {
        not_ready_seen_ = true;
        not_ready_.set_value();
      }
    };
    auto c = create_connector(config, ctx);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    consumer_ = std::move(*c);
  }

  // Saves at the producer (or, for local, only remembers what the encoder would make).
  EcTransferParams save(const std::string& tag, uint64_t seed, const TensorMeta& meta = kSeedItem) {
    seeds_[hash_of(tag)] = seed;
    if (!producer_) {
      EcTransferParams p;
      p.connector = "local";
      p.mm_hash = hash_of(tag);
      p.meta = meta;
      return p;
    }
    auto p = producer_->save(hash_of(tag), seed, meta);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    return p.ok() ? *p : EcTransferParams{};
  }

  LoadOutcome load(const std::string& request_id, std::vector<EcTransferParams> params,
                   Deadline deadline = Deadline::after_ms(60000)) {
    LoadRequest r;
    r.request_id = request_id;
    for (auto& p : params) r.items.push_back({p.mm_hash, p.meta, p});
    return consumer_->load(r, deadline);
  }

  void expect_bytes(const std::string& request_id, const std::string& tag, uint64_t seed,
                    const TensorMeta& meta = kSeedItem) {
    auto ref = consumer_->loaded(request_id, hash_of(tag));
    ASSERT_TRUE(ref.ok()) << ref.status().to_string();
    ASSERT_EQ(ref->meta, meta);
    auto want = pattern(meta, seed);
    ASSERT_EQ(checksum64(ref->payload(), want.size()), checksum64(want.data(), want.size())) << tag;
  }

  std::string tag_;
  std::filesystem::path root_;
  std::optional<ConnectorPeer> producer_;
  std::unique_ptr<EcConnector> consumer_;
  std::map<MmHash, uint64_t> seeds_;
  std::atomic<int> recomputed_{0};
  std::mutex mu_;
  bool not_ready_seen_ = false;
  std::promise<void> not_ready_;
};

TEST_P(ConformanceTest, SeedItemRoundTripIsBitExact) {
  start_producer();
  make_consumer({}, /*can_recompute=*/!GetParam().transfers());
  auto p = save("a", 11);
  auto out = load("r1", {p});
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  ASSERT_EQ(out.items.size(), 1u);
  EXPECT_EQ(out.items[0].recomputed, !GetParam().transfers());
  expect_bytes("r1", "a", 11);
}

TEST_P(ConformanceTest, OneByteAndSixtyFourMiBRoundTrip) {
  start_producer();
  make_consumer({}, !GetParam().transfers());
  const TensorMeta one{DType::kU8, {1}};
  const TensorMeta big{DType::kU8, {64 << 20}};
  auto p1 = save("one", 5, one);
  auto p2 = save("big", 6, big);
  auto out = load("r1", {p1, p2});
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  expect_bytes("r1", "one", 5, one);
  expect_bytes("r1", "big", 6, big);
}

TEST_P(ConformanceTest, ThreeItemRequestAndRepeatHitsTheLocalCache) {
  start_producer();
  make_consumer({}, !GetParam().transfers());
  auto a = save("a", 1), b = save("b", 2), c = save("c", 3);
  auto out = load("r1", {a, b, c});
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  for (auto [t, s] : {std::pair{"a", 1}, {"b", 2}, {"c", 3}}) expect_bytes("r1", t, s);
  consumer_->request_finished("r1");
  // The same image again: served from the consumer's own cache, no transfer.
  auto again = load("r2", {b});
  ASSERT_TRUE(again.status.ok()) << again.status.to_string();
  EXPECT_TRUE(again.items[0].local_hit);
  expect_bytes("r2", "b", 2);
}

TEST_P(ConformanceTest, MissingItemIsNackedOrRecomputed) {
  start_producer();
  auto known = save("known", 1);
  EcTransferParams missing = known;
  missing.mm_hash = hash_of("never-saved");
  missing.region = 0;  // look it up by key
  missing.capability.clear();
  missing.sign("");  // as a producer of this (secret-less) deployment would
  seeds_[missing.mm_hash] = 99;
  {
    make_consumer({{"failure_policy", "fail"}});
    auto out = load("r1", {missing});
    ASSERT_FALSE(out.status.ok());
    EXPECT_EQ(out.status.code(), StatusCode::kNotFound) << out.status.to_string();
    EXPECT_NE(out.status.message().find(missing.mm_hash.str()), std::string::npos)
        << out.status.to_string();
  }
  make_consumer({{"failure_policy", "recompute"}}, /*can_recompute=*/true);
  auto out = load("r2", {missing});
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  EXPECT_TRUE(out.items[0].recomputed);
  expect_bytes("r2", "never-saved", 99);
}

TEST_P(ConformanceTest, NotReadyIsRetriedThenServed) {
  if (!GetParam().p2p() && GetParam().connector != "disk") {
    GTEST_SKIP() << GetParam().connector
                 << " has no not-ready state (a Redis SET is atomic; local loads nothing)";
  }
  start_producer();
  make_consumer();
  auto known = save("known", 1);  // for the producer's address
  ASSERT_TRUE(producer_->begin(hash_of("late"), kSeedItem).ok());
  EcTransferParams late = known;
  late.mm_hash = hash_of("late");
  late.region = 0;
  late.pin = 0;
  late.generation = 0;
  late.capability.clear();  // a lookup by key
  late.sign("");            // as a producer of this (secret-less) deployment would
  auto seen = not_ready_.get_future();
  auto loading = std::async(std::launch::async, [&] { return load("r1", {late}); });
  ASSERT_EQ(seen.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "consumer never saw not_ready";
  ASSERT_TRUE(producer_->commit(hash_of("late"), 42).ok());
  auto out = loading.get();
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  expect_bytes("r1", "late", 42);
}

TEST_P(ConformanceTest, TenfoldOversubscriptionNeverServesWrongBytes) {
  if (!GetParam().transfers()) GTEST_SKIP() << "local moves nothing";
  // Room for 8 seed items at the producer (disk: 8 files); 80 go through.
  start_producer({{"pool_bytes", "13MiB"},
                  {"max_bytes", 8 * 1638400 + 8 * 1024},
                  {"delete_on_release", false}});
  make_consumer({{"failure_policy", "fail"}, {"delete_on_release", false}});
  EcTransferParams first;
  for (int round = 0; round < 40; ++round) {
    std::string t1 = "o" + std::to_string(2 * round), t2 = "o" + std::to_string(2 * round + 1);
    auto p1 = save(t1, 1000 + 2 * round), p2 = save(t2, 1001 + 2 * round);
    if (round == 0) first = p1;
    std::string rid = "r" + std::to_string(round);
    auto out = load(rid, {p1, p2});
    ASSERT_TRUE(out.status.ok()) << "round " << round << ": " << out.status.to_string();
    expect_bytes(rid, t1, 1000 + 2 * round);
    expect_bytes(rid, t2, 1001 + 2 * round);
    consumer_->request_finished(rid);
  }
  if (GetParam().connector == "store") return;  // Redis is not capped here
  // The first item was evicted long ago. Its old params must fail, never return bytes.
  make_consumer({{"failure_policy", "fail"}});  // a fresh consumer: nothing cached locally
  auto stale = load("stale", {first});
  ASSERT_FALSE(stale.status.ok());
  EXPECT_TRUE(stale.status.code() == StatusCode::kEvicted ||
              stale.status.code() == StatusCode::kNotFound)
      << stale.status.to_string();
  if (GetParam().p2p()) {
    auto stats = producer_->stats();
    ASSERT_TRUE(stats.ok());
    EXPECT_GT((*stats)["producer_pool"]["evictions"].get<uint64_t>(), 60u);
    EXPECT_LE((*stats)["producer_pool"]["bytes_used_per_payload_byte"].get<double>(), 1.01);
  }
}

TEST_P(ConformanceTest, ConsumerKilledAfterReadingHasItsPinsReclaimedByLease) {
  if (!GetParam().p2p()) GTEST_SKIP() << GetParam().connector << " holds no producer-side pins";
  start_producer({{"lease_ms", 1000}});
  // A separate consumer process reads the block and dies without releasing it. (Started
  // first: once the lease ends, the params no longer grant the block.)
  auto reader = ConnectorPeer::start(
      {{"connector", "local"}, {"role", "consumer"}, {"extra", {{"engine_id", "reader-" + tag_}}}});
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  auto p = save("a", 1);
  auto read = reader->command("read " + p.to_json().dump());
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  ASSERT_TRUE(reader->process().kill(SIGKILL).ok());
  ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
  auto stats = producer_->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GE((*stats)["producer_pool"]["lease_expiries"].get<uint64_t>(), 1u);
  EXPECT_EQ((*stats)["producer_pool"]["pins"].get<uint64_t>(), 0u);
}

TEST_P(ConformanceTest, ReleaseFreesProducerPinsAndDiskFiles) {
  if (!GetParam().transfers()) GTEST_SKIP() << "local holds nothing";
  start_producer();
  make_consumer();
  auto p = save("a", 1);
  auto out = load("r1", {p});
  ASSERT_TRUE(out.status.ok()) << out.status.to_string();
  consumer_->request_finished("r1");
  if (GetParam().p2p()) {
    // Long lease: only the consumer's RELEASE can have unpinned it.
    ASSERT_TRUE(producer_->command("wait-unpinned 20000").ok());
    auto stats = producer_->stats();
    EXPECT_EQ((*stats)["producer_pool"]["lease_expiries"].get<uint64_t>(), 0u);
  }
  if (GetParam().connector == "disk") {
    EXPECT_FALSE(std::filesystem::exists(root_ / p.mm_hash.str() / "encoder_cache.safetensors"));
  }
}

TEST_P(ConformanceTest, ProducerKilledFailsWithinTheDeadlineOrRecomputes) {
  start_producer();
  auto p = save("a", 7);
  if (producer_) {
    ASSERT_TRUE(producer_->process().kill(SIGKILL).ok());
    ASSERT_TRUE(producer_->process().wait(Deadline::after_ms(20000)).ok());
  }
  make_consumer({{"failure_policy", "fail"}, {"load_timeout_ms", 5000}});
  auto out = load("r1", {p});
  if (GetParam().p2p()) {
    ASSERT_FALSE(out.status.ok());
    EXPECT_EQ(out.status.code(), StatusCode::kUnavailable) << out.status.to_string();
  } else if (GetParam().transfers()) {
    EXPECT_TRUE(out.status.ok()) << "disk and Redis outlive the producer: "
                                 << out.status.to_string();
  } else {
    EXPECT_EQ(out.status.code(), StatusCode::kNotFound) << out.status.to_string();
  }
  make_consumer({{"failure_policy", "recompute"}, {"load_timeout_ms", 5000}},
                /*can_recompute=*/true);
  auto rec = load("r2", {p});
  ASSERT_TRUE(rec.status.ok()) << rec.status.to_string();
  expect_bytes("r2", "a", 7);
}

TEST_P(ConformanceTest, StalledProducerMeetsTheDeadline) {
  if (!GetParam().p2p()) GTEST_SKIP() << "only p2p talks to the producer process";
  start_producer();
  auto p = save("a", 1);
  p.region = 0;  // force a control request to the producer
  p.sign("");
  ASSERT_TRUE(producer_->process().kill(SIGSTOP).ok());
  make_consumer({{"failure_policy", "fail"}, {"load_timeout_ms", 300}});
  auto start = Clock::now();
  auto out = load("r1", {p});
  ASSERT_TRUE(producer_->process().kill(SIGCONT).ok());
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), StatusCode::kDeadlineExceeded) << out.status.to_string();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(20));  // bounded, not a hang
}

// A wait shorter than the load it waits for (vLLM's scheduler looking in for a moment)
// ends by its own deadline: a load no loader has taken yet is left to one, not run on the
// waiting thread, which a stalled producer would then hold for the whole load.
TEST_P(ConformanceTest, AShortWaitForAQueuedLoadEndsByItsOwnDeadline) {
  if (!GetParam().p2p()) GTEST_SKIP() << "only p2p talks to the producer process";
  start_producer();
  std::vector<LoadRequest> requests;
  for (const char* tag : {"a", "b"}) {
    auto p = save(tag, 1);
    p.region = 0;  // force a control request to the producer
    p.sign("");
    LoadRequest r;
    r.request_id = std::string("r-") + tag;
    r.items.push_back({p.mm_hash, p.meta, p});
    requests.push_back(r);
  }
  ASSERT_TRUE(producer_->process().kill(SIGSTOP).ok());
  make_consumer({{"failure_policy", "fail"}, {"loader_threads", 1}});  // load_timeout 20 s
  // The first load takes the only loader (and waits on the stalled producer); the
  // second is queued behind it.
  for (const auto& r : requests) {
    ASSERT_TRUE(consumer_->update_state_after_alloc(r, 0).ok());
    ASSERT_TRUE(consumer_->start_load_caches(consumer_->build_connector_meta()).ok());
  }
  auto out = consumer_->wait_for_load("r-b", Deadline::after_ms(200));
  ASSERT_TRUE(producer_->process().kill(SIGCONT).ok());
  // Still running: no outcome yet (run here, the load would have ended, failed, after
  // its 20 s against the stalled producer).
  EXPECT_EQ(out.status.code(), StatusCode::kDeadlineExceeded) << out.status.to_string();
  EXPECT_TRUE(out.items.empty()) << "the wait ran the load itself";
  // Both loads still end, on the loader.
  for (const auto& r : requests) {
    EXPECT_EQ(consumer_->wait_for_load(r.request_id, Deadline::after_ms(60000)).items.size(), 1u);
  }
}

TEST_P(ConformanceTest, CorruptOrOutOfRangeParamsAreRejected) {
  if (!GetParam().transfers()) GTEST_SKIP() << "local ignores params";
  start_producer();
  make_consumer({{"failure_policy", "fail"}});
  auto p = save("a", 1);
  // Params a (buggy) producer signed but got wrong are still checked before use.
  // Wrong geometry: the params say one shape, the producer holds another.
  EcTransferParams wrong_shape = p;
  wrong_shape.meta = TensorMeta{DType::kBF16, {401, 2048}};
  wrong_shape.sign("");
  auto out = load("r1", {wrong_shape});
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), StatusCode::kInvalidArgument) << out.status.to_string();
  // pull-2step asks the producer for the address, so a bad location in params is moot.
  if (GetParam().p2p() && GetParam().mode == "pull") {
    // A location outside what the producer granted: refused before any byte moves (out
    // of range, or not granted, which the consumer reports as evicted).
    EcTransferParams far = p;
    far.offset = (1ull << 40);
    far.sign("");
    auto o = load("r2", {far});
    EXPECT_TRUE(o.status.code() == StatusCode::kOutOfRange ||
                o.status.code() == StatusCode::kEvicted)
        << o.status.to_string();
    EcTransferParams bad_region = p;
    bad_region.region = 4242;
    bad_region.sign("");
    auto r = load("r3", {bad_region});
    EXPECT_TRUE(r.status.code() == StatusCode::kNotFound || r.status.code() == StatusCode::kEvicted)
        << r.status.to_string();
  }
  // Malformed JSON never becomes params.
  for (const char* bad :
       {R"({"connector":"p2p"})",
        R"({"connector":"p2p","mm_hash":"../x","dtype":"BF16","shape":[1]})",
        R"({"connector":"p2p","mm_hash":"a","dtype":"BF16","shape":[1],"offset":-5})",
        R"({"connector":"p2p","mm_hash":"a","dtype":"Q9","shape":[1]})"}) {
    EXPECT_FALSE(EcTransferParams::from_json(json::parse(bad)).ok()) << bad;
  }
  // Fresh params for the item still work after all that (each load above ended the
  // pin its params carried, as a consumer does after every load).
  auto good = load("r4", {save("a", 1)});
  ASSERT_TRUE(good.status.ok()) << good.status.to_string();
  expect_bytes("r4", "a", 1);
}

TEST_P(ConformanceTest, IncompatibleHashIsRefusedNamingBothHashes) {
  if (!GetParam().transfers()) GTEST_SKIP() << "local loads nothing";
  start_producer({{"compat_hash", "model-a"}});
  make_consumer({{"compat_hash", "model-b"}, {"failure_policy", "fail"}});
  auto p = save("a", 1);
  auto out = load("r1", {p});
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), StatusCode::kIncompatible) << out.status.to_string();
  EXPECT_NE(out.status.message().find("model-a"), std::string::npos) << out.status.to_string();
  EXPECT_NE(out.status.message().find("model-b"), std::string::npos) << out.status.to_string();
}

TEST_P(ConformanceTest, ConcurrentLoadsEachGetTheirBytes) {
  start_producer();
  make_consumer({}, !GetParam().transfers());
  std::vector<EcTransferParams> params;
  // append(), not `"c" + std::to_string(i)`: that trips GCC 12's false -Wrestrict at -O3.
  for (int i = 0; i < 12; ++i)
    params.push_back(save(std::string("c").append(std::to_string(i)), 300 + i));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Overlapping sets: items 3t..3t+5 (shared with the next thread).
      std::vector<EcTransferParams> mine;
      for (int i = 3 * t; i < 3 * t + 6 && i < 12; ++i) mine.push_back(params[i]);
      std::string rid = "t" + std::to_string(t);
      auto out = load(rid, mine);
      if (!out.status.ok()) {
        ADD_FAILURE() << rid << ": " << out.status.to_string();
        failures++;
      }
      for (const auto& p : mine) {
        auto ref = consumer_->loaded(rid, p.mm_hash);
        auto want = pattern(kSeedItem, seeds_.at(p.mm_hash));
        if (!ref.ok() || std::memcmp(ref->payload(), want.data(), want.size()) != 0) failures++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// Every p2p mode over every backend: shm (auto on one host), tcp, ucx over tcp and ucx
// over shared memory; zero-copy pull (viewed over shm; over tcp it falls back to the
// copy); then the other connectors.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (std::string mode : {"pull", "pull-2step", "push"}) {
    std::string label = "p2p_" + mode;
    std::replace(label.begin(), label.end(), '-', '_');
    cases.push_back({label, "p2p", mode});
    cases.push_back({label + "_tcp", "p2p", mode, "tcp"});
    cases.push_back({label + "_ucx_tcp", "p2p", mode, "ucx", "tcp"});
    cases.push_back({label + "_ucx_shm", "p2p", mode, "ucx", "posix,cma"});
  }
  cases.push_back({"p2p_pull_view", "p2p", "pull", "", "", true});
  cases.push_back({"p2p_pull_view_tcp", "p2p", "pull", "tcp", "", true});
  cases.push_back({"disk", "disk", ""});
  cases.push_back({"store", "store", ""});
  cases.push_back({"local", "local", ""});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Connectors, ConformanceTest, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return info.param.label; });

TEST(ConnectorConfig, ParsesVllmStyleJsonAndNames) {
  auto c =
      ConnectorConfig::parse(R"({"connector":"p2p","role":"consumer","extra":{"mode":"push"}})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->connector, "p2p");
  EXPECT_EQ(c->role, Role::kConsumer);
  EXPECT_EQ(c->extra["mode"], "push");
  auto n = ConnectorConfig::from_name("p2p:pull-2step", Role::kProducer);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->extra["mode"], "pull-2step");
  EXPECT_FALSE(ConnectorConfig::from_name("disk:fast", Role::kProducer).ok());
  EXPECT_FALSE(ConnectorConfig::parse("[]").ok());
  EXPECT_FALSE(ConnectorConfig::parse(R"({"connector":"p2p","role":"boss"})").ok());
  // Unknown connectors and options are refused by name.
  ConnectorConfig unknown;
  unknown.connector = "nixl";
  auto u = create_connector(unknown);
  ASSERT_FALSE(u.ok());
  EXPECT_NE(u.status().message().find("nixl"), std::string::npos);
  ConnectorConfig typo;
  typo.connector = "p2p";
  typo.extra = {{"lese_ms", 5}};
  auto t = create_connector(typo);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("lese_ms"), std::string::npos);
  // An option out of its range is refused by name.
  for (int threads : {0, 17}) {
    ConnectorConfig bad;
    bad.connector = "p2p";
    bad.extra = {{"copy_threads", threads}};
    auto b = create_connector(bad);
    ASSERT_FALSE(b.ok()) << threads;
    EXPECT_EQ(b.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(b.status().message().find("copy_threads"), std::string::npos)
        << b.status().to_string();
  }
  // A name a peer or a socket cannot carry, and a host that is no address, are refused at
  // start, naming what was wrong.
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"engine_id", std::string("e\0x", 3)},
                                                        {"engine_id", "two words"},
                                                        {"engine_id", ""},
                                                        {"tcp_host", "999.1.2.3"},
                                                        {"tcp_host", "host_name"},
                                                        {"tcp_host", "-bad.example"},
                                                        {"tcp_advertise_host", "999.1.2.3"},
                                                        {"tcp_advertise_host", "host_name"}}) {
    ConnectorConfig bad;
    bad.connector = "p2p";
    bad.extra = {{key, value}};
    auto b = create_connector(bad);
    ASSERT_FALSE(b.ok()) << key << " " << value;
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << b.status().to_string();
    EXPECT_NE(b.status().message().find(key), std::string::npos) << b.status().to_string();
  }
  for (const char* host : {"10.0.0.7", "::1", "0.0.0.0", "e-0.hosts.example"}) {
    auto options = ConnectorOptions::parse("p2p", {{"tcp_host", host}});
    EXPECT_TRUE(options.ok()) << host << ": " << options.status().to_string();
  }
}

}  // namespace
}  // namespace ecx::connector
