// Two agents in one process: every code path of the agent with server-side state in
// view. The same tests run over shm, tcp and ucx (over tcp and over shared memory).
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/transfer/agent.h"
#include "support/backend_cases.h"
#include "support/peer_process.h"
#include "support/poll.h"
#include "transfer/read_digests.h"
#include "transfer/tcp_backend.h"
#include "wire/wire.h"

namespace ecx::transfer {
namespace {

using ecx::testing::BackendCase;
using ecx::testing::local_config;

constexpr uint64_t kRegionBytes = 16ull << 20;

bool contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

class AgentLocalTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override {
    producer_ = std::move(Agent::create(GetParam().apply(local_config("producer"))).value());
    consumer_ = std::move(Agent::create(GetParam().apply(local_config("consumer"))).value());
    src_ = producer_->allocate(kRegionBytes).value();
    sink_ = producer_->allocate(kRegionBytes, {.remote_read = true, .remote_write = true}).value();
    fill_pattern(src_.data, src_.length, 1234);
    dst_.resize(kRegionBytes);
    auto connected = consumer_->connect(producer_->metadata(), {.backend = GetParam().backend});
    ASSERT_TRUE(connected.ok()) << connected.status().to_string();
    ASSERT_EQ(*consumer_->peer_backend("producer"), GetParam().backend);
  }

  Status read(std::vector<TransferDescriptor> descs, Deadline d = Deadline::after_ms(20000)) {
    auto h = consumer_->read("producer", descs, d);
    if (!h.ok()) return h.status();
    return h->wait(d);
  }

  uint64_t rejections() const {
    // Refused by the reading agent when it can tell from the regions it knows (shm
    // mappings, tcp metadata), else by the serving agent (tcp, unknown region).
    return producer_->stats().rejected_requests + consumer_->stats().rejected_descriptors;
  }

  std::unique_ptr<Agent> producer_, consumer_;
  LocalRegion src_, sink_;
  std::vector<std::byte> dst_;
};

TEST_P(AgentLocalTest, SingleReadsAreBitExactAcrossSizes) {
  for (uint64_t size : {1ull, 3ull, 4096ull, 65537ull, 1600ull << 10, (4ull << 20) + 1}) {
    std::memset(dst_.data(), 0, size);
    uint64_t offset = 7;  // unaligned on purpose
    ASSERT_TRUE(read({{dst_.data(), src_.id, offset, size}}).ok()) << size;
    ASSERT_EQ(std::memcmp(dst_.data(), src_.data + offset, size), 0) << "size " << size;
  }
}

TEST_P(AgentLocalTest, BatchedReadLandsEveryItemInPlace) {
  std::vector<TransferDescriptor> descs;
  uint64_t local = 0;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 16; ++i) {
    uint64_t size = 1 + rng() % (700 << 10);
    uint64_t remote = rng() % (kRegionBytes - size);
    descs.push_back({dst_.data() + local, src_.id, remote, size});
    local += size;
  }
  Status s = read(descs);
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (const auto& d : descs) {
    ASSERT_EQ(std::memcmp(d.local, src_.data + d.remote_offset, d.length), 0);
  }
  EXPECT_EQ(consumer_->stats().bytes_read, local);
}

// Each batch's time, from submission to its end, lands in one bucket of the reader's
// histogram for its direction: the batch above is one read, no write.
TEST_P(AgentLocalTest, EachBatchIsTimedInItsDirectionsHistogram) {
  for (int i = 0; i < 3; ++i) {
    Status s = read({{dst_.data(), src_.id, 4096, 64 << 10}});
    ASSERT_TRUE(s.ok()) << s.to_string();
  }
  AgentStats stats = consumer_->stats();
  const LatencyHistogram& reads = stats.read_seconds;
  EXPECT_EQ(reads.count, 3u);
  EXPECT_EQ(stats.write_seconds.count, 0u);
  ASSERT_EQ(reads.bounds.size(), kLatencyBounds.size());
  ASSERT_EQ(reads.cumulative.size(), kLatencyBounds.size());
  EXPECT_TRUE(std::is_sorted(reads.cumulative.begin(), reads.cumulative.end()));
  EXPECT_LE(reads.cumulative.back(), reads.count);
  EXPECT_GT(reads.sum_seconds, 0.0);
  // Each batch's time is at most the whole sum, so its bucket is at or under the sum's.
  const auto at_sum = std::lower_bound(reads.bounds.begin(), reads.bounds.end(), reads.sum_seconds);
  if (at_sum != reads.bounds.end()) {
    EXPECT_EQ(reads.cumulative[at_sum - reads.bounds.begin()], 3u);
  }
}

