// Small wrappers over POSIX sockets: an owning fd, connect/listen, I/O with deadlines,
// and fd passing (SCM_RIGHTS). Everything returns Status; nothing throws.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"

namespace ecx::transfer {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string to_string() const { return host + ":" + std::to_string(port); }
};
// Parses "127.0.0.1:5000"; rejects missing or out-of-range ports.
Result<HostPort> parse_host_port(const std::string& text);

// Listening TCP socket on host:port (port 0 = any). Returns the fd and the bound port.
Result<std::pair<UniqueFd, uint16_t>> listen_tcp(const std::string& host, uint16_t port);
// Listening unix socket in the abstract namespace under `name` (no file to clean up).
Result<UniqueFd> listen_unix(const std::string& name);
Result<UniqueFd> connect_tcp(const HostPort& address, Deadline deadline);
Result<UniqueFd> connect_unix(const std::string& name, Deadline deadline);
// Accepts one connection; returns an invalid fd when the listener was shut down.
Result<UniqueFd> accept_connection(int listen_fd);
// The uid of the process at the other end of a unix socket (SO_PEERCRED).
Result<uint32_t> peer_uid(int fd);
// Refuses a unix-socket peer that runs as another user than this process: another local
// user must not reach an agent's memory, whatever it knows.
Status check_same_uid(int fd, const std::string& what);

// Tunes a TCP data socket: TCP_NODELAY and large kernel buffers.
void tune_tcp_socket(int fd, int buffer_bytes);
// Makes blocking send/recv on `fd` give up at `deadline` (SO_SNDTIMEO/SO_RCVTIMEO).
void set_io_deadline(int fd, Deadline deadline);

// Blocking I/O of exactly `length` bytes. With a finite deadline, waits with poll(2).
// Errors name `what`; a closed peer is kUnavailable, a passed deadline kDeadlineExceeded.
Status send_all(int fd, const void* data, size_t length, Deadline deadline, const char* what);
Status recv_all(int fd, void* data, size_t length, Deadline deadline, const char* what,
                size_t* received = nullptr);
// Sends `length` bytes with one file descriptor attached to the first byte.
Status send_with_fd(int fd, const void* data, size_t length, int fd_to_pass);
// Receives exactly `length` bytes; a passed descriptor (if any) lands in *passed_fd.
Status recv_with_fd(int fd, void* data, size_t length, Deadline deadline, UniqueFd* passed_fd);

}  // namespace ecx::transfer
