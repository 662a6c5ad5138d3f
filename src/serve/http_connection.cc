// One HTTP connection on Boost.Beast: reads a request (bounded), answers a fast route on
// this I/O thread or queues a work route for a worker, writes the answer, and reads the
// next request on the same connection (keep-alive). A streamed answer goes out as
// chunks handed over by the worker through a bounded buffer (ChunkStream); while it is
// sent the socket is watched, so the worker learns at once when the client has gone.
#include "serve/http_connection.h"

#include <sys/socket.h>

#include <unistd.h>

#include <array>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "serve/chunk_stream.h"

namespace ecx::serve {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

namespace {

// The least share of connections one client may hold (ServerState::client_share).
constexpr int64_t kMinClientShare = 256;
// A client holding at most this many connections is a newcomer: served past
// max_connections, within ServerState::newcomer_room() (at least kMinNewcomerRoom).
constexpr int64_t kNewcomerConnections = 4;
constexpr int64_t kMinNewcomerRoom = 64;
// Waiting connections of the largest client asked to close per newcomer let in.
constexpr int kYieldAsks = 4;
// A connection whose request's headers began this long ago and are not whole may be
// asked to make room for a newcomer (ServerState::admit).
constexpr std::chrono::seconds kYieldableHeaderAge{1};

// A quarter of physical memory (4 GiB when unknown): the default budget of request bodies.
uint64_t quarter_of_memory() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 4ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4;
}

}  // namespace

ServerState::ServerState(const CommonServiceConfig& config, std::string role_name, int n_workers)
    : role(std::move(role_name)),
      io_threads(std::max(1, config.io_threads)),
      workers(std::max(1, n_workers)),
      max_body_bytes(config.max_body_bytes),
      max_buffered_bytes(config.max_buffered_bytes > 0 ? config.max_buffered_bytes
                                                       : quarter_of_memory()),
      idle_timeout(std::max(1, config.idle_timeout_s)) {}

bool ServerState::reserve_body(uint64_t bytes) {
  uint64_t held = buffered_bytes_.load();
  do {
    if (held > max_buffered_bytes || bytes > max_buffered_bytes - held) return false;
  } while (!buffered_bytes_.compare_exchange_weak(held, held + bytes));
  return true;
}

void ServerState::release_body(uint64_t bytes) { buffered_bytes_ -= bytes; }

bool ServerState::has_room(uint64_t bytes) const {
  uint64_t held = buffered_bytes_.load();
  return held <= max_buffered_bytes && bytes <= max_buffered_bytes - held;
}

int64_t ServerState::client_share() const {
  return std::max<int64_t>(kMinClientShare, max_connections / 4);
}

int64_t ServerState::newcomer_room() const {
  return std::max<int64_t>(kMinNewcomerRoom, max_connections / 8);
}

Admission ServerState::admit(const std::string& client, std::weak_ptr<AdmittedConnection> conn) {
  // Asked to yield once the lock is let go: a connection's last reference may go with the
  // ask, and its destructor leave()s.
  std::optional<std::vector<std::shared_ptr<AdmittedConnection>>> to_ask;
  Admission a;
  {
    MutexLock lock(&clients_mu_);
    auto& held = connections_by_client_[client];
    held.push_back(std::move(conn));
    a.slot = std::prev(held.end());
    const int64_t open = ++open_connections;
    const auto count = static_cast<int64_t>(held.size());
    a.over_share = count > client_share() && open > max_connections / 2;
    const bool newcomer = count <= kNewcomerConnections;
    if (open > max_connections && newcomer && open <= max_connections + newcomer_room()) {
      to_ask = room_makers_locked(client);
    }
    a.over_capacity = !to_ask && (a.over_share || open > max_connections);
  }
  if (to_ask) {
    for (const auto& c : *to_ask) c->yield_if_waiting();
  }
  return a;
}

std::optional<std::vector<std::shared_ptr<AdmittedConnection>>> ServerState::room_makers_locked(
    const std::string& newcomer) {
  std::list<std::weak_ptr<AdmittedConnection>>* largest = nullptr;
  for (auto& [client, held] : connections_by_client_) {
    if (client != newcomer && (largest == nullptr || held.size() > largest->size())) {
      largest = &held;
    }
  }
  if (largest == nullptr || static_cast<int64_t>(largest->size()) <= kNewcomerConnections) {
    return std::nullopt;  // nobody holds many: the service is full of small clients
  }
  // Its oldest first; those asked go to the back, so the next newcomer asks others.
  std::vector<std::shared_ptr<AdmittedConnection>> out;
  for (int asked = 0; asked < kYieldAsks && !largest->empty(); ++asked) {
    if (auto c = largest->front().lock()) out.push_back(std::move(c));
    largest->splice(largest->end(), *largest, largest->begin());
  }
  return out;
}