// A READ may ask for the checksum of each item's payload (past a header): tcp hashes the
// bytes as they land, an item cut across its two streams included; the other backends
// leave it to the caller (nullopt), never a wrong value.
TEST_P(AgentLocalTest, AskedDigestsAreTheLandedBytesChecksums) {
  constexpr uint64_t kHeader = 4096;
  std::vector<TransferDescriptor> descs;
  uint64_t local = 0;
  for (uint64_t size : {1600ull << 10, 1600ull << 10, 1600ull << 10, (5ull << 20) + 3, 9000ull}) {
    uint64_t remote = (local * 3 + 11) % (kRegionBytes - size);
    descs.push_back({dst_.data() + local, src_.id, remote, size});
    descs.back().digest_from = kHeader;
    descs.back().digest_length = size - kHeader - 1;
    local += size;
  }
  descs.push_back({dst_.data() + local, src_.id, 0, 4096});  // asks for none
  auto h = consumer_->read("producer", descs, Deadline::after_ms(20000));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(h->wait(Deadline::after_ms(20000)).ok());
  for (size_t k = 0; k < descs.size(); ++k) {
    const TransferDescriptor& d = descs[k];
    ASSERT_EQ(std::memcmp(d.local, src_.data + d.remote_offset, d.length), 0) << k;
    auto digest = h->digest(k);
    if (d.digest_length == 0 || GetParam().backend != Backend::kTcp) {
      EXPECT_FALSE(digest.has_value()) << k;
      continue;
    }
    ASSERT_TRUE(digest.has_value()) << k;
    EXPECT_EQ(*digest,
              checksum64(static_cast<std::byte*>(d.local) + d.digest_from, d.digest_length))
        << k;
  }
}

TEST_P(AgentLocalTest, WriteArrivesBeforeItsNotification) {
  std::vector<std::byte> data(3 << 20);
  fill_pattern(data.data(), data.size(), 77);
  TransferDescriptor d{data.data(), sink_.id, 4096, data.size()};
  auto h = consumer_->write("producer", {&d, 1}, std::string("item-ready"));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  auto n = producer_->wait_notification(Deadline::after_ms(20000));
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  EXPECT_EQ(n->from, "consumer");
  EXPECT_EQ(n->message, "item-ready");
  // The notification came after the data: the bytes are already there.
  EXPECT_EQ(std::memcmp(sink_.data + 4096, data.data(), data.size()), 0);
  EXPECT_TRUE(h->wait(Deadline::after_ms(20000)).ok());
}

TEST_P(AgentLocalTest, OutOfRangeAndUnknownRegionsAreRejectedAndCounted) {
  uint64_t before = rejections();
  Status past_end = read({{dst_.data(), src_.id, kRegionBytes - 10, 11}});
  EXPECT_EQ(past_end.code(), StatusCode::kOutOfRange) << past_end.to_string();
  EXPECT_TRUE(contains(past_end, "outside the region")) << past_end.to_string();
  EXPECT_TRUE(contains(past_end, "region " + std::to_string(src_.id))) << past_end.to_string();
  Status overflow = read({{dst_.data(), src_.id, UINT64_MAX - 2, 8}});
  EXPECT_EQ(overflow.code(), StatusCode::kOutOfRange) << overflow.to_string();
  Status unknown = read({{dst_.data(), 999, 0, 8}});
  EXPECT_EQ(unknown.code(), StatusCode::kNotFound) << unknown.to_string();
  EXPECT_TRUE(contains(unknown, "region 999")) << unknown.to_string();
  EXPECT_EQ(rejections(), before + 3);

  std::byte one{1};
  TransferDescriptor to_readonly{&one, src_.id, 0, 1};
  auto w = consumer_->write("producer", {&to_readonly, 1});
  Status ws = w.ok() ? w->wait(Deadline::after_ms(20000)) : w.status();
  EXPECT_EQ(ws.code(), StatusCode::kFailedPrecondition) << ws.to_string();
  EXPECT_TRUE(contains(ws, "not remotely writable"));

  // The connection still works after the rejections.
  ASSERT_TRUE(read({{dst_.data(), src_.id, 0, 4096}}).ok());
  EXPECT_EQ(std::memcmp(dst_.data(), src_.data, 4096), 0);
}

