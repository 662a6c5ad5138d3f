// The delaying relay's event loop (relay.h): one epoll set holding the listener, a
// timerfd armed at the earliest due chunk, a signalfd, and both sockets of every
// relayed connection.
#include "relay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/netfilter_ipv4.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <queue>
#include <unordered_map>
#include <vector>

#include <spdlog/sinks/stdout_color_sinks.h>
#include "delay_line.h"

#include "ecx/common/log.h"
#include "wire/socket.h"

namespace ecx::relay {
namespace {

using transfer::UniqueFd;

// epoll tags: the three fixed descriptors, then two per connection (id << 1 | side).
constexpr uint64_t kListenerTag = 0, kTimerTag = 1, kSignalTag = 2;
constexpr uint64_t kFirstConnectionId = 2;
constexpr size_t kReadChunk = 256 << 10;
constexpr int kReadsPerEvent = 16;    // then other connections get their turn
constexpr int kAcceptsPerEvent = 64;  // likewise for the listener
constexpr int kClient = 0, kServer = 1;

// One socket of a relayed connection: the redirected client, or the onward connection
// to the client's original destination (the server).
struct Side {
  UniqueFd fd;
  bool reading = true;         // no EOF or error read from it yet
  bool write_shut = false;     // the other side's EOF was passed on (SHUT_WR)
  bool write_blocked = false;  // due bytes wait for EPOLLOUT
  bool in_epoll = false;
  uint32_t registered = 0;  // the events it is registered for
};

struct Connection {
  Connection(std::chrono::nanoseconds delay, size_t capacity)
      : lines{DelayLine(delay, capacity), DelayLine(delay, capacity)} {}
  Side sides[2];
  DelayLine lines[2];      // lines[s]: bytes read from sides[s], bound for sides[1 - s]
  bool connecting = true;  // the onward connect is in progress
  // Both EOFs passed on: nothing more can move.
  bool finished() const { return sides[kClient].write_shut && sides[kServer].write_shut; }
};

struct Timer {
  Clock::time_point due;
  uint64_t id;
  bool operator>(const Timer& o) const { return due > o.due; }
};

std::string address_text(const sockaddr_in& a) {
  char host[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof(host));
  return std::string(host) + ":" + std::to_string(ntohs(a.sin_port));
}

// Raises the open-file limit to its hard maximum; returns the soft limit now in force.
rlim_t raise_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  limit.rlim_cur = limit.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &limit);
  ::getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur;
}

class Relay {
 public:
  explicit Relay(RelayOptions options) : options_(std::move(options)) {}
  Status start();
  Status serve();

 private:
  void accept_all();
  void open_connection(UniqueFd client);
  Result<UniqueFd> connect_onward(const sockaddr_in& destination);
  void on_connection_event(uint64_t id, int side, uint32_t events);
  bool finish_connect(Connection& c);
  bool read_side(uint64_t id, Connection& c, int side, bool hangup);
  bool flush(Connection& c, int from);
  void update_interest(uint64_t id, Connection& c);
  void close_connection(uint64_t id);
  void schedule(Clock::time_point due, uint64_t id);
  void fire_timers();
  void arm_timer(Clock::time_point due);
  Status watch(int fd, uint64_t tag, uint32_t events);

  RelayOptions options_;
  UniqueFd listener_, epoll_, timer_, signals_;
  sockaddr_in listen_address_{};
  bool listener_paused_ = false;  // out of descriptors: resumed when a connection closes
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;
  Clock::time_point armed_ = Clock::time_point::max();
  uint64_t next_id_ = kFirstConnectionId;
  // Where the next read lands; a large read is handed to the line as it is (no copy).
  std::unique_ptr<std::byte[]> scratch_ = std::make_unique_for_overwrite<std::byte[]>(kReadChunk);
  uint64_t accepted_ = 0, refused_ = 0;
};

Status Relay::watch(int fd, uint64_t tag, uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return ErrnoError("epoll_ctl", errno);
  return Status::Ok();
}

