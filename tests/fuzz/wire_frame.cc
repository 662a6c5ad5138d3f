// Fuzz target: the agent wire frame parser, recv_frame (src/wire/wire.h), fed the way
// a peer feeds it: the input is written into one end of a unix socketpair, the write side
// is shut down, and frames are read from the other end until the stream ends or a frame
// is rejected.
//
// Input: byte 0 selects the mode, the rest is the byte stream.
//   bit 0: receive as the shm backend does (recv_frame with a passed_fd slot)
//   bit 1: attach a descriptor (/dev/null) to the first stream byte, as SCM_RIGHTS
// Invariants: an accepted frame has the magic and a payload of exactly payload_length
// (<= kMaxControlPayload) bytes; an ERROR frame never turns into an ok Status; no
// descriptor leaks (a leak would exhaust descriptors and fail the socketpair check).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ecx/transfer/metadata.h"
#include "fuzz/fuzz_target.h"
#include "wire/socket.h"
#include "wire/wire.h"

namespace {

using namespace ecx::transfer;

// Larger inputs are cut here: the stream must fit in the socket buffer, since nothing
// reads while it is written.
constexpr size_t kMaxStream = 64 * 1024;
constexpr int kMaxFrames = 16;

// Writes what fits without blocking; a short stream is just another input.
void write_stream(int fd, const uint8_t* data, size_t size, bool attach_fd) {
  static const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  size_t sent = 0;
  if (attach_fd && size > 0 && devnull >= 0) {
    if (!send_with_fd(fd, data, 1, devnull).ok()) return;
    sent = 1;
  }
  while (sent < size) {
    ssize_t n = ::send(fd, data + sent, size - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const bool with_fd_slot = (mode & 1) != 0;
  const bool attach_fd = (mode & 2) != 0;
  ++data;
  --size;
  if (size > kMaxStream) size = kMaxStream;

  int fds[2];
  ECX_FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0,
                 "socketpair failed (descriptors leaked?)");
  UniqueFd writer(fds[0]), reader(fds[1]);
  int buffer = 4 * kMaxStream;
  ::setsockopt(writer.get(), SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
  write_stream(writer.get(), data, size, attach_fd);
  ::shutdown(writer.get(), SHUT_WR);

  for (int i = 0; i < kMaxFrames; ++i) {
    UniqueFd passed;
    auto frame =
        recv_frame(reader.get(), ecx::Deadline::after_ms(2000), with_fd_slot ? &passed : nullptr);
    if (!frame.ok()) {
      ECX_FUZZ_CHECK(frame.status().code() != ecx::StatusCode::kDeadlineExceeded,
                     "recv_frame waited on a stream that had already ended");
      break;
    }
    const FrameHeader& h = frame->header;
    ECX_FUZZ_CHECK(h.magic == kFrameMagic, "accepted a frame with a bad magic");
    ECX_FUZZ_CHECK(h.payload_length <= kMaxControlPayload, "accepted an oversized payload");
    ECX_FUZZ_CHECK(frame->payload.size() == h.payload_length, "payload size != payload_length");
    ECX_FUZZ_CHECK(frame_type_name(h.type) != nullptr, "frame type without a name");
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kError:
        ECX_FUZZ_CHECK(!status_from_error_frame(*frame).ok(), "an ERROR frame read as ok");
        break;
      case FrameType::kHello:
      case FrameType::kHelloOk:
        // What the handshake does next with the payload (its own target: agent_metadata).
        AgentMetadata::parse(frame->payload).status().ignore_error();
        break;
      default:
        break;
    }
  }
  return 0;
}