TEST_P(AgentLocalTest, BadLocalDescriptorsAreRefusedBeforeSending) {
  EXPECT_EQ(read({}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(read({{nullptr, src_.id, 0, 8}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(read({{dst_.data(), src_.id, 0, 0}}).code(), StatusCode::kInvalidArgument);
  TransferDescriptor digest_past_end{dst_.data(), src_.id, 0, 4096};
  digest_past_end.digest_from = 4000;
  digest_past_end.digest_length = 97;
  Status past = read({digest_past_end});
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument) << past.to_string();
  EXPECT_TRUE(contains(past, "digest")) << past.to_string();
  EXPECT_GE(consumer_->stats().rejected_descriptors, 2u);
  auto h = consumer_->read("nobody", std::vector<TransferDescriptor>{{dst_.data(), 1, 0, 1}});
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(contains(h.status(), "nobody"));
}

TEST_P(AgentLocalTest, ConcurrentReadersEachGetTheirOwnBytes) {
  constexpr int kThreads = 4, kReads = 25;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::byte> buf(2 << 20);
      std::mt19937_64 rng(t);
      for (int i = 0; i < kReads; ++i) {
        uint64_t size = 1 + rng() % buf.size();
        uint64_t off = rng() % (kRegionBytes - size);
        TransferDescriptor d{buf.data(), src_.id, off, size};
        auto h = consumer_->read("producer", {&d, 1});
        if (!h.ok() || !h->wait(Deadline::after_ms(20000)).ok() ||
            std::memcmp(buf.data(), src_.data + off, size) != 0) {
          failures++;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(AgentLocalTest, CallsAndErrorsTravelBothWays) {
  producer_->set_call_handler([](const Caller& from, std::string_view req) -> Result<std::string> {
    if (req == "fail") return Status(StatusCode::kEvicted, "block generation 7 != expected 6");
    return from.name + ":" + std::string(req);
  });
  auto ok = consumer_->call("producer", "ping", Deadline::after_ms(20000));
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(*ok, "consumer:ping");
  auto err = consumer_->call("producer", "fail", Deadline::after_ms(20000));
  ASSERT_FALSE(err.ok());
  EXPECT_EQ(err.status().code(), StatusCode::kEvicted);
  EXPECT_EQ(err.status().message(), "block generation 7 != expected 6");
}

TEST_P(AgentLocalTest, CallHonoursItsDeadline) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;   // guarded by mu
  bool returned = false;  // guarded by mu
  producer_->set_call_handler([&](const Caller&, std::string_view) -> Result<std::string> {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });
    returned = true;
    cv.notify_all();
    return std::string("late");
  });
  auto r = consumer_->call("producer", "slow", Deadline::after_ms(100));
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  // Let the handler finish before mu and cv (on this stack) go away (ThreadSanitizer).
  std::unique_lock lock(mu);
  release = true;
  cv.notify_all();
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return returned; }));
}

// A caller polls for its reply before it sleeps (AgentConfig::reply_spin_us): the replies
// of other callers on the same channel land meanwhile, in any order.
TEST_P(AgentLocalTest, ConcurrentCallersEachGetTheirOwnReply) {
  producer_->set_call_handler([](const Caller&, std::string_view req) -> Result<std::string> {
    // Some replies wait a little, so that later calls are answered first.
    std::this_thread::sleep_for(std::chrono::microseconds(req.size() % 3 == 0 ? 200 : 0));
    return "re:" + std::string(req);
  });
  constexpr int kThreads = 4, kCalls = 60;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCalls; ++i) {
        const std::string req = std::to_string(t) + "/" + std::to_string(i);
        auto r = consumer_->call("producer", req, Deadline::after_ms(20000));
        if (!r.ok() || *r != "re:" + req) failures++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// However long a caller may poll, its deadline still ends the wait.
TEST_P(AgentLocalTest, PollingForAReplyEndsAtTheCallsDeadline) {
  AgentConfig config = GetParam().apply(local_config("patient-consumer"));
  config.reply_spin_us = 60'000'000;
  auto patient = Agent::create(config);
  ASSERT_TRUE(patient.ok()) << patient.status().to_string();
  ASSERT_TRUE((*patient)->connect(producer_->metadata(), {.backend = GetParam().backend}).ok());
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;  // guarded by mu
  int returned = 0;      // guarded by mu
  producer_->set_call_handler([&](const Caller&, std::string_view) -> Result<std::string> {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(20), [&] { return release; });
    ++returned;
    cv.notify_all();
    return std::string("late");
  });
  const auto start = std::chrono::steady_clock::now();
  auto r = (*patient)->call("producer", "slow", Deadline::after_ms(100));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().to_string();
  EXPECT_LT(waited, std::chrono::seconds(10));  // the deadline, not the 60 s of polling
  std::unique_lock lock(mu);
  release = true;
  cv.notify_all();
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return returned == 1; }));
}

