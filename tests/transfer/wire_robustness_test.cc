// A hostile or broken client speaking to an agent's TCP port directly: the agent must
// answer with an error or close, count it, and keep serving everyone else.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstring>

#include "ecx/transfer/agent.h"
#include "support/peer_process.h"
#include "transfer/connection.h"
#include "wire/socket.h"
#include "wire/wire.h"

namespace ecx::transfer {
namespace {

using ecx::testing::local_config;

constexpr uint16_t wire_type(FrameType type) { return static_cast<uint16_t>(type); }

class WireRobustnessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::move(Agent::create(local_config("server")).value());
    region_ = server_->allocate(1 << 20, {.remote_read = true, .remote_write = true}).value();
    address_ = parse_host_port(server_->metadata().endpoint(Backend::kTcp)).value();
  }

  UniqueFd raw_connect() {
    auto fd = connect_tcp(address_, Deadline::after_ms(5000));
    EXPECT_TRUE(fd.ok());
    return fd.ok() ? std::move(*fd) : UniqueFd();
  }

  // Shakes hands as a compatible client (the same, deployment-less secret).
  void hello(int fd) {
    AgentMetadata me;
    me.name = "raw-client";
    me.protocol_version = kProtocolVersion;
    me.compat_hash = "ecx";
    me.session = "0a";
    auto peer = client_handshake(fd, me, "", 0, Deadline::after_ms(5000));
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  }

  // The server speaks first: its CHALLENGE.
  void expect_challenge(int fd) {
    auto c = recv_frame(fd, Deadline::after_ms(5000));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ASSERT_EQ(c->header.type, static_cast<uint16_t>(FrameType::kChallenge));
  }

  // The server's answer, which must be an ERROR frame; stored in `error` if given.
  void expect_error(int fd, Frame* error = nullptr) {
    auto r = recv_frame(fd, Deadline::after_ms(10000));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->header.type, static_cast<uint16_t>(FrameType::kError));
    if (error != nullptr) *error = std::move(*r);
  }

  // The server still serves a well-behaved agent.
  void expect_still_serving() {
    auto client = std::move(Agent::create(local_config("client")).value());
    ASSERT_TRUE(client->connect(server_->metadata(), {.backend = Backend::kTcp}).ok());
    std::vector<std::byte> buf(4096);
    TransferDescriptor d{buf.data(), region_.id, 0, buf.size()};
    auto h = client->read("server", {&d, 1});
    ASSERT_TRUE(h.ok());
    EXPECT_TRUE(h->wait(Deadline::after_ms(10000)).ok());
  }

  std::unique_ptr<Agent> server_;
  LocalRegion region_;
  HostPort address_;
};

TEST_F(WireRobustnessTest, GarbageBytesCloseTheConnection) {
  UniqueFd fd = raw_connect();
  std::string junk(100, 'x');
  expect_challenge(fd.get());
  ASSERT_TRUE(send_all(fd.get(), junk.data(), junk.size(), Deadline::after_ms(5000), "junk").ok());
  char c;
  // The server closes on a bad HELLO: recv sees EOF (after a possible error frame).
  auto r = recv_frame(fd.get(), Deadline::after_ms(10000));
  if (r.ok()) {
    EXPECT_EQ(r->header.type, static_cast<uint16_t>(FrameType::kError));
  }
  EXPECT_LE(::recv(fd.get(), &c, 1, 0), 0);
  expect_still_serving();
}

TEST_F(WireRobustnessTest, ReadBeforeHelloIsRefused) {
  UniqueFd fd = raw_connect();
  FrameHeader h{.type = wire_type(FrameType::kRead), .region = region_.id, .length = 16};
  expect_challenge(fd.get());
  ASSERT_TRUE(send_frame(fd.get(), h, "", Deadline::after_ms(5000)).ok());
  ASSERT_NO_FATAL_FAILURE(expect_error(fd.get()));
  EXPECT_EQ(server_->stats().handshakes_rejected, 1u);
  expect_still_serving();
}

TEST_F(WireRobustnessTest, OversizedPayloadIsRefusedWithoutAllocating) {
  UniqueFd fd = raw_connect();
  hello(fd.get());
  FrameHeader h{.magic = kFrameMagic,
                .type = wire_type(FrameType::kCall),
                .payload_length = 0xFFFFFFF0u};  // 4 GiB claimed, never sent
  ASSERT_TRUE(send_all(fd.get(), &h, sizeof(h), Deadline::after_ms(5000), "header").ok());
  Frame error;
  ASSERT_NO_FATAL_FAILURE(expect_error(fd.get(), &error));
  EXPECT_NE(error.payload.find("exceeds the limit"), std::string::npos) << error.payload;
  EXPECT_GE(server_->stats().rejected_requests, 1u);
  expect_still_serving();
}

TEST_F(WireRobustnessTest, BadReadAndWriteAreAnsweredAndTheStreamStaysInSync) {
  UniqueFd fd = raw_connect();
  hello(fd.get());
  // READ past the end of the region.
  FrameHeader read{.type = wire_type(FrameType::kRead),
                   .region = region_.id,
                   .id = 1,
                   .offset = (1 << 20) - 4,
                   .length = 8};
  ASSERT_TRUE(send_frame(fd.get(), read, "", Deadline::after_ms(5000)).ok());
  Frame r1;
  ASSERT_NO_FATAL_FAILURE(expect_error(fd.get(), &r1));
  EXPECT_EQ(r1.header.status, static_cast<uint32_t>(StatusCode::kOutOfRange));
  // WRITE to an unknown region, with its data: drained, answered.
  FrameHeader write{.type = wire_type(FrameType::kWrite), .region = 4242, .id = 2, .length = 1000};
  std::string data(1000, 'd');
  ASSERT_TRUE(send_frame(fd.get(), write, "", Deadline::after_ms(5000)).ok());
  ASSERT_TRUE(send_all(fd.get(), data.data(), data.size(), Deadline::after_ms(5000), "data").ok());
  auto r2 = recv_frame(fd.get(), Deadline::after_ms(10000));
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->header.status, static_cast<uint32_t>(StatusCode::kNotFound));
  EXPECT_EQ(r2->header.id, 2u);
  // A valid READ on the same connection still works: the stream is in sync.
  std::memset(region_.data, 0x42, 8);
  read.id = 3;
  read.offset = 0;
  ASSERT_TRUE(send_frame(fd.get(), read, "", Deadline::after_ms(5000)).ok());
  auto r3 = recv_frame(fd.get(), Deadline::after_ms(10000));
  ASSERT_TRUE(r3.ok());
  ASSERT_EQ(r3->header.type, static_cast<uint16_t>(FrameType::kReadData));
  char bytes[8];
  ASSERT_TRUE(recv_all(fd.get(), bytes, 8, Deadline::after_ms(10000), "data").ok());
  EXPECT_EQ(bytes[0], 0x42);
  EXPECT_EQ(server_->stats().rejected_requests, 2u);
}

}  // namespace
}  // namespace ecx::transfer