Status Relay::start() {
  ECX_ASSIGN_OR_RETURN(transfer::HostPort hp, transfer::parse_host_port(options_.listen));
  ECX_ASSIGN_OR_RETURN(auto listening, transfer::listen_tcp(hp.host, hp.port));
  listener_ = std::move(listening.first);
  socklen_t len = sizeof(listen_address_);
  ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&listen_address_), &len);
  int flags = ::fcntl(listener_.get(), F_GETFL);
  ::fcntl(listener_.get(), F_SETFL, flags | O_NONBLOCK);

  rlim_t files = raise_file_limit();
  int most = static_cast<int>(std::min<rlim_t>(files > 64 ? (files - 32) / 2 : 16, 1 << 20));
  if (options_.max_connections > most) {
    spdlog::warn("ecx relay: {} open files allowed: at most {} connections, not {}", files, most,
                 options_.max_connections);
    options_.max_connections = most;
  }
  // Chunks are released within microseconds of their due time, not the default 50 us slack.
  ::prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);
  signals_ = UniqueFd(::signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC));
  epoll_ = UniqueFd(::epoll_create1(EPOLL_CLOEXEC));
  timer_ = UniqueFd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
  if (!signals_.valid() || !epoll_.valid() || !timer_.valid()) {
    return ErrnoError("ecx relay: signalfd/epoll/timerfd", errno);
  }
  ECX_RETURN_IF_ERROR(watch(listener_.get(), kListenerTag, EPOLLIN));
  ECX_RETURN_IF_ERROR(watch(timer_.get(), kTimerTag, EPOLLIN));
  ECX_RETURN_IF_ERROR(watch(signals_.get(), kSignalTag, EPOLLIN));
  std::printf("ecx relay: listening on %s, one-way delay %.3f ms, %zu bytes per direction\n",
              address_text(listen_address_).c_str(),
              std::chrono::duration<double, std::milli>(options_.delay).count(),
              options_.buffer_bytes);
  std::fflush(stdout);
  return Status::Ok();
}

Status Relay::serve() {
  std::vector<epoll_event> events(256);
  while (true) {
    int n = ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("ecx relay: epoll_wait", errno);
    for (int i = 0; i < n; ++i) {
      uint64_t tag = events[i].data.u64;
      if (tag == kSignalTag) {
        spdlog::info("ecx relay: stopping ({} connections relayed, {} refused, {} open)", accepted_,
                     refused_, connections_.size());
        return Status::Ok();
      }
      if (tag == kListenerTag) {
        accept_all();
      } else if (tag == kTimerTag) {
        fire_timers();
      } else {
        on_connection_event(tag >> 1, static_cast<int>(tag & 1), events[i].events);
      }
    }
  }
}

void Relay::accept_all() {
  for (int i = 0; i < kAcceptsPerEvent; ++i) {
    int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      open_connection(UniqueFd(fd));
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EMFILE || errno == ENFILE) {
      spdlog::warn("ecx relay: out of file descriptors; not accepting until a connection closes");
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, listener_.get(), nullptr);
      listener_paused_ = true;
    } else if (errno != EAGAIN) {
      spdlog::warn("ecx relay: accept: {}", std::strerror(errno));
    }
    return;
  }
}

void Relay::open_connection(UniqueFd client) {
  sockaddr_in destination{}, local{};
  socklen_t len = sizeof(destination);
  bool redirected = ::getsockopt(client.get(), SOL_IP, SO_ORIGINAL_DST, &destination, &len) == 0 &&
                    destination.sin_family == AF_INET;
  len = sizeof(local);
  ::getsockname(client.get(), reinterpret_cast<sockaddr*>(&local), &len);
  // A connection made to the relay itself (not redirected) has nowhere to go.
  bool to_self = redirected && destination.sin_addr.s_addr == local.sin_addr.s_addr &&
                 destination.sin_port == local.sin_port;
  if (!redirected || to_self || connections_.size() >= size_t(options_.max_connections)) {
    ++refused_;
    return;  // closing `client` refuses it
  }
  auto server = connect_onward(destination);
  if (!server.ok()) {
    spdlog::info("ecx relay: {}", server.status().to_string());
    ++refused_;
    return;
  }
  ++accepted_;
  set_nodelay(client.get());
  uint64_t id = next_id_++;
  auto c = std::make_unique<Connection>(options_.delay, options_.buffer_bytes);
  c->sides[kClient].fd = std::move(client);
  c->sides[kServer].fd = std::move(*server);
  Connection& ref = *c;
  connections_.emplace(id, std::move(c));
  update_interest(id, ref);
}

