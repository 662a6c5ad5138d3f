// The peer is a separate process (`ecx bench transfer-peer`): real memory isolation,
// real fd passing, and a peer that can be killed.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "ecx/common/checksum.h"
#include "ecx/transfer/agent.h"
#include "support/peer_process.h"

namespace ecx::transfer {
namespace {

using ecx::testing::BackendCase;
using ecx::testing::local_config;
using ecx::testing::PeerProcess;
using nlohmann::json;

class AgentProcessTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  void start() {
    auto peer = PeerProcess::start(ecx::testing::peer_options(GetParam()));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_.emplace(std::move(*peer));
    agent_ = std::move(Agent::create(GetParam().apply(local_config("consumer"))).value());
    auto c = agent_->connect(peer_->metadata(), {.backend = GetParam().backend});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
  }

  json call(const json& request) {
    auto r = agent_->call("peer", request.dump(), Deadline::after_ms(20000));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? json::parse(*r, nullptr, false) : json();
  }

  std::optional<PeerProcess> peer_;
  std::unique_ptr<Agent> agent_;
};

TEST_P(AgentProcessTest, RoundTripsFromOneByteToSixtyFourMiB) {
  start();
  const auto& expected = peer_->expected();
  std::vector<std::byte> buf(64ull << 20);
  for (uint64_t size : {1ull, 100ull, 64ull << 10, 1600ull << 10, 8ull << 20, 64ull << 20}) {
    uint64_t offset = size == (64ull << 20) ? 0 : 13;
    std::memset(buf.data(), 0, size);
    TransferDescriptor d{buf.data(), peer_->source_region(), offset, size};
    auto h = agent_->read("peer", {&d, 1});
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    Status s = h->wait(Deadline::after_ms(60000));
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(checksum64(buf.data(), size), checksum64(expected.data() + offset, size)) << size;
  }
}

TEST_P(AgentProcessTest, BatchOfSeedItemsIsBitExact) {
  start();
  // 16 items of 400 x 2048 bf16, as the seed workload moves them.
  constexpr uint64_t kItem = 400 * 2048 * 2;
  std::vector<std::byte> buf(16 * kItem);
  std::vector<TransferDescriptor> descs;
  for (uint64_t i = 0; i < 16; ++i) {
    descs.push_back({buf.data() + i * kItem, peer_->source_region(), (15 - i) * kItem, kItem});
  }
  auto h = agent_->read("peer", descs);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->wait(Deadline::after_ms(60000)).ok());
  for (uint64_t i = 0; i < 16; ++i) {
    ASSERT_EQ(
        std::memcmp(buf.data() + i * kItem, peer_->expected().data() + (15 - i) * kItem, kItem), 0);
  }
}

TEST_P(AgentProcessTest, WritesLandBeforeTheirNotificationInThePeer) {
  start();
  for (int i = 0; i < 5; ++i) {
    std::vector<std::byte> data((1 << 20) * (i + 1) + 17);
    fill_pattern(data.data(), data.size(), 500 + i);
    uint64_t offset = static_cast<uint64_t>(i) * 1000;
    TransferDescriptor d{data.data(), peer_->sink_region(), offset, data.size()};
    json note = {{"offset", offset},
                 {"length", data.size()},
                 {"checksum", checksum64(data.data(), data.size())}};
    auto h = agent_->write("peer", {&d, 1}, note.dump());
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    ASSERT_TRUE(h->wait(Deadline::after_ms(20000)).ok());
    json sum = call({{"op", "checksum"},
                     {"region", peer_->sink_region()},
                     {"offset", offset},
                     {"length", data.size()}});
    EXPECT_EQ(sum["checksum"].get<uint64_t>(), checksum64(data.data(), data.size()));
  }
  // The peer checked each notification against the bytes present when it arrived.
  // Notifications and calls share one ordered channel, so all 5 were checked by now.
  json notified = call({{"op", "notified"}});
  EXPECT_EQ(notified["ok"].get<uint64_t>(), 5u);
  EXPECT_EQ(notified["bad"].get<uint64_t>(), 0u);
}

