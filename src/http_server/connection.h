// Inside the HTTP server (http_server/http_server.h), like http_server/http_connection.h: one HTTP
// connection on Boost.Beast. connection_read.cc reads its requests; http_connection.cc answers
// them.
#pragma once

#include <array>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "http_server/chunk_stream.h"
#include "http_server/http_connection.h"

namespace ecx::serve {

// An error answer: {"error": {"message", "type", "code"}}.
HttpResponse error_response(int status, const std::string& type, const std::string& message);
// The log line of an answered request (info).
void log_request(const std::string& method, const std::string& path, int status, size_t in,
                 size_t out);

// A connection whose request's headers began this long ago and are not whole may be
// asked to make room for a newcomer (ServerState::admit).
inline constexpr std::chrono::seconds kYieldableHeaderAge{1};

// Lifetime: a connection is owned by what is pending on its strand. Each asynchronous
// read, write, wait or post of its own holds it (a shared_ptr), and so does work running
// for it elsewhere until it has posted its answer back: a worker's task (queue_work), an
// async route's reply (ConnectionReply), a waiting request's displaced answer. Nothing
// else keeps it: admission holds a weak_ptr (yield_if_waiting posts to the strand), and
// the server holds none. It ends when the last of these has run: closed, nothing pending.
// Its state is touched on the strand only, except where a member says otherwise.
class Connection : public AdmittedConnection, public std::enable_shared_from_this<Connection> {
 public:
  Connection(ServerState& state, boost::asio::ip::tcp::socket socket)
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
    boost::asio::dispatch(stream_.get_executor(),
                          [self = shared_from_this()] { self->read_request(); });
  }

  void yield_if_waiting() override {
    boost::asio::post(stream_.get_executor(), [self = shared_from_this()] {
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
    boost::asio::post(stream_.get_executor(), [self = shared_from_this(), res = std::move(res),
                                               method = std::move(method), path = std::move(path),
                                               bytes_in]() mutable {
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
  void on_header(boost::beast::error_code ec);
  void read_body();
  void on_read(boost::beast::error_code ec);
  // The read failed: a client that left or went quiet is closed; bad HTTP gets 400/413.
  void read_failed(boost::beast::error_code ec);
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
  template <class Queue, class MakeTask>
  void enqueue(Queue& queue, HttpRequest req, const MakeTask& make_task);
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
  static std::string client_of(const boost::asio::ip::tcp::socket& socket) {
    boost::beast::error_code ec;
    auto peer = socket.remote_endpoint(ec);
    return ec ? std::string("?") : peer.address().to_string();
  }
  // Takes the body budget up to kBodyStep bytes past what has arrived (never past what
  // the request declared); false when the budget has no room.
  bool reserve_more();
  void on_body_bytes(boost::beast::error_code ec);

  ServerState& state_;
  const std::string client_;
  boost::beast::tcp_stream stream_;
  boost::beast::flat_buffer buffer_;
  std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser_;
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

}  // namespace ecx::serve
