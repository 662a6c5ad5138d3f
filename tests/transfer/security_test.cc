// The transfer plane's trust boundaries (docs/SECURITY.md), tried the way an attacker or a
// bad day would: a peer without the deployment secret, another local user, a peer that
// passes memory it can shrink, a reader without a grant, too many connections, idle
// connections, and a peer that dies while mapped.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "ecx/transfer/agent.h"
#include "support/peer_process.h"
#include "transfer/connection.h"
#include "transfer/memory.h"
#include "wire/socket.h"
#include "wire/wire.h"

namespace ecx::transfer {
namespace {

using ecx::testing::local_config;
using ecx::testing::PeerProcess;

AgentConfig with_secret(const std::string& name, const std::string& secret) {
  AgentConfig c = local_config(name);
  c.auth_secret = secret;
  return c;
}

bool contains(const Status& s, const std::string& text) {
  return s.message().find(text) != std::string::npos;
}

// Counts this process's threads.
size_t thread_count() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/task");
  while (dirent* e = d ? ::readdir(d) : nullptr) n += e->d_name[0] != '.';
  if (d) ::closedir(d);
  return n;
}

bool mapped(const std::string& name_part) {
  std::ifstream maps("/proc/self/maps");
  std::stringstream ss;
  ss << maps.rdbuf();
  return ss.str().find(name_part) != std::string::npos;
}

// Shakes hands over a raw tcp socket as `name` (with a fresh session), as a peer's
// agent would, and returns the connection for the test to speak frames on.
UniqueFd raw_peer(const Agent& server, const std::string& name) {
  auto address = parse_host_port(server.metadata().endpoint(Backend::kTcp)).value();
  auto fd = connect_tcp(address, Deadline::after_ms(5000));
  EXPECT_TRUE(fd.ok()) << fd.status().to_string();
  if (!fd.ok()) return UniqueFd();
  AgentMetadata me;
  me.name = name;
  me.protocol_version = kProtocolVersion;
  me.compat_hash = "ecx";
  me.session = Capability::random().hex();
  auto peer = client_handshake(fd->get(), me, "", 0, Deadline::after_ms(5000));
  EXPECT_TRUE(peer.ok()) << peer.status().to_string();
  return std::move(*fd);
}

// Waits until `done` holds or the deadline passes (for effects with no event to wait on,
// such as a reaper thread unmapping memory). Returns whether it held.
template <typename F>
bool eventually(F done, Deadline deadline) {
  while (!done()) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// Every agent in these tests also runs the ucx backend (over tcp), so each backend is
// tried the same way.
AgentConfig with_ucx(AgentConfig c) {
  c.ucx = {.enable = true, .tls = "tcp"};
  return c;
}

TEST(Authentication, AgentsWithoutTheSecretCannotConnect) {
  auto server = std::move(Agent::create(with_ucx(with_secret("server", "deployment-1"))).value());
  auto region = server->allocate(4096).value();
  for (Backend b : {Backend::kShm, Backend::kTcp, Backend::kUcx}) {
    auto wrong = std::move(Agent::create(with_ucx(with_secret("wrong", "deployment-2"))).value());
    auto r = wrong->connect(server->metadata(), {.backend = b});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().to_string();
    EXPECT_FALSE(contains(r.status(), "deployment-1")) << r.status().to_string();

    auto none = std::move(Agent::create(with_ucx(local_config("none"))).value());
    auto n = none->connect(server->metadata(), {.backend = b});
    ASSERT_FALSE(n.ok());
    EXPECT_EQ(n.status().code(), StatusCode::kPermissionDenied) << n.status().to_string();

    auto member = std::move(Agent::create(with_ucx(with_secret("member", "deployment-1"))).value());
    ASSERT_TRUE(member->connect(server->metadata(), {.backend = b}).ok());
    std::vector<std::byte> buf(4096);
    TransferDescriptor d{buf.data(), region.id, 0, buf.size()};
    auto h = member->read("server", {&d, 1});
    ASSERT_TRUE(h.ok());
    EXPECT_TRUE(h->wait(Deadline::after_ms(10000)).ok());
  }
  EXPECT_EQ(server->stats().handshakes_rejected, 6u);
}

TEST(Authentication, AServerWithoutTheSecretIsNotTrustedByTheClient) {
  // A listener that squats an endpoint without the secret cannot pose as a producer.
  auto impostor = std::move(Agent::create(local_config("producer")).value());
  auto client = std::move(Agent::create(with_secret("client", "deployment-1")).value());
  auto r = client->connect(impostor->metadata(), {.backend = Backend::kTcp});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().to_string();
}

TEST(Authentication, AgentWithoutASecretListensOnLoopbackOnly) {
  AgentConfig c = local_config("open");
  c.tcp_host = "0.0.0.0";
  auto agent = std::move(Agent::create(c).value());
  EXPECT_EQ(agent->metadata().endpoint(Backend::kTcp).rfind("127.0.0.1:", 0), 0u)
      << agent->metadata().endpoint(Backend::kTcp);
}

TEST(Authentication, AnotherUserCannotReachTheUnixSocket) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another uid";
  auto server = std::move(Agent::create(local_config("server")).value());
  std::string endpoint = server->metadata().endpoint(Backend::kShm);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // As user "nobody": connect to the abstract socket and wait for the CHALLENGE.
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, endpoint.data(), endpoint.size());
    socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + endpoint.size());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) ::_exit(0);  // refused
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buf[64];
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    ::_exit(n > 0 ? 1 : 0);  // 1: the agent talked to another user
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a process of another uid got the agent's challenge";
  EXPECT_GE(server->stats().connections_refused, 1u);
}

