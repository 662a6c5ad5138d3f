#include "http/http_client.h"

#include <sys/socket.h>

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <map>
#include <optional>
#include <thread>
#include <variant>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/common/status.h"

namespace ecx::http {

namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace net = boost::asio;
namespace ssl = net::ssl;
using tcp = net::ip::tcp;
using TlsStream = ssl::stream<beast::tcp_stream>;

const char* client_error_name(ClientError error) {
  switch (error) {
    case ClientError::kNone:
      return "none";
    case ClientError::kConnect:
      return "connect";
    case ClientError::kTimeout:
      return "timeout";
    case ClientError::kTransport:
      return "transport";
    case ClientError::kTooLarge:
      return "too_large";
    case ClientError::kStopped:
      return "stopped";
    case ClientError::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

namespace {

// One connection to an upstream, on a strand of the client's io_context: plain TCP, or
// TLS over it (holding its context).
struct PooledConnection {
  PooledConnection(const net::any_io_executor& executor, std::shared_ptr<ssl::context> tls)
      : context(std::move(tls)) {
    if (context) {
      stream.emplace<TlsStream>(executor, *context);
    } else {
      stream.emplace<beast::tcp_stream>(executor);
    }
  }
  beast::tcp_stream& tcp() {
    if (auto* s = std::get_if<TlsStream>(&stream)) return s->next_layer();
    return std::get<beast::tcp_stream>(stream);
  }
  std::shared_ptr<ssl::context> context;  // before the stream: it outlives it
  std::variant<std::monostate, beast::tcp_stream, TlsStream> stream;
  beast::flat_buffer buffer;
  Clock::time_point idle_since;
};

// An idle connection is still usable when there is nothing to read on it: no EOF (the
// upstream closed it), no stray bytes.
bool still_open(PooledConnection& c) {
  if (!c.tcp().socket().is_open()) return false;
  char byte;
  ssize_t n = ::recv(c.tcp().socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

// The pool's key: scheme, host:port and, for https, whom it trusts.
std::string pool_key(const std::string& where, const ClientRequest& request) {
  return request.tls ? "https://" + where + "#" + request.ca_file : "http://" + where;
}

ClientError classify(const beast::error_code& ec) {
  if (ec == beast::error::timeout) return ClientError::kTimeout;
  if (ec == bhttp::error::body_limit) return ClientError::kTooLarge;
  return ClientError::kTransport;
}

}  // namespace

struct HttpClient::Impl {
  explicit Impl(const Options& o) : options(o), work(net::make_work_guard(ioc)) {}

  // A pooled connection to `key` that is still open, newest first; null when none.
  std::unique_ptr<PooledConnection> take(const std::string& key) ECX_EXCLUDES(mu) {
    MutexLock lock(&mu);
    auto it = idle.find(key);
    if (it == idle.end()) return nullptr;
    auto& list = it->second;
    while (!list.empty()) {
      std::unique_ptr<PooledConnection> c = std::move(list.back());
      list.pop_back();
      if (Clock::now() - c->idle_since < options.keep_idle && still_open(*c)) return c;
    }
    return nullptr;
  }

  // Keeps `c` for the next call to `key`, unless enough are kept already.
  void give_back(const std::string& key, std::unique_ptr<PooledConnection> c) ECX_EXCLUDES(mu) {
    c->idle_since = Clock::now();
    c->tcp().expires_never();
    MutexLock lock(&mu);
    auto& list = idle[key];  // oldest first
    while (!list.empty() && c->idle_since - list.front()->idle_since >= options.keep_idle) {
      list.erase(list.begin());
    }
    if (list.size() < options.max_idle_per_upstream) list.push_back(std::move(c));
  }

  // The TLS context trusting `ca_file` (empty: the system's CAs), made once.
  Result<std::shared_ptr<ssl::context>> tls_context(const std::string& ca_file) ECX_EXCLUDES(mu) {
    MutexLock lock(&mu);
    auto& context = tls_contexts[ca_file];
    if (context) return context;
    auto made = std::make_shared<ssl::context>(ssl::context::tls_client);
    made->set_verify_mode(ssl::verify_peer);
    beast::error_code ec;
    if (ca_file.empty()) {
      made->set_default_verify_paths(ec);
    } else {
      made->load_verify_file(ca_file, ec);
    }
    if (ec) return InvalidArgument("tls: the CA file '" + ca_file + "': " + ec.message());
    context = made;
    return context;
  }

  const Options options;
  // Before ioc: the calls its handlers still hold, destroyed with it, read it.
  std::atomic<bool> stopped{false};
  net::io_context ioc;
  net::executor_work_guard<net::io_context::executor_type> work;
  std::vector<std::thread> threads;
  mutable Mutex mu;
  std::map<std::string, std::vector<std::unique_ptr<PooledConnection>>> idle ECX_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<ssl::context>> tls_contexts ECX_GUARDED_BY(mu);
  std::atomic<uint64_t> connects{0};
  std::atomic<uint64_t> reuses{0};
};

namespace {

// One call: a connection (pooled or new), the request written, the answer read. Every
// handler runs on the connection's strand.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(HttpClient::Impl& impl, const std::string& host, int port, ClientRequest request,
           HttpClient::Done done, ClientStreaming streaming)
      : impl_(impl),
        host_(host),
        port_(port),
        where_(host + ":" + std::to_string(port)),
        key_(pool_key(where_, request)),
        request_(std::move(request)),
        done_(std::move(done)),
        streaming_(std::move(streaming)),
        deadline_(Clock::now() + request_.timeout) {
    msg_.method_string(request_.method);
    msg_.target(request_.target);
    msg_.version(11);
    msg_.set(bhttp::field::host, where_);
    if (!request_.body.empty() || request_.method == "POST") {
      msg_.set(bhttp::field::content_type, request_.content_type);
    }
    for (const auto& [name, value] : request_.headers) msg_.set(name, value);
    msg_.keep_alive(true);
    msg_.body() = std::move(request_.body);
    msg_.prepare_payload();
  }

  // The call ends exactly once: one that is dropped before it ended (a step that saw it
  // over, a resume() never called) ends here, cancelled.
  // (Not once the client has stopped: its callers' callbacks may be gone by then.)
  ~Exchange() {
    if (done_ && !impl_.stopped) {
      close();
      result_.error = ClientError::kCancelled;
      result_.message = "the call was dropped before it ended";
      done_(std::move(result_));
    }
  }

  void start() {
    conn_ = impl_.take(key_);
    reused_ = static_cast<bool>(conn_);
    if (reused_) {
      impl_.reuses++;
      conn_executor_ = conn_->tcp().get_executor();
    } else {
      conn_executor_ = net::make_strand(impl_.ioc);
      if (request_.tls) {
        auto context = impl_.tls_context(request_.ca_file);
        if (!context.ok()) {
          return net::post(conn_executor_, [self = shared_from_this(), why = context.status()] {
            self->fail(ClientError::kConnect, why.message(), {});
          });
        }
        tls_ = *context;
      }
      conn_ = std::make_unique<PooledConnection>(conn_executor_, tls_);
    }
    // Told before the first step is posted: a call whose caller is already gone ends
    // before anything is sent.
    if (request_.cancel) {
      request_.cancel->on_cancel([weak = weak_from_this(), executor = conn_executor_] {
        if (auto self = weak.lock()) {
          net::post(executor, [self] {
            self->fail(ClientError::kCancelled, "cancelled: the caller's client has gone", {});
          });
        }
      });
    }
    net::post(conn_executor_,
              [self = shared_from_this()] { self->reused_ ? self->write() : self->connect(); });
  }

 private:
  // True once the call has ended (answered or failed): a step still in flight does
  // nothing more. A call whose caller has gone ends here, at its next step, whether or
  // not the cancellation's callback has run yet.
  bool over() {
    if (done_ && request_.cancel && request_.cancel->cancelled()) {
      fail(ClientError::kCancelled, "cancelled: the caller's client has gone", {});
    }
    return !done_;
  }

  void connect() {
    if (over()) return;
    reused_ = false;
    impl_.connects++;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    conn_->tcp().expires_after(
        std::max(std::chrono::milliseconds(1), std::min(request_.connect_timeout, left)));
    beast::error_code ec;
    auto address = net::ip::make_address(host_, ec);
    if (!ec) {
      conn_->tcp().async_connect(
          tcp::endpoint(address, static_cast<uint16_t>(port_)),
          [self = shared_from_this()](beast::error_code e) { self->on_connected(e); });
      return;
    }
    resolver_.emplace(conn_->tcp().get_executor());
    resolver_->async_resolve(
        host_, std::to_string(port_),
        [self = shared_from_this()](beast::error_code e, tcp::resolver::results_type results) {
          if (e) return self->fail(ClientError::kConnect, "resolve " + self->where_, e);
          self->conn_->tcp().async_connect(
              results,
              [self](beast::error_code e2, const tcp::endpoint&) { self->on_connected(e2); });
        });
  }

  void on_connected(beast::error_code ec) {
    if (over()) return;
    if (ec) return fail(ClientError::kConnect, "connect to " + where_, ec);
    conn_->tcp().socket().set_option(tcp::no_delay(true), ec);
    auto* tls = std::get_if<TlsStream>(&conn_->stream);
    if (tls == nullptr) return write();
    // The name the certificate must carry (SNI too, unless the host is an address).
    tls->set_verify_callback(ssl::host_name_verification(host_));
    beast::error_code not_a_name;
    net::ip::make_address(host_, not_a_name);
    if (not_a_name) SSL_set_tlsext_host_name(tls->native_handle(), host_.c_str());
    tls->async_handshake(
        ssl::stream_base::client, [self = shared_from_this()](beast::error_code e) {
          if (self->over()) return;
          if (e) return self->fail(ClientError::kConnect, "tls handshake with " + self->where_, e);
          self->write();
        });
  }

  // Runs `op` on the connection's stream, TLS or not.
  template <class Op>
  void on_stream(Op&& op) {
    std::visit(
        [&](auto& stream) {
          if constexpr (!std::is_same_v<std::decay_t<decltype(stream)>, std::monostate>) op(stream);
        },
        conn_->stream);
  }

  void write() {
    if (over()) return;
    conn_->tcp().expires_at(deadline_);
    on_stream([&](auto& stream) {
      bhttp::async_write(stream, msg_, [self = shared_from_this()](beast::error_code ec, size_t) {
        self->on_written(ec);
      });
    });
  }

  void on_written(beast::error_code ec) {
    if (over()) return;  // ended meanwhile (its caller gone): its handler came late
    if (ec) {
      // A pooled connection the upstream had closed: it read none of it. Once more, new.
      if (reused_ && !retried_ && ec != beast::error::timeout) {
        retried_ = true;
        close();
        if (request_.tls && !tls_) return fail(ClientError::kConnect, "tls: no context", {});
        conn_ = std::make_unique<PooledConnection>(conn_executor_, tls_);
        return connect();
      }
      return fail(classify(ec), "send to " + where_, ec);
    }
    parser_.emplace();
    parser_->body_limit(impl_.options.max_body_bytes);
    on_stream([&](auto& stream) {
      bhttp::async_read_header(
          stream, conn_->buffer, *parser_,
          [self = shared_from_this()](beast::error_code e, size_t) { self->on_header(e); });
    });
  }

  void on_header(beast::error_code ec) {
    if (over()) return;  // ended meanwhile (its caller gone): its handler came late
    // (A length over the limit fails here, once the headers are in.)
    if (parser_->is_header_done()) result_.status = static_cast<int>(parser_->get().result_int());
    if (ec) return fail(classify(ec), "answer from " + where_, ec);
    bool stream = static_cast<bool>(streaming_.on_body);
    if (streaming_.on_headers) stream = streaming_.on_headers(result_.status) && stream;
    streaming_body_ = stream;
    read_body();
  }

  void read_body() {
    if (over()) return;
    if (parser_->is_done()) return finish(true);
    auto& body = parser_->get().body();
    body.data = piece_.data();
    body.size = piece_.size();
    // Streamed: each piece has the whole timeout (a long answer may take longer in all).
    if (streaming_body_) conn_->tcp().expires_after(request_.timeout);
    on_stream([&](auto& stream) {
      bhttp::async_read_some(
          stream, conn_->buffer, *parser_,
          [self = shared_from_this()](beast::error_code ec, size_t) { self->on_body(ec); });
    });
  }

  void on_body(beast::error_code ec) {
    if (over()) return;  // ended meanwhile (its caller gone): its handler came late
    if (ec == bhttp::error::need_buffer) ec = {};
    if (ec) return fail(classify(ec), "answer from " + where_, ec);
    size_t got = piece_.size() - parser_->get().body().size;
    if (!streaming_body_ || got == 0) {
      result_.body.append(piece_.data(), got);
      return read_body();
    }
    auto resume = [self = shared_from_this()] {
      net::post(self->conn_executor_, [self] { self->read_body(); });
    };
    switch (streaming_.on_body(std::string_view(piece_.data(), got), resume)) {
      case BodyFlow::kContinue:
        return read_body();
      case BodyFlow::kPause:
        return;  // resume() reads on
      case BodyFlow::kStop:
        return fail(ClientError::kStopped, "stopped by the receiver", {});
    }
  }

  void fail(ClientError error, const std::string& what, beast::error_code ec) {
    result_.error = error;
    result_.message = ec ? what + ": " + ec.message() : what;
    finish(false);
  }

  // Calls done once; a connection whose answer was read to its end (and that the
  // upstream keeps open) goes back to the pool first.
  void finish(bool reusable) {
    HttpClient::Done done = std::move(done_);
    done_ = nullptr;
    if (!done) return;
    reusable = reusable && parser_ && parser_->is_done() && parser_->get().keep_alive() &&
               conn_->buffer.size() == 0;
    if (reusable) {
      impl_.give_back(key_, std::move(conn_));
    } else {
      close();
    }
    done(std::move(result_));
  }

  void close() {
    if (!conn_) return;
    beast::error_code ignored;
    conn_->tcp().socket().shutdown(tcp::socket::shutdown_both, ignored);
    conn_->tcp().close();
  }

  HttpClient::Impl& impl_;
  const std::string host_;
  const int port_;
  const std::string where_;            // "host:port"
  const std::string key_;              // the pool's: pool_key()
  std::shared_ptr<ssl::context> tls_;  // for https
  ClientRequest request_;
  HttpClient::Done done_;
  ClientStreaming streaming_;
  const Clock::time_point deadline_;
  std::unique_ptr<PooledConnection> conn_;
  // The strand every handler runs on: the connection's, kept when a retry replaces it.
  net::any_io_executor conn_executor_;
  std::optional<tcp::resolver> resolver_;
  bool reused_ = false;
  bool retried_ = false;
  bool streaming_body_ = false;
  bhttp::request<bhttp::string_body> msg_;
  std::optional<bhttp::response_parser<bhttp::buffer_body>> parser_;
  std::array<char, 64 * 1024> piece_{};
  ClientResult result_;
};

}  // namespace

HttpClient::HttpClient(Options options) : impl_(std::make_unique<Impl>(options)) {
  for (int i = 0; i < std::max(1, options.threads); ++i) {
    impl_->threads.emplace_back([ioc = &impl_->ioc] { ioc->run(); });
  }
}

void HttpClient::stop() {
  impl_->stopped = true;
  impl_->work.reset();
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
}

HttpClient::~HttpClient() { stop(); }

void HttpClient::send(const std::string& host, int port, ClientRequest request, Done done,
                      ClientStreaming streaming) {
  auto exchange = std::make_shared<Exchange>(*impl_, host, port, std::move(request),
                                             std::move(done), std::move(streaming));
  exchange->start();
}

namespace {

// A call() in progress: its end, and whether its caller still waits for it (after
// which its streaming callbacks run no more).
struct Waiter {
  Mutex mu;
  CondVar cv;
  std::optional<ClientResult> result ECX_GUARDED_BY(mu);
  bool abandoned ECX_GUARDED_BY(mu) = false;
};

// `f` wrapped to run only while the waiter waits; under its lock, so that call() cannot
// return in the middle of one.
template <class R, class... Args>
std::function<R(Args...)> while_waited(std::shared_ptr<Waiter> waiter, std::function<R(Args...)> f,
                                       R otherwise) {
  if (!f) return nullptr;
  return [waiter = std::move(waiter), f = std::move(f), otherwise](Args... args) -> R {
    MutexLock lock(&waiter->mu);
    if (waiter->abandoned) return otherwise;
    return f(std::forward<Args>(args)...);
  };
}

}  // namespace

ClientResult HttpClient::call(const std::string& host, int port, ClientRequest request,
                              ClientStreaming streaming) {
  auto waiter = std::make_shared<Waiter>();
  const bool streamed = static_cast<bool>(streaming.on_body);
  // A plain call ends by its own deadline; this one only backs it up.
  const Clock::time_point limit =
      Clock::now() + request.connect_timeout + request.timeout + std::chrono::seconds(2);
  ClientStreaming wrapped;
  wrapped.on_headers = while_waited(waiter, std::move(streaming.on_headers), false);
  wrapped.on_body = while_waited(waiter, std::move(streaming.on_body), BodyFlow::kStop);
  send(
      host, port, std::move(request),
      [waiter](ClientResult result) {
        MutexLock lock(&waiter->mu);
        waiter->result = std::move(result);
        waiter->cv.notify_all();
      },
      std::move(wrapped));
  MutexLock lock(&waiter->mu);
  while (!waiter->result) {
    // Woken at least every 200 ms to notice a client stopped meanwhile (its calls in
    // flight then never end).
    auto until = Clock::now() + std::chrono::milliseconds(200);
    waiter->cv.wait_until(&waiter->mu, streamed ? until : std::min(until, limit));
    if (waiter->result) break;
    if (impl_->stopped || (!streamed && Clock::now() >= limit)) {
      waiter->abandoned = true;
      ClientResult gave_up;
      gave_up.error = impl_->stopped ? ClientError::kCancelled : ClientError::kTimeout;
      gave_up.message = impl_->stopped ? "the client stopped" : "no end in time";
      return gave_up;
    }
  }
  // No streaming callback runs after this: a handler already queued behind the call's
  // end would otherwise reach the caller's, whose state is gone.
  waiter->abandoned = true;
  return std::move(*waiter->result);
}

void HttpClient::post(std::function<void()> work) { net::post(impl_->ioc, std::move(work)); }

HttpClient::Counts HttpClient::counts() const {
  Counts c;
  c.connects = impl_->connects.load();
  c.reuses = impl_->reuses.load();
  MutexLock lock(&impl_->mu);
  for (const auto& [key, list] : impl_->idle) c.idle += list.size();
  return c;
}

}  // namespace ecx::http
