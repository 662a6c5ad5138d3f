#include "transfer/serve_io.h"

#include "wire/socket.h"

namespace ecx::transfer {

Status ServeIo::send_read_data(int fd, const std::byte* src, uint64_t length, Deadline deadline) {
  return send_all(fd, src, length, deadline, "send READ data");
}

ServeIo& ServeIo::standard() {
  static ServeIo io;
  return io;
}

}  // namespace ecx::transfer