TEST(SealedMemory, APeerCannotMapTheArenaWritableNorResizeIt) {
  // The producer is another process; we are the (hostile) same-host peer it hands its
  // memfd to.
  auto peer = PeerProcess::start();
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  auto fd = connect_unix(peer->metadata().endpoint(Backend::kShm), Deadline::after_ms(5000));
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  AgentMetadata me;
  me.name = "hostile";
  me.protocol_version = kProtocolVersion;
  me.compat_hash = "ecx";
  me.session = "0c";
  auto channel = ControlChannel::open(std::move(*fd), true, me, "", Deadline::after_ms(5000), {});
  ASSERT_TRUE(channel.ok()) << channel.status().to_string();
  auto grant = (*channel)->query_region(peer->source_region(), {}, Deadline::after_ms(5000));
  ASSERT_TRUE(grant.ok()) << grant.status().to_string();
  ASSERT_TRUE(grant->memfd.valid());
  int memfd = grant->memfd.get();
  const size_t len = grant->length;
  // Writable mappings, through the passed fd and through a reopened /proc/self/fd/N.
  EXPECT_EQ(::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0), MAP_FAILED);
  std::string path = "/proc/self/fd/" + std::to_string(memfd);
  int reopened = ::open(path.c_str(), O_RDWR);
  if (reopened >= 0) {
    EXPECT_EQ(::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0), MAP_FAILED);
    char byte = 1;
    EXPECT_LT(::pwrite(reopened, &byte, 1, 0), 0);
    EXPECT_NE(::ftruncate(reopened, 0), 0);
    ::close(reopened);
  }
  EXPECT_NE(::ftruncate(memfd, 0), 0);
  EXPECT_NE(::ftruncate(memfd, static_cast<off_t>(len) * 2), 0);
  // Reading works, and the producer's bytes are what it filled.
  void* ro = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, memfd, 0);
  ASSERT_NE(ro, MAP_FAILED);
  EXPECT_EQ(std::memcmp(ro, peer->expected().data(), 4096), 0);
  ::munmap(ro, len);
}

// A fake same-host "agent" that passes a memfd it did not seal, and shrinks it.
class LyingMemfdServer {
 public:
  explicit LyingMemfdServer(int seals) : seals_(seals) {
    listener_ = std::move(listen_unix(name_).value());
    thread_ = std::thread([this] { serve(); });
  }
  ~LyingMemfdServer() {
    ::shutdown(listener_.get(), SHUT_RDWR);
    if (conn_.valid()) ::shutdown(conn_.get(), SHUT_RDWR);
    thread_.join();
  }
  AgentMetadata metadata() const {
    AgentMetadata m = self();
    m.host_id = local_host_id();
    m.endpoints[Backend::kShm] = name_;
    m.regions.push_back({1, kLength, MemoryKind::kHost, false, true});
    return m;
  }

