#include "wire/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ecx::transfer {
namespace {

Status wait_fd(int fd, short events, Deadline deadline, const char* what) {
  while (true) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, deadline.poll_timeout_ms());
    if (rc > 0) return Status::Ok();
    if (rc == 0) return DeadlineExceeded(std::string(what) + ": deadline passed");
    if (errno != EINTR) return ErrnoError(std::string(what) + ": poll", errno);
  }
}

Status io_error(const char* what, int err, bool sending) {
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return DeadlineExceeded(std::string(what) + ": deadline passed");
  }
  if (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ESHUTDOWN) {
    return Unavailable(std::string(what) + ": connection lost (" + std::strerror(err) + ")");
  }
  return ErrnoError(std::string(what) + (sending ? ": send" : ": recv"), err);
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof(addr.sun_path) - 1);
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), n);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  return addr;
}

Result<sockaddr_in> resolve_ipv4(const std::string& host, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  std::string h = (host.empty() || host == "localhost") ? "127.0.0.1" : host;
  if (::inet_pton(AF_INET, h.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (::getaddrinfo(h.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return InvalidArgument("cannot resolve host '" + host + "'");
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
}

Status connect_with_deadline(int fd, const sockaddr* addr, socklen_t len, Deadline deadline,
                             const std::string& what) {
  int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, addr, len);
  if (rc != 0 && errno != EINPROGRESS && errno != EAGAIN) {
    int err = errno;
    return Unavailable("connect to " + what + ": " + std::strerror(err));
  }
  if (rc != 0) {
    ECX_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, ("connect to " + what).c_str()));
    int err = 0;
    socklen_t elen = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err != 0) return Unavailable("connect to " + what + ": " + std::strerror(err));
  }
  ::fcntl(fd, F_SETFL, flags);
  return Status::Ok();
}

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Result<HostPort> parse_host_port(const std::string& text) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    return InvalidArgument("expected host:port, got '" + text + "'");
  }
  std::string port_text = text.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    return InvalidArgument("port out of range in '" + text + "'");
  }
  return HostPort{text.substr(0, colon), static_cast<uint16_t>(port)};
}

Result<std::pair<UniqueFd, uint16_t>> listen_tcp(const std::string& host, uint16_t port) {
  ECX_ASSIGN_OR_RETURN(sockaddr_in addr, resolve_ipv4(host, port));
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoError("bind " + host + ":" + std::to_string(port), errno);
  }
  if (::listen(fd.get(), 512) != 0) return ErrnoError("listen", errno);
  socklen_t len = sizeof(addr);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  return std::make_pair(std::move(fd), ntohs(addr.sin_port));
}

Result<UniqueFd> listen_unix(const std::string& name) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket(AF_UNIX)", errno);
  socklen_t len = 0;
  sockaddr_un addr = abstract_address(name, &len);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return ErrnoError("bind unix @" + name, errno);
  }
  if (::listen(fd.get(), 512) != 0) return ErrnoError("listen unix", errno);
  return fd;
}

Result<UniqueFd> connect_tcp(const HostPort& address, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(sockaddr_in addr, resolve_ipv4(address.host, address.port));
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  ECX_RETURN_IF_ERROR(connect_with_deadline(fd.get(), reinterpret_cast<sockaddr*>(&addr),
                                            sizeof(addr), deadline, address.to_string()));
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Result<UniqueFd> connect_unix(const std::string& name, Deadline deadline) {
  // A peer's name longer than an abstract address holds would be cut to another name.
  if (name.empty() || name.size() > sizeof(sockaddr_un::sun_path) - 1) {
    return InvalidArgument("unix socket name of " + std::to_string(name.size()) + " bytes (1 to " +
                           std::to_string(sizeof(sockaddr_un::sun_path) - 1) + ")");
  }
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket(AF_UNIX)", errno);
  socklen_t len = 0;
  sockaddr_un addr = abstract_address(name, &len);
  ECX_RETURN_IF_ERROR(connect_with_deadline(fd.get(), reinterpret_cast<sockaddr*>(&addr), len,
                                            deadline, "unix @" + name));
  // Abstract socket names are not protected by file permissions: check who answered.
  ECX_RETURN_IF_ERROR(check_same_uid(fd.get(), "unix @" + name));
  return fd;
}

Result<UniqueFd> accept_connection(int listen_fd) {
  while (true) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) return UniqueFd(fd);
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EINVAL || errno == EBADF) return UniqueFd();  // listener shut down
    return ErrnoError("accept", errno);
  }
}