TEST_P(AgentLocalTest, ZeroCopyViewOnlyOverShm) {
  auto v = consumer_->view("producer", src_.id, 100, 1 << 20);
  if (GetParam().backend == Backend::kShm) {
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_EQ(std::memcmp(v->data, src_.data + 100, 1 << 20), 0);
    // Same memory, not a copy: a producer write is visible through the view.
    src_.data[100] = std::byte{0x5a};
    EXPECT_EQ(v->data[0], std::byte{0x5a});
    EXPECT_EQ(consumer_->view("producer", src_.id, kRegionBytes, 1).status().code(),
              StatusCode::kOutOfRange);
  } else {
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.status().code(), StatusCode::kFailedPrecondition);
  }
}

TEST_P(AgentLocalTest, DeregisteredRegionIsNotFoundForNewReaders) {
  auto extra = producer_->allocate(1 << 20).value();
  ASSERT_TRUE(producer_->deregister(extra.id).ok());
  Status s = read({{dst_.data(), extra.id, 0, 16}});
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
  EXPECT_EQ(producer_->deregister(extra.id).code(), StatusCode::kNotFound);
}

TEST_P(AgentLocalTest, ProducerShutdownFailsTheConsumerCleanly) {
  producer_.reset();
  Status s = read({{dst_.data(), src_.id, 0, 4096}});
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_TRUE(contains(s, "producer")) << s.to_string();
}

INSTANTIATE_TEST_SUITE_P(Backends, AgentLocalTest,
                         ::testing::ValuesIn(ecx::testing::transfer_backends()),
                         [](const auto& info) { return info.param.name; });

// Pieces of one range landing on several threads in any order hash to the checksum of the
// whole range, recorded once (the piece before an early one hashes it too).
TEST(ReadDigests, PiecesLandingInAnyOrderOnManyThreadsGiveTheRangesChecksum) {
  std::vector<std::byte> bytes(3 << 20);
  fill_pattern(bytes.data(), bytes.size(), 42);
  constexpr uint64_t kPiece = 64 << 10;
  for (int round = 0; round < 20; ++round) {
    TransferDescriptor d{bytes.data(), 0, 0, bytes.size()};
    d.digest_from = 100;
    d.digest_length = bytes.size() - 200;
    TransferState state("test", 1);
    auto digests = ReadDigests::for_batch({&d, 1});
    ASSERT_NE(digests, nullptr);
    std::vector<uint64_t> starts;
    for (uint64_t at = 0; at < bytes.size(); at += kPiece) starts.push_back(at);
    std::shuffle(starts.begin(), starts.end(), std::mt19937_64(round));
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (size_t i = t; i < starts.size(); i += 4) {
          uint64_t n = std::min<uint64_t>(kPiece, bytes.size() - starts[i]);
          digests->landed(0, starts[i], n, state);
        }
      });
    }
    for (auto& t : threads) t.join();
    auto got = state.digest(0);
    ASSERT_TRUE(got.has_value()) << round;
    EXPECT_EQ(*got, checksum64(bytes.data() + 100, bytes.size() - 200)) << round;
  }
  TransferDescriptor none{bytes.data(), 0, 0, bytes.size()};
  EXPECT_EQ(ReadDigests::for_batch({&none, 1}), nullptr);
}

