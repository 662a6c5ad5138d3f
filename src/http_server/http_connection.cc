// Answering a connection's requests (connection.h; connection_read.cc reads them): a fast
// route on this I/O thread, a work route queued for a worker, an async route in a slot;
// then the answer is written and the next request read on the same connection
// (keep-alive). A streamed answer goes out as
// chunks handed over by the worker through a bounded buffer (ChunkStream); while it is
// sent the socket is watched, so the worker learns at once when the client has gone.
#include "http_server/connection.h"

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

namespace ecx::serve {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

namespace {

std::string error_body(int status, const std::string& type, const std::string& message) {
  return safe_dump(json{{"error", {{"message", message}, {"type", type}, {"code", status}}}});
}

}  // namespace

HttpResponse error_response(int status, const std::string& type, const std::string& message) {
  HttpResponse res;
  res.status = status;
  res.set_content(error_body(status, type, message), "application/json");
  return res;
}

void log_request(const std::string& method, const std::string& path, int status, size_t in,
                 size_t out) {
  spdlog::info("method={} path={} status={} bytes_in={} bytes_out={}", method, path, status, in,
               out);
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

// Admits `req` to `queue` (the workers' FIFO, or the async routes' slots) as the task
// `make_task(request)` makes: 503 while the server stops or when the queue is full;
// once queued, the client's hang-up cancels it.
template <class Queue, class MakeTask>
void Connection::enqueue(Queue& queue, HttpRequest req, const MakeTask& make_task) {
  if (!state_.try_begin_request()) {  // stopping
    keep_alive_ = false;
    return send(error_response(503, "unavailable", state_.role + " is shutting down"), req.method,
                req.path, req.body.size(), false);
  }
  auto gone = std::make_shared<ecx::http::Cancellation>();
  req.client_gone = gone;
  auto shared = std::make_shared<HttpRequest>(std::move(req));
  const size_t max_queued = queue.max_queued();
  if (!queue.push(client_, make_task(shared), displaced_answer(shared, max_queued))) {
    return reject_busy(*shared, max_queued, /*over_share=*/false);
  }
  watch_for_hang_up(gone);
}

void Connection::queue_work(const HttpHandler& handler, HttpRequest req) {
  enqueue(*state_.queue, std::move(req), [&](const std::shared_ptr<HttpRequest>& shared) {
    return [self = shared_from_this(), &handler, shared] { self->run_work(handler, *shared); };
  });
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

namespace {

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

}  // namespace

void Connection::queue_async(const AsyncHandler& handler, HttpRequest req) {
  enqueue(*state_.slots, std::move(req), [&](const std::shared_ptr<HttpRequest>& shared) {
    return [self = shared_from_this(), &handler, shared](SlotQueue::Done done) {
      auto reply = std::make_shared<ConnectionReply>(self, std::move(done), *shared);
      try {
        handler(shared, reply);
      } catch (const std::exception& e) {
        reply->respond(error_response(500, "internal_error", e.what()));
      }
    };
  });
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

void serve_connection(ServerState& state, tcp::socket socket) {
  std::make_shared<Connection>(state, std::move(socket))->start();
}

}  // namespace ecx::serve