 private:
  static constexpr uint64_t kLength = 1 << 20;
  static AgentMetadata self() {
    AgentMetadata m;
    m.name = "liar";
    m.protocol_version = kProtocolVersion;
    m.compat_hash = "ecx";
    return m;
  }
  void serve() {
    auto fd = accept_connection(listener_.get());
    if (!fd.ok() || !fd->valid()) return;
    conn_ = std::move(*fd);
    if (!server_handshake(conn_.get(), self(), "", Deadline::after_ms(5000)).ok()) return;
    while (true) {
      auto f = recv_frame(conn_.get(), Deadline::after_ms(20000));
      if (!f.ok()) return;
      if (f->header.type != static_cast<uint16_t>(FrameType::kRegionQuery)) continue;
      UniqueFd memfd(::memfd_create("liar", MFD_ALLOW_SEALING));
      if (::ftruncate(memfd.get(), kLength) != 0) return;
      if (seals_ != 0 && ::fcntl(memfd.get(), F_ADD_SEALS, seals_) != 0) return;
      FrameHeader reply;
      reply.type = static_cast<uint16_t>(FrameType::kRegionInfo);
      reply.id = f->header.id;
      reply.region = 1;
      reply.length = kLength;
      reply.flags = kRegionHasFd | kRegionRemoteRead;
      if (!send_with_fd(conn_.get(), &reply, sizeof(reply), memfd.get()).ok()) return;
      if ((seals_ & F_SEAL_SHRINK) == 0) ::ftruncate(memfd.get(), 0);  // pull the rug
    }
  }
  const int seals_;
  const std::string name_ = "ecx-test-liar-" + std::to_string(::getpid());
  UniqueFd listener_;
  UniqueFd conn_;
  std::thread thread_;
};

TEST(SealedMemory, UnsealedOrShrinkableMemoryIsRefusedNotMapped) {
  // No seals (then shrunk), or sealed against shrinking but still writable by the liar.
  for (int seals : {0, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL}) {
    LyingMemfdServer liar(seals);
    auto reader = std::move(Agent::create(local_config("reader")).value());
    ASSERT_TRUE(reader->connect(liar.metadata(), {.backend = Backend::kShm}).ok());
    std::vector<std::byte> buf(1 << 20);
    TransferDescriptor d{buf.data(), 1, 0, buf.size()};
    auto h = reader->read("liar", {&d, 1});
    Status s = h.ok() ? h->wait(Deadline::after_ms(10000)) : h.status();
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
    EXPECT_TRUE(contains(s, "sealed")) << s.to_string();
    auto v = reader->view("liar", 1, 0, 4096);
    EXPECT_EQ(v.status().code(), StatusCode::kPermissionDenied) << v.status().to_string();
  }
  // Still here: no SIGBUS.
}