// A batch over two tcp streams: equal bytes per stream, and an item cut between them comes
// first on the stream that begins it and last on the one that ends it, so that its digest
// never waits for its head (each stream hashes what it receives). Every byte of every
// item is in exactly one slice.
TEST(TcpDataPool, AnItemCutAcrossStreamsComesHeadFirstAndTailLast) {
  constexpr uint64_t kItem = 1600 << 10;
  std::vector<std::byte> dst(4 * kItem);
  auto descriptors_of = [&](int items) {
    std::vector<TransferDescriptor> descs;
    for (int k = 0; k < items; ++k) descs.push_back({dst.data() + k * kItem, 7, k * kItem, kItem});
    return descs;
  };
  auto order = [](const TcpDataPool::Job& job) {
    std::vector<std::pair<size_t, uint64_t>> out;  // (item, offset within it)
    for (const auto& s : job.slices) out.emplace_back(s.descriptor, s.at);
    return out;
  };
  using Order = std::vector<std::pair<size_t, uint64_t>>;
  auto three = descriptors_of(3);
  auto jobs = TcpDataPool::split(three, 4 << 20, 2);
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(order(jobs[0]), (Order{{1, 0}, {0, 0}}));
  EXPECT_EQ(order(jobs[1]), (Order{{2, 0}, {1, kItem / 2}}));
  // Four items over three streams: the middle stream has a tail and a head.
  auto four = descriptors_of(4);
  jobs = TcpDataPool::split(four, 4 << 20, 3);
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(order(jobs[0]), (Order{{1, 0}, {0, 0}}));
  const uint64_t share = (4 * kItem + 2) / 3;
  EXPECT_EQ(order(jobs[1]), (Order{{2, 0}, {1, share - kItem}}));
  EXPECT_EQ(order(jobs[2]), (Order{{3, 0}, {2, 2 * share - 2 * kItem}}));
  for (const auto& [descs, streams] : {std::pair{three, size_t{2}}, std::pair{four, size_t{3}}}) {
    std::vector<uint64_t> covered(descs.size(), 0);
    for (const auto& job : TcpDataPool::split(descs, 4 << 20, streams)) {
      for (const auto& s : job.slices) {
        EXPECT_EQ(s.local, static_cast<std::byte*>(descs[s.descriptor].local) + s.at);
        EXPECT_EQ(s.offset, descs[s.descriptor].remote_offset + s.at);
        covered[s.descriptor] += s.length;
      }
    }
    for (size_t k = 0; k < descs.size(); ++k) EXPECT_EQ(covered[k], kItem) << k;
  }
}

TEST(AgentConnect, ConcurrentConnectsCoalesceIntoOneHandshake) {
  auto producer = std::move(Agent::create(local_config("producer")).value());
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  AgentMetadata meta = producer->metadata();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      if (consumer->connect(meta).ok()) ok++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(consumer->stats().peers_connected, 1u);
}

// The resident bytes (pages in its page tables) of this process's first mapping that
// `pick` takes (given its start, end and permissions), from /proc/self/smaps; 0 if none.
uint64_t mapped_bytes(const std::function<bool(uintptr_t, uintptr_t, const std::string&)>& pick) {
  std::ifstream smaps("/proc/self/smaps");
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t start = 0, end = 0;
    char perms[8] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %7s ", &start, &end, perms) == 3) {
      inside = pick(start, end, perms);
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      return std::stoull(line.substr(4)) << 10;  // "Rss:   N kB"
    }
  }
  return 0;
}

uint64_t mapped_bytes_at(const void* address) {
  const auto at = reinterpret_cast<uintptr_t>(address);
  return mapped_bytes(
      [at](uintptr_t start, uintptr_t end, const std::string&) { return start <= at && at < end; });
}