TEST_P(AgentProcessTest, RejectedRequestsAreCountedByTheServingAgent) {
  start();
  std::vector<std::byte> buf(64);
  TransferDescriptor bad{buf.data(), peer_->source_region(), (64ull << 20) - 8, 64};
  auto h = agent_->read("peer", {&bad, 1});
  Status s = h.ok() ? h->wait(Deadline::after_ms(20000)) : h.status();
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s.to_string();
  EXPECT_NE(s.message().find("peer"), std::string::npos) << s.to_string();
  // Refused once: before sending (the region is known) or by the serving agent.
  uint64_t served = call({{"op", "stats"}})["rejected_requests"].get<uint64_t>();
  EXPECT_EQ(served + agent_->stats().rejected_descriptors, 1u);
  // An unknown region can only be refused by its owner (tcp) or its owner's answer (shm).
  TransferDescriptor unknown{buf.data(), 777, 0, 8};
  auto u = agent_->read("peer", {&unknown, 1});
  Status us = u.ok() ? u->wait(Deadline::after_ms(20000)) : u.status();
  EXPECT_EQ(us.code(), StatusCode::kNotFound) << us.to_string();
  EXPECT_EQ(call({{"op", "stats"}})["rejected_requests"].get<uint64_t>(), served + 1);
}

TEST_P(AgentProcessTest, KilledPeerFailsTheNextTransferPromptly) {
  start();
  std::vector<std::byte> buf(1 << 20);
  TransferDescriptor d{buf.data(), peer_->source_region(), 0, buf.size()};
  ASSERT_TRUE(agent_->read("peer", {&d, 1})->wait(Deadline::after_ms(20000)).ok());
  ASSERT_TRUE(peer_->process().kill(SIGKILL).ok());
  ASSERT_TRUE(peer_->process().wait(Deadline::after_ms(20000)).ok());
  auto h = agent_->read("peer", {&d, 1});
  Status s = h.ok() ? h->wait(Deadline::after_ms(20000)) : h.status();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  auto c = agent_->call("peer", "{}", Deadline::after_ms(20000));
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Backends, AgentProcessTest,
                         ::testing::ValuesIn(ecx::testing::transfer_backends()),
                         [](const auto& info) { return info.param.name; });

// ucx over tcp (error mode peer), where the peer can stall (SIGSTOP) a one-sided READ:
// the deadline ends it, and a killed peer fails it, both after UCX purged the requests
// (the buffer is left alone). Over shared memory a READ needs nothing from the peer (cma
// reads its memory), and error mode none is refused for network transports.
class UcxStalledPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendCase ucx{Backend::kUcx, "tcp", "ucx_tcp"};
    auto peer = PeerProcess::start(ecx::testing::peer_options(ucx));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_.emplace(std::move(*peer));
    auto config = ucx.apply(local_config("consumer"));
    agent_ = std::move(Agent::create(config).value());
    ASSERT_TRUE(agent_->connect(peer_->metadata(), {.backend = Backend::kUcx}).ok());
    buf_.assign(8 << 20, std::byte{0xee});
    // Warm the endpoint, then stop the peer and start a READ it cannot answer.
    TransferDescriptor warm{buf_.data(), peer_->source_region(), 0, 4096};
    ASSERT_TRUE(agent_->read("peer", {&warm, 1})->wait(Deadline::after_ms(20000)).ok());
    std::fill(buf_.begin(), buf_.end(), std::byte{0xee});
    ASSERT_TRUE(peer_->process().kill(SIGSTOP).ok());
    TransferDescriptor d{buf_.data(), peer_->source_region(), 0, buf_.size()};
    auto h = agent_->read("peer", {&d, 1}, Deadline::after_ms(60000));
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    read_.emplace(std::move(*h));
  }
  void TearDown() override {
    if (peer_) peer_->process().kill(SIGCONT).ignore_error();
  }

  // Bytes of buf_ that are no longer the 0xee filler.
  size_t changed_bytes() const {
    return static_cast<size_t>(
        std::count_if(buf_.begin(), buf_.end(), [](std::byte b) { return b != std::byte{0xee}; }));
  }

  std::optional<PeerProcess> peer_;
  std::unique_ptr<Agent> agent_;
  std::vector<std::byte> buf_;
  std::optional<TransferHandle> read_;
};

TEST_F(UcxStalledPeerTest, DeadlineEndsTheReadAndNoByteLandsAfterIt) {
  Status s = read_->wait(Deadline::after_ms(500));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_TRUE(read_->done());
  size_t changed = changed_bytes();
  // The peer resumes and serves a fresh endpoint: a READ through it completes only after
  // the peer has worked through everything sent before. The old READ lands nothing.
  ASSERT_TRUE(peer_->process().kill(SIGCONT).ok());
  std::vector<std::byte> fresh(buf_.size());
  TransferDescriptor d{fresh.data(), peer_->source_region(), 0, fresh.size()};
  auto again = agent_->read("peer", {&d, 1});
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE(again->wait(Deadline::after_ms(20000)).ok());
  EXPECT_EQ(std::memcmp(fresh.data(), peer_->expected().data(), fresh.size()), 0);
  EXPECT_EQ(changed_bytes(), changed);
}

