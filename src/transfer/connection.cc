#include "transfer/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ecx/common/auth.h"
#include "ecx/common/log.h"
#include "wire/wire.h"

namespace ecx::transfer {

Status check_compatible(const AgentMetadata& self, const AgentMetadata& peer) {
  if (peer.protocol_version != kProtocolVersion) {
    return Status(StatusCode::kVersionMismatch,
                  "agent '" + peer.name + "' speaks protocol version " +
                      std::to_string(peer.protocol_version) + ", agent '" + self.name +
                      "' speaks " + std::to_string(kProtocolVersion));
  }
  if (peer.compat_hash != self.compat_hash) {
    return Status(StatusCode::kIncompatible, "compatibility hash mismatch: agent '" + self.name +
                                                 "' has '" + self.compat_hash + "', agent '" +
                                                 peer.name + "' has '" + peer.compat_hash + "'");
  }
  return Status::Ok();
}

namespace {

// One turn of a polling loop: the CPU's spin hint, which leaves the core's other hardware
// thread its share.
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

Mac client_proof(const std::string& secret, std::string_view server_nonce,
                 std::string_view client_nonce, std::string_view metadata) {
  return hmac_sha256(secret, {"ecx-hello-client", server_nonce, client_nonce, metadata});
}

Mac server_proof(const std::string& secret, std::string_view server_nonce,
                 std::string_view client_nonce, std::string_view metadata) {
  return hmac_sha256(secret, {"ecx-hello-server", server_nonce, client_nonce, metadata});
}

Mac mac_from(std::string_view bytes) {
  Mac mac{};
  std::memcpy(mac.data(), bytes.data(), mac.size());
  return mac;
}

std::string_view as_view(const Mac& mac) {
  return {reinterpret_cast<const char*>(mac.data()), mac.size()};
}

}  // namespace

Result<AgentMetadata> client_handshake(int fd, const AgentMetadata& self, const std::string& secret,
                                       uint16_t flags, Deadline deadline) {
  // An ERROR (a full server, a refused uid) may come instead of the challenge.
  ECX_ASSIGN_OR_RETURN(Frame challenge, recv_frame(fd, deadline, nullptr, 8192));
  if (challenge.header.type == static_cast<uint16_t>(FrameType::kError)) {
    return status_from_error_frame(challenge);
  }
  if (challenge.header.type != static_cast<uint16_t>(FrameType::kChallenge) ||
      challenge.payload.size() != kNonceBytes) {
    return InvalidArgument(std::string("handshake: expected CHALLENGE, got ") +
                           frame_type_name(challenge.header.type) + " (not an ecx v" +
                           std::to_string(kProtocolVersion) + " agent?)");
  }
  const std::string client_nonce = random_bytes(kNonceBytes);
  const std::string metadata = self.to_json();
  Mac proof = client_proof(secret, challenge.payload, client_nonce, metadata);
  FrameHeader hello;
  hello.type = static_cast<uint16_t>(FrameType::kHello);
  hello.flags = flags;
  ECX_RETURN_IF_ERROR(
      send_frame(fd, hello, client_nonce + std::string(as_view(proof)) + metadata, deadline));
  ECX_ASSIGN_OR_RETURN(Frame reply, recv_frame(fd, deadline, nullptr, kMaxHelloPayload));
  if (reply.header.type == static_cast<uint16_t>(FrameType::kError)) {
    return status_from_error_frame(reply);
  }
  if (reply.header.type != static_cast<uint16_t>(FrameType::kHelloOk) ||
      reply.payload.size() < sizeof(Mac)) {
    return InvalidArgument(std::string("handshake: expected HELLO_OK, got ") +
                           frame_type_name(reply.header.type));
  }
  std::string_view peer_metadata = std::string_view(reply.payload).substr(sizeof(Mac));
  Mac expected = server_proof(secret, challenge.payload, client_nonce, peer_metadata);
  if (!macs_equal(expected, mac_from(reply.payload))) {
    return PermissionDenied(
        "handshake: the peer could not prove it holds this deployment's secret");
  }
  ECX_ASSIGN_OR_RETURN(AgentMetadata peer, AgentMetadata::parse(peer_metadata));
  ECX_RETURN_IF_ERROR(check_compatible(self, peer));
  return peer;
}

Result<AcceptedPeer> server_handshake(int fd, const AgentMetadata& self, const std::string& secret,
                                      Deadline deadline, std::atomic<uint64_t>* refused,
                                      const std::function<Status()>& admit) {
  const std::string server_nonce = random_bytes(kNonceBytes);
  FrameHeader challenge;
  challenge.type = static_cast<uint16_t>(FrameType::kChallenge);
  ECX_RETURN_IF_ERROR(send_frame(fd, challenge, server_nonce, deadline));
  ECX_ASSIGN_OR_RETURN(Frame hello, recv_frame(fd, deadline, nullptr, kMaxHelloPayload));
  const FrameHeader& h = hello.header;
  auto refuse = [&](const Status& why) {
    if (refused != nullptr) (*refused)++;
    send_error(fd, h.id, why).ignore_error();
    return why;
  };
  if (h.type != static_cast<uint16_t>(FrameType::kHello) ||
      hello.payload.size() < kNonceBytes + sizeof(Mac)) {
    return refuse(InvalidArgument("expected HELLO as the first frame"));
  }
  std::string_view payload = hello.payload;
  std::string_view client_nonce = payload.substr(0, kNonceBytes);
  std::string_view metadata = payload.substr(kNonceBytes + sizeof(Mac));
  Mac expected = client_proof(secret, server_nonce, client_nonce, metadata);
  if (!macs_equal(expected, mac_from(payload.substr(kNonceBytes)))) {
    return refuse(PermissionDenied("authentication failed: agent '" + self.name +
                                   "' does not accept this peer's proof of the deployment secret"));
  }
  auto peer = AgentMetadata::parse(metadata);
  if (!peer.ok()) return refuse(peer.status());
  if (peer->session.empty()) {
    return refuse(InvalidArgument("HELLO of agent '" + peer->name + "' names no session"));
  }
  if (peer->protocol_version != kProtocolVersion) {
    return refuse(check_compatible(self, *peer));
  }
  if (peer->compat_hash != self.compat_hash) {
    // The log gets both hashes; the peer learns only that its own was refused.
    spdlog::warn("agent {}: {}", self.name, check_compatible(self, *peer).to_string());
    return refuse(Status(StatusCode::kIncompatible, "agent '" + self.name +
                                                        "' does not accept compatibility hash '" +
                                                        peer->compat_hash + "'"));
  }
  if (admit) {
    if (Status admitted = admit(); !admitted.ok()) {
      send_error(fd, h.id, admitted).ignore_error();
      return admitted;
    }
  }
  const std::string own = self.to_json();
  Mac proof = server_proof(secret, server_nonce, client_nonce, own);
  FrameHeader ok;
  ok.type = static_cast<uint16_t>(FrameType::kHelloOk);
  ok.id = h.id;
  ECX_RETURN_IF_ERROR(send_frame(fd, ok, std::string(as_view(proof)) + own, deadline));
  return AcceptedPeer{std::move(*peer), h.flags};
}

Result<std::unique_ptr<ControlChannel>> ControlChannel::open(
    UniqueFd fd, bool unix_socket, const AgentMetadata& self, const std::string& secret,
    Deadline deadline, DeathHandler on_death, std::chrono::microseconds reply_spin) {
  ECX_ASSIGN_OR_RETURN(AgentMetadata peer, client_handshake(fd.get(), self, secret, 0, deadline));
  return std::unique_ptr<ControlChannel>(new ControlChannel(
      std::move(fd), unix_socket, std::move(peer), std::move(on_death), reply_spin));
}

ControlChannel::ControlChannel(UniqueFd fd, bool unix_socket, AgentMetadata peer,
                               DeathHandler on_death, std::chrono::microseconds reply_spin)
    : fd_(std::move(fd)),
      unix_socket_(unix_socket),
      peer_(std::move(peer)),
      on_death_(std::move(on_death)),
      reply_spin_(reply_spin) {
  reader_ = std::thread([this] { reader_loop(); });
}

ControlChannel::~ControlChannel() {
  close();
  if (reader_.joinable()) reader_.join();
}

void ControlChannel::close() {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

bool ControlChannel::alive_now() const {
  if (!alive()) return false;
  pollfd p{fd_.get(), POLLRDHUP, 0};
  return !(::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)));
}