// A first read or view maps the peer's whole arena and fills the page tables of the chunks
// it touches; a thread then fills the rest, so that later loads of other blocks do not
// each pay for theirs. Both agents gone while it runs: nothing waits or leaks.
TEST(ShmMapping, APeersArenaIsFilledInTheBackgroundAfterTheFirstRead) {
  constexpr uint64_t kArena = 64ull << 20;
  for (bool through_view : {false, true}) {
    SCOPED_TRACE(through_view ? "view" : "read");
    auto producer = std::move(Agent::create(local_config("producer")).value());
    auto consumer = std::move(Agent::create(local_config("consumer")).value());
    auto arena = producer->allocate(kArena).value();
    ASSERT_TRUE(consumer->connect(producer->metadata(), {.backend = Backend::kShm}).ok());
    std::vector<std::byte> one(4096);
    if (through_view) {
      auto v = consumer->view("producer", arena.id, 0, one.size());
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      EXPECT_TRUE(ecx::testing::poll_until(Deadline::after_ms(30000),
                                           [&] { return mapped_bytes_at(v->data) == kArena; }))
          << mapped_bytes_at(v->data) << " of " << kArena << " bytes mapped";
      continue;
    }
    std::vector<TransferDescriptor> first{{one.data(), arena.id, 0, one.size()}};
    auto h = consumer->read("producer", first, Deadline::after_ms(20000));
    ASSERT_TRUE(h.ok() && h->wait(Deadline::after_ms(20000)).ok());
    // A read leaves no address behind: the consumer's mapping is the read-only shared
    // one of the arena's size (the producer's own is writable).
    auto consumers_mapping = [&] {
      return mapped_bytes([&](uintptr_t start, uintptr_t end, const std::string& perms) {
        return perms == "r--s" && end - start == kArena;
      });
    };
    EXPECT_TRUE(ecx::testing::poll_until(Deadline::after_ms(30000),
                                         [&] { return consumers_mapping() == kArena; }))
        << consumers_mapping() << " of " << kArena << " bytes mapped";
  }
  // Two arenas of one peer: the filler takes one after the other.
  {
    auto producer = std::move(Agent::create(local_config("producer")).value());
    auto consumer = std::move(Agent::create(local_config("consumer")).value());
    auto a = producer->allocate(kArena).value();
    auto b = producer->allocate(kArena).value();
    ASSERT_TRUE(consumer->connect(producer->metadata(), {.backend = Backend::kShm}).ok());
    auto va = consumer->view("producer", a.id, 0, 4096);
    auto vb = consumer->view("producer", b.id, kArena - 4096, 4096);
    ASSERT_TRUE(va.ok() && vb.ok());
    EXPECT_TRUE(ecx::testing::poll_until(
        Deadline::after_ms(30000),
        [&] { return mapped_bytes_at(va->data) == kArena && mapped_bytes_at(vb->data) == kArena; }))
        << mapped_bytes_at(va->data) << " and " << mapped_bytes_at(vb->data);
  }
  // Gone while a fill runs: the destructor stops it.
  auto producer = std::move(Agent::create(local_config("producer")).value());
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  auto big = producer->allocate(256ull << 20).value();
  ASSERT_TRUE(consumer->connect(producer->metadata(), {.backend = Backend::kShm}).ok());
  ASSERT_TRUE(consumer->view("producer", big.id, 0, 4096).ok());
  consumer.reset();
  producer.reset();
}

TEST(AgentConnect, AutoPicksShmOnTheSameHostAndTcpWhenForced) {
  auto producer = std::move(Agent::create(local_config("producer")).value());
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  ASSERT_TRUE(consumer->connect(producer->metadata()).ok());
  EXPECT_EQ(*consumer->peer_backend("producer"), Backend::kShm);
  consumer->disconnect("producer");
  AgentMetadata remote_looking = producer->metadata();
  remote_looking.host_id = "another-host";
  ASSERT_TRUE(consumer->connect(remote_looking).ok());
  EXPECT_EQ(*consumer->peer_backend("producer"), Backend::kTcp);
}

// A wildcard bind with the address peers dial published apart: the peer dials the
// advertised address, not 0.0.0.0, and reads over tcp.
TEST(AgentConnect, AWildcardBindPublishesTheAdvertisedAddressAndIsReadThere) {
  AgentConfig wildcard = local_config("producer");
  wildcard.auth_secret = "deployment-secret";  // without one the agent stays on loopback
  wildcard.tcp_host = "0.0.0.0";
  wildcard.tcp_advertise_host = "127.0.0.2";  // loopback too, but not what it would guess
  auto producer = std::move(Agent::create(wildcard).value());
  AgentConfig reader = local_config("consumer");
  reader.auth_secret = wildcard.auth_secret;
  auto consumer = std::move(Agent::create(reader).value());
  const std::string endpoint = producer->metadata().endpoints.at(Backend::kTcp);
  EXPECT_EQ(endpoint.rfind("127.0.0.2:", 0), 0u) << endpoint;
  auto src = producer->allocate(4096).value();
  fill_pattern(src.data, src.length, 77);
  std::vector<std::byte> dst(4096);
  ASSERT_TRUE(consumer->connect(producer->metadata(), {.backend = Backend::kTcp}).ok());
  std::vector<TransferDescriptor> descs{
      {.local = dst.data(), .remote_region = src.id, .length = dst.size()}};
  auto h = consumer->read("producer", descs, Deadline::after_ms(20000));
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(h->wait(Deadline::after_ms(20000)).ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data, dst.size()), 0);
}

