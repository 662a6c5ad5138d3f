// Reading a connection's requests (connection.h): the headers, then the body within the
// body budget, each against its deadline; what cannot be read is answered 400/413/503.

#include "http_server/connection.h"

namespace ecx::serve {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

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

}  // namespace

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

}  // namespace ecx::serve
