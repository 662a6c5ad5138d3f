#include "transfer/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include "transfer/wire.h"

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

Result<AgentMetadata> client_handshake(int fd, const AgentMetadata& self, uint16_t flags,
                                       Deadline deadline) {
  FrameHeader hello;
  hello.type = static_cast<uint16_t>(FrameType::kHello);
  hello.flags = flags;
  ECX_RETURN_IF_ERROR(send_frame(fd, hello, self.to_json(), deadline));
  ECX_ASSIGN_OR_RETURN(Frame reply, recv_frame(fd, deadline));
  if (reply.header.type == static_cast<uint16_t>(FrameType::kError)) {
    return status_from_error_frame(reply);
  }
  if (reply.header.type != static_cast<uint16_t>(FrameType::kHelloOk)) {
    return InvalidArgument(std::string("handshake: expected HELLO_OK, got ") +
                           frame_type_name(reply.header.type));
  }
  ECX_ASSIGN_OR_RETURN(AgentMetadata peer, AgentMetadata::parse(reply.payload));
  ECX_RETURN_IF_ERROR(check_compatible(self, peer));
  return peer;
}

Result<std::unique_ptr<ControlChannel>> ControlChannel::open(UniqueFd fd, bool unix_socket,
                                                             const AgentMetadata& self,
                                                             Deadline deadline,
                                                             DeathHandler on_death) {
  ECX_ASSIGN_OR_RETURN(AgentMetadata peer, client_handshake(fd.get(), self, 0, deadline));
  return std::unique_ptr<ControlChannel>(
      new ControlChannel(std::move(fd), unix_socket, std::move(peer), std::move(on_death)));
}

ControlChannel::ControlChannel(UniqueFd fd, bool unix_socket, AgentMetadata peer,
                               DeathHandler on_death)
    : fd_(std::move(fd)),
      unix_socket_(unix_socket),
      peer_(std::move(peer)),
      on_death_(std::move(on_death)) {
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
  std::lock_guard lock(mu_);
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
    std::lock_guard lock(mu_);
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
    cv_.notify_all();
  }
  {
    std::lock_guard lock(mu_);
    death_ = reason;
    alive_.store(false, std::memory_order_release);
    for (auto& [id, p] : pending_) {
      if (!p.done) {
        p.done = true;
        p.status = reason;
      }
    }
  }
  cv_.notify_all();
  if (on_death_) on_death_(reason);
}

Result<ControlChannel::Pending> ControlChannel::request(uint16_t type, uint32_t region,
                                                        const std::string& payload,
                                                        Deadline deadline) {
  uint64_t id = next_id_.fetch_add(1);
  {
    std::lock_guard lock(mu_);
    if (!alive()) return death_;
    pending_.emplace(id, Pending{});
  }
  FrameHeader h;
  h.type = type;
  h.id = id;
  h.region = region;
  Status sent;
  {
    std::lock_guard lock(send_mu_);
    sent = send_frame(fd_.get(), h, payload, deadline);
  }
  std::unique_lock lock(mu_);
  if (!sent.ok()) {
    pending_.erase(id);
    return sent.with_context(std::string(frame_type_name(type)) + " to agent '" + peer_.name + "'");
  }
  bool done = cv_.wait_until(lock, deadline.time_point(), [&] { return pending_[id].done; });
  Pending p = std::move(pending_[id]);
  pending_.erase(id);
  if (!done) {
    return DeadlineExceeded(std::string(frame_type_name(type)) + " to agent '" + peer_.name +
                            "': no reply before the deadline");
  }
  if (!p.status.ok()) return p.status;
  return p;
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
  std::lock_guard lock(send_mu_);
  return send_frame(fd_.get(), h, message, Deadline::after_ms(10000))
      .with_context("notify agent '" + peer_.name + "'");
}

Result<RegionGrant> ControlChannel::query_region(uint32_t region, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(Pending p, request(static_cast<uint16_t>(FrameType::kRegionQuery), region,
                                          std::string(), deadline));
  RegionGrant grant;
  grant.length = p.length;
  grant.remote_write = (p.flags & kRegionRemoteWrite) != 0;
  grant.remote_read = (p.flags & kRegionRemoteRead) != 0;
  grant.memfd = std::move(p.fd);
  return grant;
}

}  // namespace ecx::transfer