Status ControlChannel::death_status() const {
  MutexLock lock(&mu_);
  if (alive()) {
    return Unavailable("connection to agent '" + peer_.name + "' lost: peer hung up");
  }
  return death_;
}

void ControlChannel::reader_loop() {
  Status reason;
  while (true) {
    UniqueFd passed;
    auto frame = recv_frame(fd_.get(), Deadline::never(), unix_socket_ ? &passed : nullptr);
    if (!frame.ok()) {
      reason =
          Unavailable("connection to agent '" + peer_.name + "' lost: " + frame.status().message());
      break;
    }
    const FrameHeader& h = frame->header;
    if (!is_reply(h.type)) {
      reason = Unavailable("connection to agent '" + peer_.name + "' dropped: unexpected " +
                           frame_type_name(h.type) + " frame from it");
      break;
    }
    MutexLock lock(&mu_);
    auto it = pending_.find(h.id);
    if (it == pending_.end()) continue;  // reply to a request that timed out
    Pending& p = it->second;
    p.done = true;
    p.length = h.length;
    p.flags = h.flags;
    p.fd = std::move(passed);
    if (h.type == static_cast<uint16_t>(FrameType::kError)) {
      p.status = status_from_error_frame(*frame);
    } else {
      p.payload = std::move(frame->payload);
    }
    replies_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }
  {
    MutexLock lock(&mu_);
    death_ = reason;
    alive_.store(false, std::memory_order_release);
    for (auto& [id, p] : pending_) {
      if (!p.done) {
        p.done = true;
        p.status = reason;
      }
    }
    replies_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  if (on_death_) on_death_(reason);
}

Result<ControlChannel::Pending> ControlChannel::request(uint16_t type, uint32_t region,
                                                        const std::string& payload,
                                                        Deadline deadline, uint16_t flags) {
  uint64_t id = next_id_.fetch_add(1);
  const uint64_t seen = replies_.load(std::memory_order_acquire);
  {
    MutexLock lock(&mu_);
    if (!alive()) return death_;
    pending_.emplace(id, Pending{});
  }
  FrameHeader h;
  h.type = type;
  h.flags = flags;
  h.id = id;
  h.region = region;
  Status sent;
  {
    MutexLock lock(&send_mu_);
    sent = send_frame(fd_.get(), h, payload, deadline);
  }
  if (sent.ok()) poll_for_reply(id, seen, deadline);
  MutexLock lock(&mu_);
  if (!sent.ok()) {
    pending_.erase(id);
    return sent.with_context(std::string(frame_type_name(type)) + " to agent '" + peer_.name + "'");
  }
  bool done = cv_.wait_until(&mu_, deadline.time_point(),
                             [&]() ECX_REQUIRES(mu_) { return pending_[id].done; });
  Pending p = std::move(pending_[id]);
  pending_.erase(id);
  if (!done) {
    return DeadlineExceeded(std::string(frame_type_name(type)) + " to agent '" + peer_.name +
                            "': no reply before the deadline");
  }
  if (!p.status.ok()) return p.status;
  return p;
}

void ControlChannel::poll_for_reply(uint64_t id, uint64_t seen, Deadline deadline) {
  if (reply_spin_.count() <= 0) return;
  const Clock::time_point until = std::min(Clock::now() + reply_spin_, deadline.time_point());
  while (Clock::now() < until) {
    const uint64_t now_seen = replies_.load(std::memory_order_acquire);
    if (now_seen != seen) {
      MutexLock lock(&mu_);
      if (pending_[id].done) return;
      seen = now_seen;  // another caller's reply
    }
    cpu_relax();
  }
}

Result<std::string> ControlChannel::call(const std::string& request_body, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(Pending p,
                       request(static_cast<uint16_t>(FrameType::kCall), 0, request_body, deadline));
  return std::move(p.payload);
}

Status ControlChannel::notify(const std::string& message) {
  if (!alive()) return death_status();
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kNotify);
  MutexLock lock(&send_mu_);
  return send_frame(fd_.get(), h, message, Deadline::after_ms(10000))
      .with_context("notify agent '" + peer_.name + "'");
}

bool ControlChannel::is_reply(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kCallReply:
    case FrameType::kRegionInfo:
    case FrameType::kError:
      return true;
    default:
      return false;
  }
}

Result<RegionGrant> ControlChannel::query_region(uint32_t region, const Capability& capability,
                                                 Deadline deadline,
                                                 std::optional<Backend> backend_data) {
  std::string payload;
  if (!capability.empty()) {
    payload.assign(reinterpret_cast<const char*>(capability.bytes.data()), capability.bytes.size());
  }
  ECX_ASSIGN_OR_RETURN(
      Pending p, request(static_cast<uint16_t>(FrameType::kRegionQuery), region, payload, deadline,
                         backend_data ? region_query_flags(*backend_data) : uint16_t{0}));
  RegionGrant grant;
  grant.length = p.length;
  grant.remote_write = (p.flags & kRegionRemoteWrite) != 0;
  grant.remote_read = (p.flags & kRegionRemoteRead) != 0;
  grant.memfd = std::move(p.fd);
  grant.backend_data = std::move(p.payload);
  return grant;
}

}  // namespace ecx::transfer