TEST(Grants, ARegionThatRequiresGrantsIsReadOnlyThroughTheRightCapability) {
  auto server = std::move(Agent::create(with_ucx(local_config("server"))).value());
  auto region = server->allocate(1 << 20, {.remote_read = true, .require_grant = true}).value();
  std::memset(region.data, 0x5a, region.length);
  // ucx: a region behind grants keeps its key out of the metadata (only the right
  // capability gets it); an open region announces it.
  auto open = server->allocate(4096).value();
  for (const auto& r : server->metadata().regions) {
    EXPECT_EQ(r.data_for(Backend::kUcx).empty(), r.id == region.id) << "region " << r.id;
  }
  ASSERT_TRUE(server->deregister(open.id).ok());
  auto mine = server->grant(region.id, 4096, 8192, false, "client").value();
  auto theirs = server->grant(region.id, 4096, 8192, false, "somebody-else").value();
  for (Backend b : {Backend::kTcp, Backend::kShm, Backend::kUcx}) {
    auto client = std::move(Agent::create(with_ucx(local_config("client"))).value());
    ASSERT_TRUE(client->connect(server->metadata(), {.backend = b}).ok());
    std::vector<std::byte> buf(8192);
    auto read = [&](uint64_t offset, uint64_t length, const Capability& cap) {
      TransferDescriptor d{buf.data(), region.id, offset, length, cap};
      auto h = client->read("server", {&d, 1});
      return h.ok() ? h->wait(Deadline::after_ms(10000)) : h.status();
    };
    EXPECT_EQ(read(4096, 8192, {}).code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(read(4096, 8192, Capability::random()).code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(read(4096, 8192, theirs).code(), StatusCode::kPermissionDenied);
    if (b == Backend::kTcp) {
      // Over tcp every request is checked against the grant's range (a same-host peer
      // that holds a grant maps the arena read-only, a ucx peer gets the region's key:
      // see docs/SECURITY.md).
      EXPECT_EQ(read(0, 4096, mine).code(), StatusCode::kPermissionDenied);
      EXPECT_EQ(read(8192, 8192, mine).code(), StatusCode::kPermissionDenied);
    }
    Status ok = read(4096, 8192, mine);
    ASSERT_TRUE(ok.ok()) << ok.to_string();
    EXPECT_EQ(buf[0], std::byte{0x5a});
  }
  server->revoke(mine);
  auto client = std::move(Agent::create(local_config("late")).value());
  ASSERT_TRUE(client->connect(server->metadata(), {.backend = Backend::kTcp}).ok());
  std::vector<std::byte> buf(8192);
  TransferDescriptor d{buf.data(), region.id, 4096, 8192, mine};
  auto h = client->read("server", {&d, 1});
  EXPECT_EQ((h.ok() ? h->wait(Deadline::after_ms(10000)) : h.status()).code(),
            StatusCode::kPermissionDenied);
}

// A new agent's tcp connect to `server`, tried again until it succeeds or `ms` pass (a
// server that refused connections may take a moment to have room again); the last status.
Status connect_within(const Agent& server, int64_t ms) {
  auto client = std::move(Agent::create(local_config("client")).value());
  Status last = Status(StatusCode::kResourceExhausted, "");
  eventually(
      [&] {
        last = client->connect(server.metadata(), {.backend = Backend::kTcp}).status();
        return last.ok();
      },
      Deadline::after_ms(ms));
  return last;
}

TEST(Bounds, ConnectionsOverTheCapAreRefusedWithAClearError) {
  AgentConfig c = local_config("server");
  c.max_connections = 2;
  auto server = std::move(Agent::create(c).value());
  auto address = parse_host_port(server->metadata().endpoint(Backend::kTcp)).value();
  std::vector<UniqueFd> held;
  for (int i = 0; i < 2; ++i) held.push_back(raw_peer(*server, "holder-" + std::to_string(i)));
  auto third = connect_tcp(address, Deadline::after_ms(5000));
  ASSERT_TRUE(third.ok());
  auto refused = recv_frame(third->get(), Deadline::after_ms(5000));
  ASSERT_TRUE(refused.ok()) << refused.status().to_string();
  EXPECT_EQ(refused->header.type, static_cast<uint16_t>(FrameType::kError));
  EXPECT_EQ(refused->header.status, static_cast<uint32_t>(StatusCode::kResourceExhausted));
  EXPECT_EQ(server->stats().connections_refused, 1u);
  held.clear();  // once they go, others are served again
  Status again = connect_within(*server, 10000);
  ASSERT_TRUE(again.ok()) << again.to_string();
}

// The server answers the data frames its backends serve, and no other: a region query is
// shm's (the memfd) and ucx's (the rkey), so an agent with neither refuses it, names it,
// and closes the connection; with shm on, the same query is answered.
TEST(Bounds, AServerAnswersOnlyTheDataFramesItsBackendsServe) {
  for (bool shm : {false, true}) {
    AgentConfig c = local_config(shm ? "with-shm" : "tcp-only");
    c.enable_shm = shm;
    auto server = std::move(Agent::create(c).value());
    auto region = server->allocate(4096).value();
    UniqueFd fd = raw_peer(*server, "asker");
    ASSERT_TRUE(fd.valid());
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kRegionQuery);
    h.id = 7;
    h.region = region.id;
    ASSERT_TRUE(send_frame(fd.get(), h, std::string(), Deadline::after_ms(5000)).ok());
    auto reply = recv_frame(fd.get(), Deadline::after_ms(5000));
    ASSERT_TRUE(reply.ok()) << reply.status().to_string();
    EXPECT_EQ(reply->header.id, 7u);
    if (shm) {
      EXPECT_EQ(reply->header.type, static_cast<uint16_t>(FrameType::kRegionInfo));
      EXPECT_EQ(reply->header.length, 4096u);
      continue;
    }
    ASSERT_EQ(reply->header.type, static_cast<uint16_t>(FrameType::kError));
    Status refused = status_from_error_frame(*reply);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.to_string();
    EXPECT_TRUE(contains(refused, "unexpected frame")) << refused.to_string();
    EXPECT_FALSE(recv_frame(fd.get(), Deadline::after_ms(5000)).ok())
        << "the connection stays open";
    EXPECT_GE(server->stats().rejected_requests, 1u);
  }
}

TEST(Bounds, AnIdleConnectionIsClosedAfterTheHandshake) {
  AgentConfig c = local_config("server");
  c.idle_timeout_ms = 200;
  auto server = std::move(Agent::create(c).value());
  auto address = parse_host_port(server->metadata().endpoint(Backend::kTcp)).value();
  auto fd = connect_tcp(address, Deadline::after_ms(5000));
  ASSERT_TRUE(fd.ok());
  AgentMetadata me;
  me.name = "sleeper";
  me.protocol_version = kProtocolVersion;
  me.compat_hash = "ecx";
  me.session = "0b";
  ASSERT_TRUE(client_handshake(fd->get(), me, "", 0, Deadline::after_ms(5000)).ok());
  // Nothing sent: the server closes; recv sees EOF well before this deadline.
  auto f = recv_frame(fd->get(), Deadline::after_ms(10000));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnavailable) << f.status().to_string();
}

