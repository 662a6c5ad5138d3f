// The proxy's HTTP client: asynchronous (Boost.Beast on Asio, on a few threads of its
// own) with a pool of keep-alive connections per upstream. No call holds a thread while
// it waits, and most calls reuse a connection instead of opening one.
//
// Every call ends exactly once, on a client thread, with the answer or the reason none
// came: it could not connect (nothing was sent, so another upstream may take it), it ran
// past its deadline, or the connection failed mid-way. A pooled connection the upstream
// closed while it sat idle is noticed before it is used (and idle ones are dropped well
// before the services' --idle-timeout), and a call whose write fails on a pooled
// connection is sent once more on a new one. A call that fails after its request was
// written is not repeated: the upstream may have acted on it. A call whose caller has
// gone (ClientRequest::cancel) ends at once, its connection closed.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "http/cancellation.h"

namespace ecx::http {

struct ClientRequest {
  std::string method = "POST";
  std::string target;  // "/v1/encode"
  std::string body;
  std::string content_type = "application/json";
  std::chrono::milliseconds connect_timeout{3000};
  // Without streaming: the whole call, connect included. Streamed: until the headers,
  // then between two pieces of the body.
  std::chrono::milliseconds timeout{30000};
  // When set and cancelled (the caller's own client has gone), the call ends at once
  // (kCancelled) and its connection is closed: an upstream ecx service takes that as its
  // client gone and stops the work.
  std::shared_ptr<Cancellation> cancel;
  // Header lines beyond Host, Content-Type and Content-Length ({"Authorization", token}).
  std::vector<std::pair<std::string, std::string>> headers;
  // https: the upstream's certificate must chain to `ca_file` (PEM; empty: the system's
  // CAs) and name the host it was called by. A failed handshake is kConnect: nothing was
  // sent.
  bool tls = false;
  std::string ca_file;
};

enum class ClientError {
  kNone,
  kConnect,    // could not connect (refused, unreachable, connect timeout): nothing was sent
  kTimeout,    // connected, but the answer did not come in time
  kTransport,  // the connection failed mid-way, or the answer was not HTTP
  kTooLarge,   // the answer's body is over the client's limit
  kStopped,    // the receiver of a streamed body stopped it
  kCancelled,  // ClientRequest::cancel was set
};
const char* client_error_name(ClientError error);

struct ClientResult {
  ClientError error = ClientError::kNone;
  std::string message;  // what failed, when error is set
  int status = 0;       // the upstream's HTTP status; 0 when no answer came
  std::string body;     // the body, unless it was streamed to on_body
  bool ok() const { return error == ClientError::kNone; }
};

// What a streamed body's receiver wants next.
enum class BodyFlow { kContinue, kPause, kStop };

struct ClientStreaming {
  // The status, once the headers are in. True: the body goes to on_body as it comes;
  // false: it is collected into ClientResult::body (an error answer, say).
  std::function<bool(int status)> on_headers;
  // A piece of the body. kPause: nothing more is read until `resume` is called (once,
  // from any thread); kStop: the call ends (kStopped) and its connection is closed.
  std::function<BodyFlow(std::string_view piece, std::function<void()> resume)> on_body;
};

class HttpClient {
 public:
  struct Options {
    int threads = 2;
    size_t max_idle_per_upstream = 256;  // idle connections kept per host:port
    // An idle connection older than this is closed rather than used: below the
    // services' --idle-timeout (60 s), so the upstream rarely closes one first.
    std::chrono::seconds keep_idle{20};
    uint64_t max_body_bytes = 64ull << 20;
  };
  struct Counts {
    uint64_t connects = 0;  // connections opened
    uint64_t reuses = 0;    // calls sent on a pooled connection
    uint64_t idle = 0;      // pooled connections now
  };
  using Done = std::function<void(ClientResult)>;

  explicit HttpClient(Options options);
  // Stops the threads; calls still in flight end without their `done` being called.
  // Idempotent. The destructor stops it too; an owner whose callbacks use its other
  // members stops it first, explicitly.
  void stop();
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Sends `request` to host:port and calls `done` once with what came of it. With
  // `streaming.on_body`, the body is handed over as it arrives.
  void send(const std::string& host, int port, ClientRequest request, Done done,
            ClientStreaming streaming = {});

  // send(), waiting for its end: for a plain call at most connect_timeout + timeout (and
  // a margin); a streamed one ends by its own per-piece timeout or by request.cancel.
  // Never called on a client thread. Once it returns, `streaming`'s callbacks run no more.
  ClientResult call(const std::string& host, int port, ClientRequest request,
                    ClientStreaming streaming = {});

  // Runs `work` on a client thread (the proxy's request handling: JSON and images, kept
  // off the server's I/O threads so that /health never waits behind it).
  void post(std::function<void()> work);

  Counts counts() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ecx::http