Result<uint32_t> peer_uid(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoError("getsockopt(SO_PEERCRED)", errno);
  }
  return static_cast<uint32_t>(cred.uid);
}

Status check_same_uid(int fd, const std::string& what) {
  ECX_ASSIGN_OR_RETURN(uint32_t uid, peer_uid(fd));
  if (uid != static_cast<uint32_t>(::geteuid())) {
    return PermissionDenied(what + ": peer runs as uid " + std::to_string(uid) + ", not uid " +
                            std::to_string(::geteuid()));
  }
  return Status::Ok();
}

void tune_tcp_socket(int fd, int buffer_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
}

void set_io_deadline(int fd, Deadline deadline) {
  timeval tv{};
  if (!deadline.is_never()) {
    auto ns = deadline.remaining().count();
    if (ns <= 0) ns = 1000;  // already passed: fail the next call almost at once
    tv.tv_sec = ns / 1'000'000'000;
    tv.tv_usec = (ns % 1'000'000'000) / 1000;
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;
  }
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

Status send_all(int fd, const void* data, size_t length, Deadline deadline, const char* what) {
  const char* p = static_cast<const char*>(data);
  size_t left = length;
  while (left > 0) {
    if (!deadline.is_never()) ECX_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, what));
    // With a finite deadline never block inside send(): poll decides how long we wait.
    int flags = MSG_NOSIGNAL | (deadline.is_never() ? 0 : MSG_DONTWAIT);
    ssize_t n = ::send(fd, p, left, flags);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (!deadline.is_never() && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      return io_error(what, errno, true);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status recv_all(int fd, void* data, size_t length, Deadline deadline, const char* what,
                size_t* received) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < length) {
    if (!deadline.is_never()) {
      Status s = wait_fd(fd, POLLIN, deadline, what);
      if (!s.ok()) {
        if (received) *received = got;
        return s;
      }
    }
    int flags = deadline.is_never() ? MSG_WAITALL : MSG_DONTWAIT;
    ssize_t n = ::recv(fd, p + got, length - got, flags);
    if (n == 0) {
      if (received) *received = got;
      return Unavailable(std::string(what) + ": peer closed the connection after " +
                         std::to_string(got) + " of " + std::to_string(length) + " bytes");
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (!deadline.is_never() && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (received) *received = got;
      return io_error(what, errno, false);
    }
    got += static_cast<size_t>(n);
  }
  if (received) *received = got;
  return Status::Ok();
}

Status send_with_fd(int fd, const void* data, size_t length, int fd_to_pass) {
  iovec iov{const_cast<void*>(data), length};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd_to_pass, sizeof(int));
  ssize_t n;
  do {
    n = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return io_error("send region descriptor", errno, true);
  size_t sent = static_cast<size_t>(n);
  if (sent < length) {
    return send_all(fd, static_cast<const char*>(data) + sent, length - sent, Deadline::never(),
                    "send region descriptor");
  }
  return Status::Ok();
}

Status recv_with_fd(int fd, void* data, size_t length, Deadline deadline, UniqueFd* passed_fd) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < length) {
    if (!deadline.is_never()) ECX_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, "recv frame"));
    iovec iov{p + got, length - got};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | (deadline.is_never() ? 0 : MSG_DONTWAIT));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (!deadline.is_never() && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      return io_error("recv frame", errno, false);
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
        size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int received;
          std::memcpy(&received, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
          if (passed_fd != nullptr && !passed_fd->valid()) {
            passed_fd->reset(received);
          } else {
            ::close(received);  // unexpected extra descriptor: never leak it
          }
        }
      }
    }
    if (n == 0) {
      return Unavailable("recv frame: peer closed the connection after " + std::to_string(got) +
                         " of " + std::to_string(length) + " bytes");
    }
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace ecx::transfer