TEST(Bounds, ADeadPeersThreadsFdsAndMappingsAreReclaimed) {
  auto consumer = std::move(Agent::create(local_config("consumer")).value());
  const size_t threads_before = thread_count();
  for (int round = 0; round < 3; ++round) {
    auto o = ecx::testing::peer_options();
    o.name = "dying-" + std::to_string(round);
    auto peer = PeerProcess::start(o);
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    ASSERT_TRUE(consumer->connect(peer->metadata(), {.backend = Backend::kShm}).ok());
    std::vector<std::byte> buf(4096);
    TransferDescriptor d{buf.data(), peer->source_region(), 0, buf.size()};
    auto h = consumer->read(o.name, {&d, 1});
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(h->wait(Deadline::after_ms(10000)).ok());
    ASSERT_TRUE(mapped("ecx:" + o.name));
    ASSERT_TRUE(peer->process().kill(SIGKILL).ok());
    EXPECT_TRUE(eventually([&] { return !mapped("ecx:" + o.name); }, Deadline::after_ms(10000)))
        << "the dead peer's arena is still mapped";
  }
  EXPECT_TRUE(
      eventually([&] { return thread_count() <= threads_before; }, Deadline::after_ms(10000)))
      << thread_count() << " threads, " << threads_before << " before";
}

TEST(Bounds, AHeaderCannotMakeTheServerAllocateWhatItAnnounces) {
  auto server = std::move(Agent::create(local_config("server")).value());
  auto address = parse_host_port(server->metadata().endpoint(Backend::kTcp)).value();
  auto fd = connect_tcp(address, Deadline::after_ms(5000));
  ASSERT_TRUE(fd.ok());
  // Before the handshake only HELLO is accepted, and at most 1 MiB of it.
  ASSERT_TRUE(recv_frame(fd->get(), Deadline::after_ms(5000)).ok());  // CHALLENGE
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kHello);
  h.payload_length = kMaxHelloPayload + 1;
  ASSERT_TRUE(send_all(fd->get(), &h, sizeof(h), Deadline::after_ms(5000), "header").ok());
  auto r = recv_frame(fd->get(), Deadline::after_ms(5000));
  // Refused from the header alone (closed; possibly after an error frame).
  if (r.ok()) {
    EXPECT_EQ(r->header.type, static_cast<uint16_t>(FrameType::kError));
  }
  char c;
  EXPECT_LE(::recv(fd->get(), &c, 1, 0), 0);
}