Result<UniqueFd> Relay::connect_onward(const sockaddr_in& destination) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  set_nodelay(fd.get());
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&destination), sizeof(destination)) !=
          0 &&
      errno != EINPROGRESS) {
    return ErrnoError("connect to " + address_text(destination), errno);
  }
  return fd;
}

void Relay::on_connection_event(uint64_t id, int side, uint32_t events) {
  auto it = connections_.find(id);
  if (it == connections_.end()) return;  // closed earlier in this batch
  Connection& c = *it->second;
  bool alive = true;
  if (side == kServer && c.connecting) {
    alive = finish_connect(c);
  } else if ((events & EPOLLERR) ||
             ((events & EPOLLHUP) && !c.sides[side].reading && !c.sides[side].write_shut)) {
    alive = false;  // an error, or a reset after the side's EOF
  } else {
    if (events & (EPOLLIN | EPOLLHUP)) alive = read_side(id, c, side, (events & EPOLLHUP) != 0);
    if (alive && (events & EPOLLOUT)) {
      c.sides[side].write_blocked = false;
      alive = flush(c, 1 - side);
    }
  }
  if (!alive || c.finished()) {
    close_connection(id);
  } else {
    update_interest(id, c);
  }
}

// The onward connect completed (or failed): what the client sent so far may move.
bool Relay::finish_connect(Connection& c) {
  int error = 0;
  socklen_t len = sizeof(error);
  ::getsockopt(c.sides[kServer].fd.get(), SOL_SOCKET, SO_ERROR, &error, &len);
  if (error != 0) return false;
  c.connecting = false;
  return flush(c, kClient);
}

// Reads what `side` sent into its line (an EOF too). A hang-up reads past the line's
// capacity: the socket can hold no more than its receive buffer, and reading it is what
// stops the hang-up being reported again.
bool Relay::read_side(uint64_t id, Connection& c, int side, bool hangup) {
  Side& s = c.sides[side];
  DelayLine& line = c.lines[side];
  for (int i = 0; i < kReadsPerEvent && s.reading && (line.has_room() || hangup); ++i) {
    ssize_t n = ::recv(s.fd.get(), scratch_.get(), kReadChunk, 0);
    auto now = Clock::now();
    if (n > 0) {
      size_t got = static_cast<size_t>(n);
      if (got >= kReadChunk / 2) {
        line.push(std::exchange(scratch_, std::make_unique_for_overwrite<std::byte[]>(kReadChunk)),
                  got, now);
      } else {
        line.push(std::span<const std::byte>(scratch_.get(), got), now);  // small: copied
      }
      schedule(now + options_.delay, id);
      if (got < kReadChunk) break;
    } else if (n == 0) {
      s.reading = false;
      line.push_eof(now);
      schedule(now + options_.delay, id);
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN) {
      break;
    } else {
      return false;  // a reset closes both sides
    }
  }
  return flush(c, side);
}

