// What a service's handlers see of HTTP: one request, one response, and for a streamed
// answer (SSE) a writer. The server (http_server/http_server.h) fills the request, runs the
// handler and sends what it left in the response.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "http/cancellation.h"

namespace ecx::serve {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // the target up to '?'
  std::string query;   // the target after '?', undecoded ("" when none)
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // Set by the server when the client has gone (closed its connection) while its
  // request waited or ran: work for it may stop at its next step (abandoned()), and calls
  // made for it may be told (http::Cancellation::on_cancel).
  std::shared_ptr<http::Cancellation> client_gone;

  // The first header called `name` (case-insensitive), or "" when there is none.
  std::string header(std::string_view name) const;
  bool abandoned() const { return client_gone && client_gone->cancelled(); }
};

// The body of a streamed answer, written chunk by chunk from the worker thread that runs
// the handler. The chunks go to the connection's I/O thread through a bounded buffer.
class StreamWriter {
 public:
  virtual ~StreamWriter() = default;
  // Queues `chunk` for the client; blocks while the buffer is full. False once the
  // client has gone (closed its connection, or stopped reading past the write timeout):
  // the handler should then stop producing and give back what it holds.
  virtual bool write(std::string_view chunk) = 0;
  // True once the client has gone; what write() would answer, without writing.
  virtual bool client_gone() const = 0;
};

class HttpResponse {
 public:
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // beyond Content-Type/Length

  void set_content(std::string content, std::string type) {
    body = std::move(content);
    content_type = std::move(type);
  }
  void set_header(std::string name, std::string value) {
    headers.emplace_back(std::move(name), std::move(value));
  }

  // Sends `status` and the headers now (chunked, `type`) and returns the writer of the
  // body; the answer ends when the handler returns. Only on work routes (the server
  // answers a fast route's handler that calls it with a 500). `body` is then unused.
  StreamWriter& start_stream(const std::string& type) { return start_stream_(*this, type); }
  bool streaming() const { return streaming_; }

  // Set by the server: what start_stream does on this connection.
  using StreamStarter = std::function<StreamWriter&(HttpResponse&, const std::string&)>;
  void set_stream_starter(StreamStarter starter) { start_stream_ = std::move(starter); }
  void mark_streaming() { streaming_ = true; }

 private:
  StreamStarter start_stream_;
  bool streaming_ = false;
};

// A route's handler. Work routes run on the service's worker threads; fast routes on an
// I/O thread, so they must not block.
using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

// The body of a streamed answer of an async route. Never blocks: the producer pauses
// while the buffer is full and is told when there is room again.
class AsyncStreamWriter {
 public:
  virtual ~AsyncStreamWriter() = default;
  // Queues `chunk` for the client. False once the client has gone (closed its connection,
  // or stopped reading past the write timeout): stop producing.
  virtual bool push(std::string_view chunk) = 0;
  // True while less than the stream's buffer waits to go out.
  virtual bool has_room() const = 0;
  // Calls `ready` once, from any thread (or at once), when there is room or the client
  // has gone.
  virtual void when_room(std::function<void()> ready) = 0;
  virtual bool client_gone() const = 0;
};

// How an async route answers, once, from any thread: respond(), or start_stream() and
// later end_stream(). Dropped without an answer, it answers 500 (or ends the stream).
class AsyncReply {
 public:
  virtual ~AsyncReply() = default;
  virtual void respond(HttpResponse res) = 0;
  // Sends head.status and head.headers and returns the writer of a chunked body of
  // `type`.
  virtual AsyncStreamWriter& start_stream(const HttpResponse& head, const std::string& type) = 0;
  // The streamed answer is complete: the last chunk goes out, then the connection closes.
  virtual void end_stream() = 0;
};

// An async route's handler: runs on an I/O thread, must not block, and answers through
// `reply` whenever it is ready (typically from a callback of asynchronous I/O). The
// request is the handler's: it may take the body (to free it once parsed).
using AsyncHandler =
    std::function<void(std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply)>;

}  // namespace ecx::serve