void ServerState::leave(const std::string& client, const Admission& admission) {
  MutexLock lock(&clients_mu_);
  auto it = connections_by_client_.find(client);
  if (it != connections_by_client_.end()) {
    it->second.erase(admission.slot);
    if (it->second.empty()) connections_by_client_.erase(it);
  }
  open_connections--;
}

void ServerState::begin_request() {
  MutexLock lock(&mu_);
  ++in_flight_;
}

bool ServerState::try_begin_request() {
  MutexLock lock(&mu_);
  if (stopping) return false;
  ++in_flight_;
  return true;
}

void ServerState::begin_stopping() {
  MutexLock lock(&mu_);
  stopping = true;
}

void ServerState::end_request() {
  MutexLock lock(&mu_);
  if (--in_flight_ == 0) idle_cv_.notify_all();
}

bool ServerState::wait_idle(Deadline deadline) {
  MutexLock lock(&mu_);
  return idle_cv_.wait_until(&mu_, deadline.time_point(),
                             [this]() ECX_REQUIRES(mu_) { return in_flight_ == 0; });
}

namespace {

std::string error_body(int status, const std::string& type, const std::string& message) {
  return safe_dump(json{{"error", {{"message", message}, {"type", type}, {"code", status}}}});
}

HttpResponse error_response(int status, const std::string& type, const std::string& message) {
  HttpResponse res;
  res.status = status;
  res.set_content(error_body(status, type, message), "application/json");
  return res;
}

HttpRequest to_request(bhttp::request<bhttp::string_body>&& msg) {
  HttpRequest req;
  req.method = std::string(msg.method_string());
  std::string target(msg.target());
  auto q = target.find('?');
  req.path = target.substr(0, q);
  if (q != std::string::npos) req.query = target.substr(q + 1);
  for (const auto& field : msg) {
    req.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
  }
  req.body = std::move(msg.body());
  return req;
}

void log_request(const std::string& method, const std::string& path, int status, size_t in,
                 size_t out) {
  spdlog::info("method={} path={} status={} bytes_in={} bytes_out={}", method, path, status, in,
               out);
}

class Connection : public AdmittedConnection, public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& state, tcp::socket socket)
      : state_(state), client_(client_of(socket)), stream_(std::move(socket)) {}
  ~Connection() override {
    release_body();
    if (admitted_) state_.leave(client_, admission_);
  }

  void start() {
    admission_ = state_.admit(client_, weak_from_this());
    admitted_ = true;
    over_share_ = admission_.over_share;
    over_capacity_ = admission_.over_capacity;
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read_request(); });
  }

  void yield_if_waiting() override {
    net::post(stream_.get_executor(), [self = shared_from_this()] {
      // Idle, or its request's headers begun over kYieldableHeaderAge ago (a client sends
      // them at once; one that trickles them gives its place up). A request whose headers
      // are coming now is never cut.
      const bool late =
          self->header_begun_ &&
          std::chrono::steady_clock::now() - *self->header_begun_ > kYieldableHeaderAge;
      if (!self->waiting_ || (self->header_begun_ && !late)) return;
      self->state_.connections_yielded++;
      self->close();
    });
  }

  // For an async route's reply, from any thread: sends `res` on the strand (the request's
  // method, path and body size are for its log line).
  void post_send(HttpResponse res, std::string method, std::string path, size_t bytes_in) {
    net::post(stream_.get_executor(),
              [self = shared_from_this(), res = std::move(res), method = std::move(method),
               path = std::move(path), bytes_in]() mutable {
                self->send(std::move(res), std::move(method), std::move(path), bytes_in, true);
              });
  }
  // Sends head's status and headers, then the chunks of the returned stream until it
  // finishes. From a worker or an async reply.
  std::shared_ptr<ChunkStream> open_stream(const HttpResponse& head, const std::string& type);
  ServerState& state() { return state_; }

 private:
  // A request: its headers, then (within the body budget) its body.
  void read_request();
  void read_header();
  void on_header(beast::error_code ec);
  void read_body();
  void on_read(beast::error_code ec);
  // The read failed: a client that left or went quiet is closed; bad HTTP gets 400/413.
  void read_failed(beast::error_code ec);
  // 503: the body would pass --max-buffered-bytes (it is not read).
  void refuse_body(uint64_t bytes);
  // Gives back the request's share of the body budget (strand; once answered).
  void release_body() {
    if (reserved_ > 0) state_.release_body(reserved_);
    reserved_ = 0;
  }
  // Closes after refusing a body that was not read: drops what the client still sends
  // for a while first, so it reads the answer instead of a reset.
  void linger();
  void discard_some(const std::shared_ptr<std::array<char, 16384>>& sink);
  void route(HttpRequest req);
  void queue_work(const HttpHandler& handler, HttpRequest req);
  // Cancels `gone` when the client closes its connection while its request waits or
  // runs (until the next request is read).
  void watch_for_hang_up(const std::shared_ptr<ecx::http::Cancellation>& gone);
  void queue_async(const AsyncHandler& handler, HttpRequest req);
  // 503: the service's FIFO is full, or (over_share) this waiting request's place was
  // taken by another client's (its own client had more than its share waiting).
  void reject_busy(const HttpRequest& req, size_t max_queued, bool over_share);
  // What a waiting request does when its place is taken (from any thread): 503 on the
  // strand.
  std::function<void()> displaced_answer(const std::shared_ptr<HttpRequest>& req,
                                         size_t max_queued);
  // 503: this connection is past --max-connections.
  void refuse_work(const HttpRequest& req);
  void run_work(const HttpHandler& handler, const HttpRequest& req);
  // On the strand: writes `res`, then reads the next request or closes.
  void send(HttpResponse res, std::string method, std::string path, size_t bytes_in, bool counted);
  void close();

  // Streamed answers. start_stream runs on the worker; the rest on the strand.
  StreamWriter& start_stream(HttpResponse& res, const std::string& type);
  void watch_client(const std::shared_ptr<ChunkStream>& chunks);
  void pump(const std::shared_ptr<ChunkStream>& chunks);
  void end_stream(const std::shared_ptr<ChunkStream>& chunks, bool send_last);

  // The client's address: its share of connections is counted by it.
  static std::string client_of(const tcp::socket& socket) {
    beast::error_code ec;
    auto peer = socket.remote_endpoint(ec);
    return ec ? std::string("?") : peer.address().to_string();
  }
  // Takes the body budget up to kBodyStep bytes past what has arrived (never past what
  // the request declared); false when the budget has no room.
  bool reserve_more();
  void on_body_bytes(beast::error_code ec);

  ServerState& state_;
  const std::string client_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  unsigned version_ = 11;    // of the request being answered
  bool keep_alive_ = false;  // of the request being answered
  // The request being answered, for its log line (strand only).
  std::string method_, path_;
  size_t bytes_in_ = 0;
  int stream_status_ = 200;
  std::shared_ptr<ChunkStream> chunks_;  // the streamed answer, once started
  // Opened past its client's share, or past --max-connections: one request (work
  // refused), then closed.
  bool over_share_ = false;
  bool over_capacity_ = false;
  Admission admission_;
  bool admitted_ = false;
  bool waiting_ = false;  // (strand) for a request's headers, or idle between requests
  // (strand) when the request being read sent its first byte; none while idle.
  std::optional<std::chrono::steady_clock::time_point> header_begun_;
  std::chrono::steady_clock::time_point body_deadline_;  // (strand) the body is in by then
  uint64_t declared_ = 0;       // body bytes the request being read announced (or may send)
  uint64_t reserved_ = 0;       // of the body budget, for the request being answered
  bool linger_ = false;         // its body was refused unread: linger() once answered
  uint64_t requests_read_ = 0;  // (strand) a hang-up watch ends once the next is read
};

