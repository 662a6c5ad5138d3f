#include "wire/wire.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

namespace ecx::transfer {

const char* frame_type_name(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kHello:
      return "HELLO";
    case FrameType::kHelloOk:
      return "HELLO_OK";
    case FrameType::kRead:
      return "READ";
    case FrameType::kReadData:
      return "READ_DATA";
    case FrameType::kWrite:
      return "WRITE";
    case FrameType::kWriteAck:
      return "WRITE_ACK";
    case FrameType::kRegionQuery:
      return "REGION_QUERY";
    case FrameType::kRegionInfo:
      return "REGION_INFO";
    case FrameType::kCall:
      return "CALL";
    case FrameType::kCallReply:
      return "CALL_REPLY";
    case FrameType::kNotify:
      return "NOTIFY";
    case FrameType::kError:
      return "ERROR";
    case FrameType::kChallenge:
      return "CHALLENGE";
  }
  return "UNKNOWN";
}

uint32_t max_payload_for(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kHello:
    case FrameType::kHelloOk:
      return kMaxHelloPayload;
    case FrameType::kRead:
    case FrameType::kWrite:
    case FrameType::kRegionQuery:
    case FrameType::kChallenge:
      return kMaxRequestPayload;
    case FrameType::kRegionInfo:
      return kMaxRegionInfoPayload;
    case FrameType::kReadData:
    case FrameType::kWriteAck:
      return 0;
    case FrameType::kCall:
    case FrameType::kCallReply:
    case FrameType::kNotify:
    case FrameType::kError:
      return kMaxControlPayload;
  }
  return 0;
}

Status send_frame(int fd, FrameHeader header, const std::string& payload, Deadline deadline) {
  if (payload.size() > kMaxControlPayload) {
    return InvalidArgument("control payload of " + std::to_string(payload.size()) +
                           " bytes exceeds the limit of " + std::to_string(kMaxControlPayload));
  }
  header.magic = kFrameMagic;
  header.payload_length = static_cast<uint32_t>(payload.size());
  if (deadline.is_never()) {
    iovec iov[2] = {{&header, sizeof(header)}, {const_cast<char*>(payload.data()), payload.size()}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = payload.empty() ? 1 : 2;
    ssize_t n;
    do {
      n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      int err = errno;
      return Unavailable(std::string("send ") + frame_type_name(header.type) +
                         ": connection lost (" + std::to_string(err) + ")");
    }
    size_t sent = static_cast<size_t>(n);
    if (sent == sizeof(header) + payload.size()) return Status::Ok();
    // Short write: finish the rest byte-exactly.
    if (sent < sizeof(header)) {
      ECX_RETURN_IF_ERROR(send_all(fd, reinterpret_cast<char*>(&header) + sent,
                                   sizeof(header) - sent, deadline, "send frame"));
      sent = sizeof(header);
    }
    size_t off = sent - sizeof(header);
    return send_all(fd, payload.data() + off, payload.size() - off, deadline, "send frame");
  }
  ECX_RETURN_IF_ERROR(send_all(fd, &header, sizeof(header), deadline, "send frame"));
  return send_all(fd, payload.data(), payload.size(), deadline, "send frame");
}

Result<Frame> recv_frame(int fd, Deadline deadline, UniqueFd* passed_fd, uint32_t max_payload) {
  Frame frame;
  if (passed_fd != nullptr) {
    ECX_RETURN_IF_ERROR(recv_with_fd(fd, &frame.header, sizeof(frame.header), deadline, passed_fd));
  } else {
    ECX_RETURN_IF_ERROR(recv_all(fd, &frame.header, sizeof(frame.header), deadline, "recv frame"));
  }
  if (frame.header.magic != kFrameMagic) {
    return InvalidArgument("bad frame magic 0x" + std::to_string(frame.header.magic) +
                           ": not an ecx agent connection");
  }
  if (frame.header.type == 0 || frame.header.type > static_cast<uint16_t>(FrameType::kChallenge)) {
    return InvalidArgument("unknown frame type " + std::to_string(frame.header.type));
  }
  uint32_t limit = std::min(max_payload, max_payload_for(frame.header.type));
  if (frame.header.payload_length > limit) {
    return InvalidArgument(std::string(frame_type_name(frame.header.type)) + " payload of " +
                           std::to_string(frame.header.payload_length) +
                           " bytes exceeds the limit of " + std::to_string(limit));
  }
  // Grown as bytes arrive: a header that announces 16 MiB and sends nothing costs nothing.
  constexpr size_t kChunk = 64 * 1024;
  const size_t total = frame.header.payload_length;
  while (frame.payload.size() < total) {
    size_t have = frame.payload.size();
    size_t n = std::min(kChunk, total - have);
    frame.payload.resize(have + n);
    ECX_RETURN_IF_ERROR(
        recv_all(fd, frame.payload.data() + have, n, deadline, "recv frame payload"));
  }
  return frame;
}

Status status_from_error_frame(const Frame& frame) {
  auto code = static_cast<StatusCode>(frame.header.status);
  if (frame.header.status == 0 ||
      frame.header.status > static_cast<uint32_t>(StatusCode::kPermissionDenied)) {
    code = StatusCode::kInternal;
  }
  return Status(code, frame.payload);
}

Status send_error(int fd, uint64_t id, const Status& status, Deadline deadline) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(FrameType::kError);
  h.id = id;
  h.status = static_cast<uint32_t>(status.code());
  std::string message = status.message().substr(0, 4096);
  return send_frame(fd, h, message, deadline);
}

}  // namespace ecx::transfer
