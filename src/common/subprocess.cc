#include "ecx/common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

extern char** environ;

namespace ecx {

Result<Subprocess> Subprocess::spawn(const std::vector<std::string>& argv) {
  if (argv.empty()) return InvalidArgument("spawn: empty argv");
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return ErrnoError("pipe", errno);
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return ErrnoError("pipe", errno);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], 0);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  if (rc != 0) {
    ::close(in[1]);
    ::close(out[0]);
    return Status(StatusCode::kIoError, "spawn " + argv[0] + ": " + std::strerror(rc));
  }
  Subprocess p;
  p.pid_ = pid;
  p.stdin_fd_ = in[1];
  p.stdout_fd_ = out[0];
  return p;
}

Subprocess::Subprocess(Subprocess&& o) noexcept
    : pid_(std::exchange(o.pid_, -1)),
      stdin_fd_(std::exchange(o.stdin_fd_, -1)),
      stdout_fd_(std::exchange(o.stdout_fd_, -1)),
      buffer_(std::move(o.buffer_)) {}

Subprocess& Subprocess::operator=(Subprocess&& o) noexcept {
  if (this != &o) {
    this->~Subprocess();
    new (this) Subprocess(std::move(o));
  }
  return *this;
}

Subprocess::~Subprocess() {
  close_stdin();
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
  if (pid_ > 0) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
  }
}

Result<std::string> Subprocess::read_line(Deadline deadline) {
  while (true) {
    auto nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    int rc = ::poll(&p, 1, deadline.poll_timeout_ms());
    if (rc == 0)
      return DeadlineExceeded("child " + std::to_string(pid_) +
                              ": no output line before the deadline");
    if (rc < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("poll child stdout", errno);
    }
    char chunk[4096];
    ssize_t n = ::read(stdout_fd_, chunk, sizeof(chunk));
    if (n == 0) return Unavailable("child " + std::to_string(pid_) + " closed its stdout");
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read child stdout", errno);
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

Status Subprocess::write_stdin(std::string_view text) {
  if (stdin_fd_ < 0) return Status(StatusCode::kFailedPrecondition, "child stdin is closed");
  // A dead child must give us EPIPE, not kill us with SIGPIPE.
  static const bool ignore_sigpipe = [] { return ::signal(SIGPIPE, SIG_IGN) != SIG_ERR; }();
  (void)ignore_sigpipe;
  while (!text.empty()) {
    ssize_t n = ::write(stdin_fd_, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write to child " + std::to_string(pid_), errno);
    }
    text.remove_prefix(static_cast<size_t>(n));
  }
  return Status::Ok();
}

void Subprocess::close_stdin() {
  if (stdin_fd_ >= 0) {
    ::close(stdin_fd_);
    stdin_fd_ = -1;
  }
}

Status Subprocess::kill(int signal) {
  if (pid_ <= 0) return Status(StatusCode::kFailedPrecondition, "no child to signal");
  if (::kill(pid_, signal) != 0) return ErrnoError("kill", errno);
  return Status::Ok();
}

Result<int> Subprocess::wait(Deadline deadline) {
  if (pid_ <= 0) return Status(StatusCode::kFailedPrecondition, "no child to wait for");
  // A pidfd lets us wait with a deadline without polling.
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    int rc;
    do {
      rc = ::poll(&p, 1, deadline.poll_timeout_ms());
    } while (rc < 0 && errno == EINTR);
    ::close(pidfd);
    if (rc == 0)
      return DeadlineExceeded("child " + std::to_string(pid_) +
                              " did not exit before the deadline");
  }
  int status = 0;
  if (::waitpid(pid_, &status, 0) < 0) return ErrnoError("waitpid", errno);
  pid_ = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::string current_executable() {
  char path[4096] = {};
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string("ecx");
}

std::string sibling_executable(const std::string& name) {
  char path[4096] = {};
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return name;
  std::string self(path, static_cast<size_t>(n));
  size_t slash = self.rfind('/');
  return slash == std::string::npos ? name : self.substr(0, slash + 1) + name;
}

}  // namespace ecx