// The body budget is charged in steps of this many bytes as a body arrives, and each
// byte kBodyCopies times: the body, its parsed form and what is made of it (decoded
// images, the re-encoded request a proxy forwards) together stay within the budget.
constexpr uint64_t kBodyStep = 64 << 10;
constexpr uint64_t kBodyCopies = 4;
// Longest a body may pause between two reads before the connection is closed.
constexpr std::chrono::seconds kBodyStepTimeout{10};
// A body must arrive whole within kBodyTime plus a second per kBodyRate bytes it
// declared: one that trickles in a byte at a time cannot hold its connection forever.
constexpr std::chrono::seconds kBodyTime{30};
constexpr uint64_t kBodyRate = 256 << 10;
// Once a request's first byte is in, its headers must be whole within this.
constexpr std::chrono::seconds kHeaderTimeout{10};

// How long a connection whose body was refused unread drops what still comes.
constexpr std::chrono::seconds kLinger{2};

// How long a connection opened past --max-connections may take to send its request.
constexpr std::chrono::seconds kOverCapacityRequestWait{5};

// Idle until a request's first byte (--idle-timeout), then its headers within
// kHeaderTimeout: a client that trickles them cannot hold its connection for long.
void Connection::read_request() {
  requests_read_++;
  parser_.emplace();
  parser_->body_limit(state_.max_body_bytes);
  parser_->header_limit(64 * 1024);
  waiting_ = true;
  header_begun_.reset();
  if (buffer_.size() > 0) return read_header();  // a pipelined request has begun
  stream_.expires_after(over_capacity_ ? kOverCapacityRequestWait : state_.idle_timeout);
  stream_.async_read_some(buffer_.prepare(16 << 10),
                          [self = shared_from_this()](beast::error_code ec, size_t n) {
                            if (ec) return self->read_failed(ec);
                            self->buffer_.commit(n);
                            self->read_header();
                          });
}