// Writes what is due of lines[from] to the other side; false on a write error.
bool Relay::flush(Connection& c, int from) {
  int to = 1 - from;
  Side& dst = c.sides[to];
  DelayLine& line = c.lines[from];
  if ((to == kServer && c.connecting) || dst.write_blocked || dst.write_shut) return true;
  auto now = Clock::now();
  while (true) {
    std::span<const std::byte> due = line.due_bytes(now);
    if (!due.empty()) {
      ssize_t n = ::send(dst.fd.get(), due.data(), due.size(), MSG_NOSIGNAL);
      if (n > 0) {
        line.consume(static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) {
        dst.write_blocked = true;
        return true;
      }
      return false;
    }
    if (line.eof_due(now)) {
      line.pop_eof();
      ::shutdown(dst.fd.get(), SHUT_WR);
      dst.write_shut = true;
    }
    return true;
  }
}

// Registers each side for what it can do now: EPOLLIN while its line has room, EPOLLOUT
// while due bytes wait (or the onward connect is in progress). A side that is done both
// ways leaves the epoll set, so its hang-up is not reported again and again.
void Relay::update_interest(uint64_t id, Connection& c) {
  for (int side : {kClient, kServer}) {
    Side& s = c.sides[side];
    bool connecting = side == kServer && c.connecting;
    uint32_t events = 0;
    if (connecting || s.write_blocked) events |= EPOLLOUT;
    if (!connecting && s.reading && c.lines[side].has_room()) events |= EPOLLIN;
    bool done = !s.reading && s.write_shut;
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = (id << 1) | static_cast<uint64_t>(side);
    if (done) {
      if (s.in_epoll) ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, s.fd.get(), nullptr);
      s.in_epoll = false;
    } else if (!s.in_epoll) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, s.fd.get(), &ev);
      s.in_epoll = true;
      s.registered = events;
    } else if (s.registered != events) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, s.fd.get(), &ev);
      s.registered = events;
    }
  }
}

void Relay::close_connection(uint64_t id) {
  connections_.erase(id);  // closing the fds removes them from the epoll set
  if (listener_paused_) {
    listener_paused_ = !watch(listener_.get(), kListenerTag, EPOLLIN).ok();
  }
}

void Relay::schedule(Clock::time_point due, uint64_t id) {
  if (options_.delay.count() == 0) return;  // due at once: flushed right after the read
  timers_.push({due, id});
  if (due < armed_) arm_timer(due);
}

void Relay::arm_timer(Clock::time_point due) {
  armed_ = due;
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(due.time_since_epoch()).count();
  itimerspec spec{};
  spec.it_value.tv_sec = ns / 1'000'000'000;
  spec.it_value.tv_nsec = ns % 1'000'000'000;
  if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) spec.it_value.tv_nsec = 1;
  ::timerfd_settime(timer_.get(), TFD_TIMER_ABSTIME, &spec, nullptr);
}

// Flushes every connection with a chunk due now, then arms the timer for the next one.
void Relay::fire_timers() {
  uint64_t expirations = 0;
  if (::read(timer_.get(), &expirations, sizeof(expirations)) < 0 && errno != EAGAIN) {
    spdlog::warn("ecx relay: timerfd: {}", std::strerror(errno));
  }
  armed_ = Clock::time_point::max();
  auto now = Clock::now();
  while (!timers_.empty() && timers_.top().due <= now) {
    uint64_t id = timers_.top().id;
    timers_.pop();
    auto it = connections_.find(id);
    if (it == connections_.end()) continue;
    Connection& c = *it->second;
    bool alive = flush(c, kClient) && flush(c, kServer);
    if (!alive || c.finished()) {
      close_connection(id);
    } else {
      update_interest(id, c);
    }
  }
  if (!timers_.empty()) arm_timer(timers_.top().due);
}

}  // namespace

Status run_relay(const RelayOptions& options) {
  if (options.delay.count() < 0) return InvalidArgument("ecx relay: negative delay");
  if (options.buffer_bytes < 4096) return InvalidArgument("ecx relay: --buffer-bytes below 4096");
  if (options.max_connections < 1) return InvalidArgument("ecx relay: --max-connections below 1");
  // stdout carries only the ready line (a script may stop reading it); logs go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("relay"));
  ::signal(SIGPIPE, SIG_IGN);
  Relay relay(options);
  ECX_RETURN_IF_ERROR(relay.start());
  return relay.serve();
}

}  // namespace ecx::relay