TEST(Bounds, StalledHandshakesDoNotKeepTheDeploymentsAgentsOut) {
  AgentConfig c = local_config("server");
  c.max_handshakes = 4;
  auto server = std::move(Agent::create(c).value());
  auto address = parse_host_port(server->metadata().endpoint(Backend::kTcp)).value();
  // 3 times the handshake slots in connections that take the challenge and never answer
  // (each would hold its slot for the 10 s hello timeout).
  std::vector<UniqueFd> stalled;
  for (int i = 0; i < 12; ++i) {
    auto fd = connect_tcp(address, Deadline::after_ms(5000));
    ASSERT_TRUE(fd.ok());
    stalled.push_back(std::move(*fd));
  }
  // A real agent still gets in, within a deadline shorter than the hello timeout: the
  // oldest stalled handshakes were cut to make room for it.
  auto client = std::move(Agent::create(local_config("client")).value());
  Status s = client
                 ->connect(server->metadata(),
                           {.backend = Backend::kTcp, .deadline = Deadline::after_ms(5000)})
                 .status();
  EXPECT_TRUE(s.ok()) << s.to_string();
  EXPECT_GE(server->stats().connections_refused, 8u);
}

TEST(Bounds, APeerThatStopsReadingLosesItsConnectionNotAServerThread) {
  AgentConfig c = local_config("server");
  c.max_connections = 1;
  c.data_timeout_ms = 300;
  auto server = std::move(Agent::create(c).value());
  auto region = server->allocate(8 << 20, {.remote_read = true}).value();
  UniqueFd greedy = raw_peer(*server, "greedy");
  // Pipelined READs of 8 MiB each, and never a byte read back: the server's send fills
  // the socket buffers and blocks.
  for (uint64_t i = 0; i < 8; ++i) {
    FrameHeader h;
    h.type = static_cast<uint16_t>(FrameType::kRead);
    h.id = i;
    h.region = region.id;
    h.length = region.length;
    ASSERT_TRUE(send_frame(greedy.get(), h, std::string(), Deadline::after_ms(5000)).ok());
  }
  // The only connection slot frees once the send deadline cuts the greedy peer off, long
  // before its 60 s idle timeout.
  Status again = connect_within(*server, 20000);
  EXPECT_TRUE(again.ok()) << again.to_string();
}