TEST_F(UcxStalledPeerTest, KilledPeerFailsTheReadAsUnavailable) {
  EXPECT_FALSE(read_->done());
  ASSERT_TRUE(peer_->process().kill(SIGKILL).ok());
  Status s = read_->wait(Deadline::after_ms(30000));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("peer"), std::string::npos) << s.to_string();
  auto c = agent_->call("peer", "{}", Deadline::after_ms(20000));
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
}

TEST(UcxConfigTest, ErrorModeNoneIsRefusedForNetworkTransports) {
  auto config = local_config("consumer");
  config.ucx = {.enable = true, .tls = "tcp", .error_mode = "none"};
  auto agent = Agent::create(config);
  ASSERT_FALSE(agent.ok());
  EXPECT_EQ(agent.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(agent.status().message().find("shared-memory"), std::string::npos);
  config.ucx.error_mode = "sometimes";
  EXPECT_EQ(Agent::create(config).status().code(), StatusCode::kInvalidArgument);
  config.ucx = {.enable = true, .tls = "posix,cma", .error_mode = "none"};
  EXPECT_TRUE(Agent::create(config).ok());
}

class AgentProcessFailure : public ::testing::Test {
 protected:
  // Starts an 8 MiB READ over tcp from a peer that sends 1 MiB of the reply, then hangs.
  void start_stalled_read() {
    auto peer =
        PeerProcess::start(ecx::testing::peer_options(), {.stall_read_after_bytes = 1 << 20});
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_.emplace(std::move(*peer));
    auto cfg = local_config("consumer");
    cfg.tcp_slice_bytes = 8 << 20;  // one slice: the stall is inside it
    agent_ = std::move(Agent::create(cfg).value());
    ASSERT_TRUE(agent_->connect(peer_->metadata(), {.backend = Backend::kTcp}).ok());
    buf_.resize(8 << 20);
    TransferDescriptor d{buf_.data(), peer_->source_region(), 0, buf_.size()};
    auto h = agent_->read("peer", {&d, 1}, Deadline::after_ms(60000));
    ASSERT_TRUE(h.ok());
    read_.emplace(std::move(*h));
  }

  std::optional<PeerProcess> peer_;
  std::unique_ptr<Agent> agent_;
  std::vector<std::byte> buf_;
  std::optional<TransferHandle> read_;
};

TEST_F(AgentProcessFailure, PeerKilledMidTransferFailsWithinTheDeadline) {
  // We kill the stalled peer while we wait.
  ASSERT_NO_FATAL_FAILURE(start_stalled_read());
  EXPECT_FALSE(read_->done());  // stalled, not finished
  ASSERT_TRUE(peer_->process().kill(SIGKILL).ok());
  Status s = read_->wait(Deadline::after_ms(60000));
  // A dead peer is reported as such, not as a timeout.
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("peer"), std::string::npos) << s.to_string();
  // The control channel reports the death too: calls fail, they do not hang.
  auto c = agent_->call("peer", "{}", Deadline::after_ms(20000));
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().to_string();
}

TEST_F(AgentProcessFailure, StalledPeerHitsTheDeadlineAndTheBufferIsLeftAlone) {
  ASSERT_NO_FATAL_FAILURE(start_stalled_read());
  Status s = read_->wait(Deadline::after_ms(300));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.to_string();
  EXPECT_TRUE(read_->done());  // cancelled and drained before wait returned
  // The agent still works for new transfers on a fresh stream.
  TransferDescriptor small{buf_.data(), peer_->source_region(), 0, 4096};
  auto again = agent_->read("peer", {&small, 1});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->wait(Deadline::after_ms(20000)).ok());
  EXPECT_EQ(std::memcmp(buf_.data(), peer_->expected().data(), 4096), 0);
}

TEST_F(AgentProcessFailure, IncompatiblePeerIsRefusedNamingBothHashes) {
  auto options = ecx::testing::peer_options();
  options.compat_hash = "other-model";
  auto peer = PeerProcess::start(options);
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto agent = std::move(Agent::create(local_config("consumer")).value());
  auto r = agent->connect(peer->metadata());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIncompatible);
  EXPECT_NE(r.status().message().find("'other-model'"), std::string::npos);
  EXPECT_NE(r.status().message().find("'ecx'"), std::string::npos);
}

}  // namespace
}  // namespace ecx::transfer