void Connection::read_header() {
  header_begun_ = std::chrono::steady_clock::now();
  stream_.expires_after(over_capacity_ ? kOverCapacityRequestWait : kHeaderTimeout);
  bhttp::async_read_header(
      stream_, buffer_, *parser_,
      [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
}

void Connection::on_header(beast::error_code ec) {
  waiting_ = false;
  if (ec) return read_failed(ec);
  // A length over --max-body-bytes has failed above; a chunked body may be up to it.
  uint64_t bytes =
      parser_->content_length().value_or(parser_->chunked() ? state_.max_body_bytes : 0);
  declared_ = bytes;
  body_deadline_ =
      std::chrono::steady_clock::now() + kBodyTime + std::chrono::seconds(bytes / kBodyRate);
  const auto& head = parser_->get();
  const bool wants_go_ahead = beast::iequals(head[bhttp::field::expect], "100-continue");
  if (bytes > 0) {
    // The budget is charged as the body arrives (reserve_more), one step ahead: headers
    // that announce a large body and send nothing hold one step, until
    // kBodyStepTimeout. Refused before the body is sent: one that could never fit, and,
    // for a client that waits for the go-ahead, one that does not fit now.
    const uint64_t whole = bytes * kBodyCopies;
    const bool known = parser_->content_length().has_value();
    if (known && whole > state_.max_buffered_bytes) {
      keep_alive_ = false;
      linger_ = true;
      version_ = head.version();
      return send(error_response(413, "request_too_large",
                                 "a body of " + std::to_string(bytes) + " bytes takes " +
                                     std::to_string(whole) + " of the " +
                                     std::to_string(state_.max_buffered_bytes) +
                                     " bytes --max-buffered-bytes allows (4 per body byte)"),
                  std::string(head.method_string()), std::string(head.target()), 0, false);
    }
    if ((wants_go_ahead && !state_.has_room(whole)) || !reserve_more()) {
      return refuse_body(bytes);
    }
  }
  if (bytes == 0 || !wants_go_ahead) return read_body();
  // The client waits for a go-ahead before it sends the body (curl does past 1 MiB).
  auto go_ahead = std::make_shared<bhttp::response<bhttp::empty_body>>(bhttp::status::continue_,
                                                                       head.version());
  bhttp::async_write(stream_, *go_ahead,
                     [self = shared_from_this(), go_ahead](beast::error_code e, size_t) {
                       if (e) return self->close();
                       self->read_body();
                     });
}

bool Connection::reserve_more() {
  uint64_t arrived = parser_->get().body().size();
  uint64_t want = std::min(declared_, arrived + kBodyStep) * kBodyCopies;
  if (want <= reserved_) return true;
  if (!state_.reserve_body(want - reserved_)) return false;
  reserved_ = want;
  return true;
}

void Connection::read_body() {
  if (parser_->is_done()) return on_read({});
  // The body must keep coming, and be whole by its deadline: a client that stalls or
  // trickles it loses the connection.
  auto left = body_deadline_ - std::chrono::steady_clock::now();
  stream_.expires_after(std::min<std::chrono::steady_clock::duration>(kBodyStepTimeout, left));
  bhttp::async_read_some(
      stream_, buffer_, *parser_,
      [self = shared_from_this()](beast::error_code ec, size_t) { self->on_body_bytes(ec); });
}

void Connection::on_body_bytes(beast::error_code ec) {
  if (ec) return read_failed(ec);
  if (parser_->is_done()) return on_read({});
  if (!reserve_more()) return refuse_body(declared_);
  read_body();
}

void Connection::refuse_body(uint64_t bytes) {
  state_.buffered_rejected++;
  const auto& head = parser_->get();
  version_ = head.version();
  keep_alive_ = false;
  linger_ = true;
  HttpResponse res = error_response(
      503, "server_busy",
      state_.role + " holds " + std::to_string(state_.buffered_bytes()) +
          " bytes of request bodies; this one's " + std::to_string(bytes) + " would pass " +
          std::to_string(state_.max_buffered_bytes) + " (--max-buffered-bytes); retry later");
  res.set_header("Retry-After", "1");
  std::string method(head.method_string()), target(head.target());
  parser_.reset();  // what arrived of the body goes now, and its share of the budget with it
  send(std::move(res), std::move(method), std::move(target), 0, false);
}

void Connection::linger() {
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  stream_.expires_after(kLinger);
  discard_some(std::make_shared<std::array<char, 16384>>());
}

void Connection::discard_some(const std::shared_ptr<std::array<char, 16384>>& sink) {
  stream_.async_read_some(net::buffer(*sink),
                          [self = shared_from_this(), sink](beast::error_code ec, size_t) {
                            if (ec) return self->close();
                            self->discard_some(sink);
                          });
}

void Connection::on_read(beast::error_code ec) {
  if (ec) return read_failed(ec);
  auto msg = parser_->release();
  version_ = msg.version();
  keep_alive_ = msg.keep_alive() && !over_capacity_;
  route(to_request(std::move(msg)));
}

void Connection::read_failed(beast::error_code ec) {
  if (ec == bhttp::error::end_of_stream || ec == beast::error::timeout ||
      ec == net::error::operation_aborted || ec == net::error::connection_reset ||
      ec == net::error::eof) {
    return close();
  }
  // The client sent too much or something that is not HTTP: say so, then close.
  keep_alive_ = false;
  version_ = 11;
  bool too_large = ec == bhttp::error::body_limit || ec == bhttp::error::header_limit;
  int status = too_large ? 413 : 400;
  std::string what = too_large ? "request larger than " + std::to_string(state_.max_body_bytes) +
                                     " bytes (--max-body-bytes)"
                               : "bad HTTP request: " + ec.message();
  return send(error_response(status, too_large ? "request_too_large" : "invalid_request", what),
              "?", "?", 0, false);
}

void Connection::route(HttpRequest req) {
  method_ = req.method;
  path_ = req.path;
  bytes_in_ = req.body.size();
  auto it = state_.routes.find({req.method, req.path});
  if (it == state_.routes.end()) {
    bool known_path = false;
    for (const auto& [key, r] : state_.routes) known_path |= key.second == req.path;
    int status = known_path ? 405 : 404;
    return send(error_response(status, known_path ? "method_not_allowed" : "not_found",
                               "no route " + req.method + " " + req.path),
                req.method, req.path, req.body.size(), false);
  }
  if (over_capacity_ && !it->second.fast) return refuse_work(req);
  if (it->second.async) return queue_async(it->second.async, std::move(req));
  if (!it->second.fast) return queue_work(it->second.handler, std::move(req));
  HttpResponse res;
  res.set_stream_starter([](HttpResponse&, const std::string&) -> StreamWriter& {
    throw std::logic_error("a fast route cannot stream");
  });
  try {
    it->second.handler(req, res);
  } catch (const std::exception& e) {
    res = error_response(500, "internal_error", e.what());
  }
  send(std::move(res), req.method, req.path, req.body.size(), false);
}

void Connection::queue_work(const HttpHandler& handler, HttpRequest req) {
  if (!state_.try_begin_request()) {  // stopping
    keep_alive_ = false;
    return send(error_response(503, "unavailable", state_.role + " is shutting down"), req.method,
                req.path, req.body.size(), false);
  }
  auto gone = std::make_shared<ecx::http::Cancellation>();
  req.client_gone = gone;
  auto shared = std::make_shared<HttpRequest>(std::move(req));
  const size_t max_queued = state_.queue->max_queued();
  bool admitted = state_.queue->push(
      client_, [self = shared_from_this(), &handler, shared] { self->run_work(handler, *shared); },
      displaced_answer(shared, max_queued));
  if (!admitted) return reject_busy(*shared, max_queued, /*over_share=*/false);
  watch_for_hang_up(gone);
}

void Connection::watch_for_hang_up(const std::shared_ptr<ecx::http::Cancellation>& gone) {
  stream_.socket().async_wait(
      tcp::socket::wait_read,
      [self = shared_from_this(), gone, request = requests_read_](beast::error_code ec) {
        // Answered, and the next request is being read: nothing to watch for any more.
        if (ec == net::error::operation_aborted || self->requests_read_ != request) return;
        // Asked of the kernel, not of the wake-up (which may be spurious): the end of the
        // stream, or a reset, is a client that left. Bytes (a pipelined request) are
        // not, and stop the watch; nothing yet means it is still there: watch again.
        char byte;
        ssize_t n =
            ::recv(self->stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          gone->cancel();
        } else if (n < 0 && !gone->cancelled()) {
          self->watch_for_hang_up(gone);
        }
      });
}

void Connection::reject_busy(const HttpRequest& req, size_t max_queued, bool over_share) {
  state_.end_request();
  state_.rejected++;
  const std::string queue = std::to_string(max_queued);
  HttpResponse res = error_response(
      503, "server_busy",
      over_share ? "this client (" + client_ + ") had more than its share of " + state_.role +
                       "'s queue waiting (" + std::to_string(queue_share(max_queued)) +
                       " of --max-queued " + queue +
                       ") when it was full and another client came; retry later"
                 : state_.role + " is at capacity: " + queue +
                       " requests are waiting (--max-queued); retry later");
  res.set_header("Retry-After", "1");
  send(std::move(res), req.method, req.path, req.body.size(), false);
}

std::function<void()> Connection::displaced_answer(const std::shared_ptr<HttpRequest>& req,
                                                   size_t max_queued) {
  return [self = shared_from_this(), req, max_queued] {
    net::post(self->stream_.get_executor(), [self, req, max_queued] {
      self->reject_busy(*req, max_queued, /*over_share=*/true);
    });
  };
}

void Connection::refuse_work(const HttpRequest& req) {
  state_.connections_refused++;
  HttpResponse res = error_response(
      503, "server_busy",
      over_share_ ? "this client (" + client_ + ") holds more than its share of " + state_.role +
                        "'s connections (" + std::to_string(state_.client_share()) +
                        ", a quarter of --max-connections); retry later"
                  : state_.role + " holds " + std::to_string(state_.max_connections) +
                        " connections, its limit (--max-connections, or the open-files limit); "
                        "retry later");
  res.set_header("Retry-After", "1");
  send(std::move(res), req.method, req.path, req.body.size(), false);
}

// How an async route answers on this connection; the slot it holds is freed once it has
// answered (or ended its stream).
//
// It is answered from any thread, often another service's (the proxy's HTTP client's).
// Once the answer is written the server may be idle, stop, and free its state and its I/O
// context, and that can happen before the answering thread runs its next instruction:
// the connection it still holds, or even the strand executor its post made, would then
// be destroyed by that thread into freed memory (ASan saw it in the proxy's SIGTERM test).
// So the reply counts as a request in flight of its own, from when it is made until the
// end of the call that answers (respond, or end_stream): the server waits for it, and the
// answering thread touches nothing of the server's after that.
class ConnectionReply final : public AsyncReply {
 public:
  // (Keeps only what the request's log line needs: the handler may take its body.)
  ConnectionReply(std::shared_ptr<Connection> conn, SlotQueue::Done done, const HttpRequest& req)
      : conn_(std::move(conn)),
        state_(conn_->state()),
        done_(std::move(done)),
        method_(req.method),
        path_(req.path),
        bytes_in_(req.body.size()) {
    state_.begin_request();
  }
  ~ConnectionReply() override {
    if (stream_) {
      end_stream();
    } else {
      respond(error_response(500, "internal_error", "the request ended without an answer"));
    }
  }

  void respond(HttpResponse res) override {
    if (answered_.exchange(true)) return;
    conn_->post_send(std::move(res), method_, path_, bytes_in_);
    conn_.reset();
    done_();
    state_.end_request();  // the last touch of the server's: it may be gone after
  }
  AsyncStreamWriter& start_stream(const HttpResponse& head, const std::string& type) override {
    if (answered_.exchange(true)) {
      // Answered already (or streaming): a stream that takes nothing, and no second end.
      refused_ = std::make_shared<ChunkStream>(1, std::chrono::seconds(1));
      refused_->mark_gone();
      return *refused_;
    }
    stream_ = conn_->open_stream(head, type);
    return *stream_;
  }
  void end_stream() override {
    if (!stream_ || ended_.exchange(true)) return;
    stream_->finish();  // while conn_ keeps the connection alive: it posts the end
    conn_.reset();
    done_();
    state_.end_request();  // as in respond()
  }

 private:
  std::shared_ptr<Connection> conn_;
  ServerState& state_;
  SlotQueue::Done done_;
  const std::string method_, path_;
  const size_t bytes_in_;
  std::shared_ptr<ChunkStream> stream_;
  std::shared_ptr<ChunkStream> refused_;  // start_stream's after an answer
  std::atomic<bool> answered_{false};
  std::atomic<bool> ended_{false};
};

void Connection::queue_async(const AsyncHandler& handler, HttpRequest req) {
  if (!state_.try_begin_request()) {  // stopping
    keep_alive_ = false;
    return send(error_response(503, "unavailable", state_.role + " is shutting down"), req.method,
                req.path, req.body.size(), false);
  }
  auto gone = std::make_shared<ecx::http::Cancellation>();
  req.client_gone = gone;
  auto shared = std::make_shared<HttpRequest>(std::move(req));
  const size_t max_queued = state_.slots->max_queued();
  bool admitted = state_.slots->push(
      client_,
      [self = shared_from_this(), &handler, shared](SlotQueue::Done done) {
        auto reply = std::make_shared<ConnectionReply>(self, std::move(done), *shared);
        try {
          handler(shared, reply);
        } catch (const std::exception& e) {
          reply->respond(error_response(500, "internal_error", e.what()));
        }
      },
      displaced_answer(shared, max_queued));
  if (!admitted) return reject_busy(*shared, max_queued, /*over_share=*/false);
  watch_for_hang_up(gone);
}

// On a worker thread.
void Connection::run_work(const HttpHandler& handler, const HttpRequest& req) {
  HttpResponse res;
  if (req.abandoned()) {  // its client left while it waited: nobody to do it for
    state_.abandoned++;
    keep_alive_ = false;
    res = error_response(499, "client_closed_request", "the client closed its connection");
    net::post(stream_.get_executor(), [self = shared_from_this(), res = std::move(res),
                                       method = req.method, path = req.path]() mutable {
      self->send(std::move(res), std::move(method), std::move(path), 0, true);
    });
    return;
  }
  res.set_stream_starter([this](HttpResponse& r, const std::string& type) -> StreamWriter& {
    return start_stream(r, type);
  });
  try {
    handler(req, res);
  } catch (const std::exception& e) {
    if (!res.streaming()) res = error_response(500, "internal_error", e.what());
  }
  if (res.streaming()) return chunks_->finish();
  net::post(stream_.get_executor(),
            [self = shared_from_this(), res = std::move(res), method = req.method, path = req.path,
             n = req.body.size()]() mutable {
              self->send(std::move(res), std::move(method), std::move(path), n, true);
            });
}

void Connection::send(HttpResponse res, std::string method, std::string path, size_t bytes_in,
                      bool counted) {
  auto msg = std::make_shared<bhttp::response<bhttp::string_body>>();
  msg->version(version_);
  msg->result(static_cast<unsigned>(res.status));
  msg->set(bhttp::field::content_type, res.content_type);
  for (const auto& [name, value] : res.headers) msg->set(name, value);
  msg->keep_alive(keep_alive_ && !state_.stopping);
  msg->body() = std::move(res.body);
  msg->prepare_payload();
  log_request(method, path, res.status, bytes_in, msg->body().size());
  // The request's body (and what was made of it) is done with once it is answered: its
  // share of the budget is given back now, before the client can send the next one.
  release_body();
  stream_.expires_after(state_.write_timeout);
  bhttp::async_write(stream_, *msg,
                     [self = shared_from_this(), msg, counted](beast::error_code ec, size_t) {
                       if (counted) self->state_.end_request();
                       if (!ec && self->linger_) return self->linger();
                       if (ec || !msg->keep_alive()) return self->close();
                       self->read_request();
                     });
}

void Connection::close() {
  beast::error_code ignored;
  stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
  stream_.socket().close(ignored);
}

// On the worker: the headers go out on the strand; chunks wait until they have.
StreamWriter& Connection::start_stream(HttpResponse& res, const std::string& type) {
  res.mark_streaming();
  return *open_stream(res, type);
}

std::shared_ptr<ChunkStream> Connection::open_stream(const HttpResponse& res,
                                                     const std::string& type) {
  auto chunks = std::make_shared<ChunkStream>(state_.stream_buffer_bytes, state_.write_timeout);
  chunks->wake = [weak = std::weak_ptr<Connection>(shared_from_this())] {
    if (auto self = weak.lock()) {
      net::post(self->stream_.get_executor(), [self] { self->pump(self->chunks_); });
    }
  };
  chunks_ = chunks;  // read by the strand only after the post below
  auto header = std::make_shared<bhttp::response<bhttp::empty_body>>();
  header->version(version_);
  header->result(static_cast<unsigned>(res.status));
  header->set(bhttp::field::content_type, type);
  header->set(bhttp::field::cache_control, "no-cache");
  for (const auto& [name, value] : res.headers) header->set(name, value);
  header->keep_alive(false);  // one streamed answer per connection: its end is the close
  header->chunked(true);
  stream_status_ = res.status;
  net::post(stream_.get_executor(), [self = shared_from_this(), header, chunks] {
    auto sr = std::make_shared<bhttp::response_serializer<bhttp::empty_body>>(*header);
    self->stream_.expires_after(self->state_.write_timeout);
    bhttp::async_write_header(self->stream_, *sr,
                              [self, header, sr, chunks](beast::error_code ec, size_t) {
                                if (ec)
                                  chunks->mark_gone();
                                else
                                  self->watch_client(chunks);
                                self->pump(chunks);
                              });
  });
  return chunks;
}

// A client that closes its connection mid-stream makes the socket readable (EOF).
void Connection::watch_client(const std::shared_ptr<ChunkStream>& chunks) {
  stream_.socket().async_wait(tcp::socket::wait_read,
                              [self = shared_from_this(), chunks](beast::error_code ec) {
                                if (ec == net::error::operation_aborted) return;
                                beast::error_code avail_ec;
                                size_t n = self->stream_.socket().available(avail_ec);
                                if (ec || avail_ec || n == 0) chunks->mark_gone();
                              });
}

void Connection::pump(const std::shared_ptr<ChunkStream>& chunks) {
  auto data = std::make_shared<std::string>();
  bool ended = false, gone = false;
  if (!chunks->take(data.get(), &ended, &gone)) return;
  if (gone) return end_stream(chunks, false);
  if (data->empty()) return end_stream(chunks, ended);
  stream_.expires_after(state_.write_timeout);
  net::async_write(stream_, bhttp::make_chunk(net::buffer(*data)),
                   [self = shared_from_this(), chunks, data](beast::error_code ec, size_t) {
                     if (ec) chunks->mark_gone();
                     self->pump(chunks);
                   });
}

// The worker has finished: the last chunk (unless the client is gone), the log line, the
// close.
void Connection::end_stream(const std::shared_ptr<ChunkStream>& chunks, bool send_last) {
  auto done = [self = shared_from_this(), chunks] {
    log_request(self->method_, self->path_, self->stream_status_, self->bytes_in_,
                chunks->bytes_written());
    self->state_.end_request();
    self->release_body();
    self->close();
  };
  if (!send_last) return done();
  stream_.expires_after(state_.write_timeout);
  net::async_write(stream_, bhttp::make_chunk_last(),
                   [done](beast::error_code, size_t) { done(); });
}

}  // namespace

void serve_connection(ServerState& state, tcp::socket socket) {
  std::make_shared<Connection>(state, std::move(socket))->start();
}

}  // namespace ecx::serve