TEST(Grants, NoByteOfAWriteLandsInAWindowAfterItIsRevoked) {
  auto server = std::move(Agent::create(local_config("consumer")).value());
  constexpr uint64_t kWindow = 1 << 20;
  auto region = server->allocate(kWindow, {.remote_write = true, .require_grant = true}).value();
  auto window = server->grant(region.id, 0, kWindow, /*write=*/true, "producer").value();
  UniqueFd producer = raw_peer(*server, "producer");
  // A lying producer starts its WRITE, sends half, and stalls.
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kWrite);
  h.region = region.id;
  h.length = kWindow;
  std::string cap(reinterpret_cast<const char*>(window.bytes.data()), window.bytes.size());
  ASSERT_TRUE(send_frame(producer.get(), h, cap, Deadline::after_ms(5000)).ok());
  std::vector<char> half(kWindow / 2, 'X');
  ASSERT_TRUE(
      send_all(producer.get(), half.data(), half.size(), Deadline::after_ms(5000), "data").ok());
  auto* bytes = reinterpret_cast<const char*>(region.data);
  // Until the server has taken the header and is receiving into the window (the case
  // under test): its first byte is then 'X'. Looked at through the kernel
  // (process_vm_readv), not by loads that would race with the server's receive.
  auto first_byte = [&] {
    char c = 0;
    iovec local{&c, 1};
    iovec remote{const_cast<char*>(bytes), 1};
    return ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0) == 1 ? c : '\0';
  };
  EXPECT_TRUE(eventually([&] { return first_byte() == 'X'; }, Deadline::after_ms(5000)));
  // The consumer gives up on the load and revokes the window; then another image's bytes
  // go into the block.
  server->revoke(window);
  std::memset(region.data, 'Y', kWindow);
  // The producer sends the rest: none of it lands, and it gets no WRITE_ACK.
  send_all(producer.get(), half.data(), half.size(), Deadline::after_ms(2000), "data")
      .ignore_error();
  auto ack = recv_frame(producer.get(), Deadline::after_ms(5000));
  EXPECT_FALSE(ack.ok() && ack->header.type == static_cast<uint16_t>(FrameType::kWriteAck));
  // Every serving thread joined: none can write into the window after this point, so what
  // the window holds now is all that ever landed.
  server->shutdown();
  for (uint64_t i = 0; i < kWindow; i += 4096) ASSERT_EQ(bytes[i], 'Y') << "offset " << i;
  EXPECT_EQ(bytes[kWindow - 1], 'Y');
}

TEST(Identity, APeerThatDeclaresAnotherAgentsNameCannotEndWhatThatAgentHolds) {
  // Declared before the server: its threads call the handlers until it is destroyed.
  std::mutex mu;
  std::vector<std::string> callers, gone;
  auto server = std::move(Agent::create(local_config("producer")).value());
  server->set_call_handler([&](const Caller& caller, std::string_view) -> Result<std::string> {
    std::lock_guard lock(mu);
    callers.push_back(caller.holder);
    return std::string("ok");
  });
  server->set_peer_gone_handler([&](const std::string& holder) {
    std::lock_guard lock(mu);
    gone.push_back(holder);
  });
  auto real = std::move(Agent::create(local_config("consumer")).value());
  auto impostor = std::move(Agent::create(local_config("consumer")).value());
  auto params = std::move(Agent::create(local_config("params")).value());
  for (Agent* a : {real.get(), impostor.get(), params.get()}) {
    ASSERT_TRUE(a->connect(server->metadata(), {.backend = Backend::kTcp}).ok());
    ASSERT_TRUE(a->call("producer", "hello", Deadline::after_ms(10000)).ok());
  }
  std::string real_holder, impostor_holder;
  {
    std::lock_guard lock(mu);
    ASSERT_EQ(callers.size(), 3u);
    real_holder = callers[0];
    impostor_holder = callers[1];
  }
  // Same declared name, two identities; and "params" is not the holder of params' pins.
  EXPECT_EQ(real_holder.rfind("consumer#", 0), 0u) << real_holder;
  EXPECT_NE(real_holder, impostor_holder);
  EXPECT_NE(callers[2], "params");
  impostor->shutdown();
  params->shutdown();
  ASSERT_TRUE(eventually(
      [&] {
        std::lock_guard lock(mu);
        return gone.size() >= 2;
      },
      Deadline::after_ms(10000)));
  std::lock_guard lock(mu);
  for (const auto& g : gone) {
    EXPECT_NE(g, real_holder);
    EXPECT_NE(g, "params");
  }
}

TEST(Identity, UnixSocketNamesCannotBeGuessed) {
  auto a = std::move(Agent::create(local_config("guess")).value());
  auto b = std::move(Agent::create(local_config("guess")).value());
  std::string ea = a->metadata().endpoint(Backend::kShm),
              eb = b->metadata().endpoint(Backend::kShm);
  ASSERT_FALSE(ea.empty());
  // No pid and no counter: 32 random hex digits after the name.
  EXPECT_EQ(ea.find(std::to_string(::getpid())), std::string::npos) << ea;
  EXPECT_EQ(ea.size(), std::string("ecx-guess-").size() + 32) << ea;
  EXPECT_NE(ea.substr(10), eb.substr(10));
}

}  // namespace
}  // namespace ecx::transfer