// An agent that listens on loopback only tells its peers so, whatever it was asked to
// advertise: without a secret (it stays on loopback) and on a loopback bind.
TEST(AgentCreate, ALoopbackListenerAdvertisesLoopback) {
  AgentConfig no_secret = local_config("x");
  no_secret.tcp_host = "0.0.0.0";
  no_secret.tcp_advertise_host = "10.0.0.7";
  auto a = std::move(Agent::create(no_secret).value());
  EXPECT_EQ(a->metadata().endpoints.at(Backend::kTcp).rfind("127.0.0.1:", 0), 0u);
  AgentConfig loopback = local_config("y");
  loopback.auth_secret = "s";
  loopback.tcp_advertise_host = "10.0.0.7";
  auto b = std::move(Agent::create(loopback).value());
  EXPECT_EQ(b->metadata().endpoints.at(Backend::kTcp).rfind("127.0.0.1:", 0), 0u);
}

TEST(AgentCreate, AWildcardBindWithoutAnAdvertisedAddressIsRefusedNamingTheFix) {
  AgentConfig wildcard = local_config("x");
  wildcard.auth_secret = "s";
  wildcard.tcp_host = "0.0.0.0";
  auto refused = Agent::create(wildcard);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("tcp_advertise_host"), std::string::npos)
      << refused.status().to_string();
  wildcard.tcp_advertise_host = "0.0.0.0";
  EXPECT_FALSE(Agent::create(wildcard).ok());
}

TEST(AgentConnect, IncompatibleHashIsRefusedNamingBothHashes) {
  auto cfg = local_config("producer");
  cfg.compat_hash = "model-b";
  auto producer = std::move(Agent::create(cfg).value());
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  // Checked by the connecting side from the metadata...
  auto r = consumer->connect(producer->metadata());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible);
  EXPECT_TRUE(contains(r.status(), "'ecx'")) << r.status().to_string();
  EXPECT_TRUE(contains(r.status(), "'model-b'")) << r.status().to_string();
  // ...and by the serving side, even when the metadata lies about the hash. The server
  // names the hash it refused, never the one it expects.
  for (Backend b : {Backend::kShm, Backend::kTcp}) {
    AgentMetadata forged = producer->metadata();
    forged.compat_hash = "ecx";
    auto f = consumer->connect(forged, {.backend = b});
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), StatusCode::kIncompatible) << f.status().to_string();
    EXPECT_TRUE(contains(f.status(), "'ecx'")) << f.status().to_string();
    EXPECT_FALSE(contains(f.status(), "model-b")) << f.status().to_string();
  }
  EXPECT_EQ(producer->stats().handshakes_rejected, 2u);
}

TEST(AgentConnect, UnreachablePeerFailsWithinTheDeadline) {
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  AgentMetadata ghost;
  ghost.name = "ghost";
  ghost.protocol_version = kProtocolVersion;
  ghost.compat_hash = "ecx";
  ghost.endpoints[Backend::kTcp] = "127.0.0.1:1";  // nothing listens on port 1
  auto r = consumer->connect(ghost, {.deadline = Deadline::after_ms(5000)});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().to_string();
}

TEST(AgentCreate, RejectsBadConfig) {
  EXPECT_FALSE(Agent::create({}).ok());
  AgentConfig none;
  none.name = "x";
  none.enable_shm = false;
  none.enable_tcp = false;
  EXPECT_FALSE(Agent::create(none).ok());
  AgentConfig bad_host = local_config("x");
  bad_host.tcp_host = "no.such.host.invalid";
  bad_host.auth_secret = "s";  // without one the agent would listen on loopback instead
  EXPECT_FALSE(Agent::create(bad_host).ok());
}

}  // namespace
}  // namespace ecx::transfer
