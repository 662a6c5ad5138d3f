// The agent wire protocol: fixed 48-byte frame headers, an optional control payload,
// and for READ replies / WRITE requests the raw data bytes after the payload.
//
//   client                      server
//                          <-   CHALLENGE(server nonce)
//   HELLO(nonce, mac, metadata JSON) -> HELLO_OK(mac, metadata JSON) | ERROR
//     (mutual HMAC proof of the deployment secret; see transfer/connection.h)
//   READ(region,off,len[,capability]) ->   READ_DATA(len) + len bytes | ERROR(message)
//   WRITE(region,off,len) + len bytes -> WRITE_ACK | ERROR(message)
//   REGION_QUERY(region)   ->   REGION_INFO(len, flags) [+ memfd over unix | ucx key] | ERROR
//   CALL(payload)          ->   CALL_REPLY(payload) | ERROR(message)
//   NOTIFY(payload)            (no reply)
#pragma once

#include <cstdint>
#include <string>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/transfer/types.h"
#include "wire/socket.h"

namespace ecx::transfer {

constexpr uint32_t kFrameMagic = 0x31584345;  // "ECX1"
constexpr uint32_t kProtocolVersion = 2;
// Upper bound on a control payload (metadata, call bodies, error messages).
constexpr uint32_t kMaxControlPayload = 16 * 1024 * 1024;
// Upper bound on a HELLO / HELLO_OK payload (metadata of an agent with many regions).
constexpr uint32_t kMaxHelloPayload = 1024 * 1024;
// READ, WRITE and REGION_QUERY carry at most a capability.
constexpr uint32_t kMaxRequestPayload = 64;

enum class FrameType : uint16_t {
  kHello = 1,
  kHelloOk = 2,
  kRead = 3,
  kReadData = 4,
  kWrite = 5,
  kWriteAck = 6,
  kRegionQuery = 7,
  kRegionInfo = 8,
  kCall = 9,
  kCallReply = 10,
  kNotify = 11,
  kError = 12,
  kChallenge = 13,
};

// Flags on REGION_QUERY: answer with one backend's data of the region (payload), not its
// memfd; the backend's number (Backend) is in the upper byte.
constexpr uint16_t kRegionQueryBackendData = 1;
constexpr uint16_t region_query_flags(Backend backend) {
  return static_cast<uint16_t>(kRegionQueryBackendData | (static_cast<uint16_t>(backend) << 8));
}
// Upper bound on a REGION_INFO payload (a backend's data of a region: a ucx key in hex).
constexpr uint32_t kMaxRegionInfoPayload = 16384;

// Flags on REGION_INFO.
constexpr uint16_t kRegionRemoteWrite = 1;
constexpr uint16_t kRegionHasFd = 2;
constexpr uint16_t kRegionRemoteRead = 4;

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t type = 0;
  uint16_t flags = 0;
  uint32_t status = 0;  // StatusCode on ERROR
  uint32_t region = 0;
  uint64_t id = 0;  // request id, echoed in the reply
  uint64_t offset = 0;
  uint64_t length = 0;  // data bytes following (READ_DATA, WRITE); region length (REGION_INFO)
  uint32_t payload_length = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(FrameHeader) == 48);

struct Frame {
  FrameHeader header;
  std::string payload;
};

const char* frame_type_name(uint16_t type);

// Sends header + payload in one writev. Thread-compatible: callers serialise per fd.
Status send_frame(int fd, FrameHeader header, const std::string& payload, Deadline deadline);
// The most payload a frame of `type` may carry (0 for an unknown type).
uint32_t max_payload_for(uint16_t type);
// Receives one frame (header and payload, not data bytes). Rejects a bad magic, an
// unknown type, or a payload over that type's limit (max_payload_for, and at most
// `max_payload`) before reading it; the payload buffer grows with the bytes that
// actually arrive, never to a size a peer announced. With `passed_fd`, accepts an
// attached descriptor.
Result<Frame> recv_frame(int fd, Deadline deadline, UniqueFd* passed_fd = nullptr,
                         uint32_t max_payload = kMaxControlPayload);
// An ERROR frame's content as a Status (the code travels in header.status).
Status status_from_error_frame(const Frame& frame);
Status send_error(int fd, uint64_t id, const Status& status,
                  Deadline deadline = Deadline::after_ms(5000));

}  // namespace ecx::transfer
