// ecx's asynchronous HTTP client (http/http_client.h) against real servers on
// loopback: answers and pooled connections, a connection the upstream closed while
// idle, refused and silent upstreams, streamed bodies paused and resumed, bodies over
// the limit, a receiver that stops, and peers that answer garbage or hang up. Also the
// server's async routes (http_server/http_server.h): FIFO slots, admission, and a reply that
// is dropped without an answer.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "http/http_client.h"
#include "http_server/http_server.h"
#include "support/gate.h"
#include "support/poll.h"
#include "support/service_metrics.h"

namespace ecx::serve {
namespace {

using http::BodyFlow;
using http::Cancellation;
using http::ClientError;
using http::ClientRequest;
using http::ClientResult;
using http::ClientStreaming;
using http::HttpClient;
using nlohmann::json;
using std::chrono::milliseconds;
using testing::Gate;
using testing::metric_in;

// A service on a free loopback port.
struct Upstream {
  explicit Upstream(int idle_timeout_s = 60, int workers = 2, uint64_t max_queued = 100) {
    config.port = 0;
    config.host = "127.0.0.1";
    config.workers = workers;
    config.max_queued = max_queued;
    config.idle_timeout_s = idle_timeout_s;
    server = std::make_unique<HttpServer>(config, "upstream", workers);
    add_common_routes(*server, config, "upstream", /*secured=*/true, [] { return std::string(); });
  }
  void start() {
    auto p = server->start();
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    port = *p;
  }
  double open_connections() const {
    return metric_in(server->render_metrics(), "ecx_http_open_connections");
  }

  CommonServiceConfig config;
  std::unique_ptr<HttpServer> server;
  int port = 0;
};

// One call, waited for (the client's own deadlines end it; the wait has one too).
ClientResult call(HttpClient& client, int port, ClientRequest request,
                  ClientStreaming streaming = {}) {
  std::promise<ClientResult> done;
  auto result = done.get_future();
  client.send(
      "127.0.0.1", port, std::move(request),
      [&done](ClientResult r) { done.set_value(std::move(r)); }, std::move(streaming));
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "the call did not end within 60 s";
    return ClientResult{ClientError::kTimeout, "test deadline", 0, ""};
  }
  return result.get();
}

ClientRequest post(const std::string& target, std::string body = "{}") {
  ClientRequest r;
  r.target = target;
  r.body = std::move(body);
  r.timeout = milliseconds(30000);
  return r;
}

// A port nothing listens on: bound, never listened, closed.
int closed_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A listener whose every connection gets `reply` (raw bytes) and is closed, on a thread
// that ends after `connections` of them.
class RawPeer {
 public:
  RawPeer(std::string reply, int connections) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
    thread_ = std::thread([this, reply = std::move(reply), connections] {
      for (int i = 0; i < connections; ++i) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        char buf[4096];
        ::recv(c, buf, sizeof(buf), 0);  // the request (or its start)
        if (!reply.empty()) ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
        ::close(c);
      }
    });
  }
  ~RawPeer() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  int port = 0;

 private:
  int fd_ = -1;
  std::thread thread_;
};

TEST(HttpClientTest, AnswersComeBackAndTheSecondCallReusesTheConnection) {
  Upstream up;
  up.server->work("POST", "/echo", [](const HttpRequest& req, HttpResponse& res) {
    res.set_content(req.body, "application/json");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  ClientResult first = call(client, up.port, post("/echo", R"({"n":1})"));
  ASSERT_TRUE(first.ok()) << first.message;
  EXPECT_EQ(first.status, 200);
  EXPECT_EQ(first.body, R"({"n":1})");
  ClientResult second = call(client, up.port, post("/echo", R"({"n":2})"));
  ASSERT_TRUE(second.ok()) << second.message;
  EXPECT_EQ(second.body, R"({"n":2})");
  HttpClient::Counts counts = client.counts();
  EXPECT_EQ(counts.connects, 1u);
  EXPECT_EQ(counts.reuses, 1u);
  EXPECT_EQ(counts.idle, 1u);
  // An error status is an answer, not a failure of the call.
  ClientResult missing = call(client, up.port, post("/nowhere"));
  ASSERT_TRUE(missing.ok()) << missing.message;
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(json::parse(missing.body)["error"]["code"], 404);
}

TEST(HttpClientTest, AConnectionTheUpstreamClosedWhileIdleIsNotUsed) {
  Upstream up(/*idle_timeout_s=*/1);
  up.server->work("POST", "/echo", [](const HttpRequest& req, HttpResponse& res) {
    res.set_content(req.body, "application/json");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  ASSERT_TRUE(call(client, up.port, post("/echo")).ok());
  ASSERT_EQ(client.counts().idle, 1u);
  // The upstream closes it after its idle timeout (1 s); waited for by its own count.
  ecx::testing::poll_until(Deadline::after_ms(30000), [&] { return up.open_connections() == 0; });
  ASSERT_EQ(up.open_connections(), 0);
  ClientResult r = call(client, up.port, post("/echo", "again"));
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(r.body, "again");
  EXPECT_EQ(client.counts().connects, 2u);
  EXPECT_EQ(client.counts().reuses, 0u);
}

TEST(HttpClientTest, ARefusedConnectIsAConnectErrorAndASilentUpstreamTimesOut) {
  HttpClient client(HttpClient::Options{});
  ClientResult refused = call(client, closed_port(), post("/x"));
  EXPECT_EQ(refused.error, ClientError::kConnect) << refused.message;
  EXPECT_EQ(refused.status, 0);
  EXPECT_NE(refused.message.find("connect to 127.0.0.1:"), std::string::npos) << refused.message;

  Gate gate;
  Upstream up;
  up.server->work("POST", "/slow", [&](const HttpRequest&, HttpResponse& res) {
    gate.wait();
    res.set_content("{}", "application/json");
  });
  up.start();
  ClientRequest slow = post("/slow");
  slow.timeout = milliseconds(300);
  ClientResult r = call(client, up.port, std::move(slow));
  gate.open();
  EXPECT_EQ(r.error, ClientError::kTimeout) << r.message;
  EXPECT_EQ(r.status, 0);
  // The timed-out connection is not pooled: the next call opens its own.
  ClientResult next = call(client, up.port, post("/slow"));
  ASSERT_TRUE(next.ok()) << next.message;
  EXPECT_EQ(client.counts().reuses, 0u);
}

TEST(HttpClientTest, GarbageAndHangUpsAreTransportErrors) {
  HttpClient client(HttpClient::Options{});
  {
    RawPeer garbage("this is not HTTP\r\n\r\n", 1);
    ClientResult r = call(client, garbage.port, post("/x"));
    EXPECT_EQ(r.error, ClientError::kTransport) << r.message;
  }
  {
    RawPeer hang_up("", 1);  // reads the request, closes without an answer
    ClientResult r = call(client, hang_up.port, post("/x"));
    EXPECT_EQ(r.error, ClientError::kTransport) << r.message;
    EXPECT_EQ(r.status, 0);
  }
  {
    // A length it never sends: the answer ends early.
    RawPeer short_body("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", 1);
    ClientResult r = call(client, short_body.port, post("/x"));
    EXPECT_EQ(r.error, ClientError::kTransport) << r.message;
  }
  EXPECT_EQ(client.counts().idle, 0u);
}

TEST(HttpClientTest, ABodyOverTheLimitIsRefused) {
  Upstream up;
  up.server->work("POST", "/big", [](const HttpRequest&, HttpResponse& res) {
    res.set_content(std::string(2 << 20, 'x'), "text/plain");
  });
  up.start();
  HttpClient::Options options;
  options.max_body_bytes = 1 << 20;
  HttpClient client(options);
  ClientResult r = call(client, up.port, post("/big"));
  EXPECT_EQ(r.error, ClientError::kTooLarge) << r.message;
  EXPECT_EQ(r.status, 200);  // the headers came
}

// An upstream streaming `chunks` numbered lines.
void add_counting_stream(Upstream& up, int chunks, std::atomic<bool>* client_left = nullptr) {
  up.server->work("POST", "/stream", [chunks, client_left](const HttpRequest&, HttpResponse& res) {
    StreamWriter& w = res.start_stream("text/event-stream");
    for (int i = 0; i < chunks; ++i) {
      if (!w.write("data: " + std::to_string(i) + "\n\n")) {
        if (client_left) *client_left = true;
        return;
      }
    }
  });
}

std::string counting_text(int chunks) {
  std::string want;
  for (int i = 0; i < chunks; ++i) want += "data: " + std::to_string(i) + "\n\n";
  return want;
}

TEST(HttpClientTest, AStreamedBodyPausedAtEveryPieceArrivesWholeAndInOrder) {
  Upstream up;
  add_counting_stream(up, 2000);
  up.start();
  HttpClient client(HttpClient::Options{});
  std::string got;
  int headers_status = 0;
  int pauses = 0;
  std::vector<std::thread> resumers;
  std::mutex mu;
  ClientStreaming streaming;
  streaming.on_headers = [&](int status) {
    headers_status = status;
    return true;
  };
  streaming.on_body = [&](std::string_view piece, std::function<void()> resume) {
    got.append(piece);
    ++pauses;
    // Resumed from another thread, as the server's I/O thread does.
    std::lock_guard lock(mu);
    resumers.emplace_back([resume = std::move(resume)] { resume(); });
    return BodyFlow::kPause;
  };
  ClientResult r = call(client, up.port, post("/stream"), std::move(streaming));
  for (auto& t : resumers) t.join();
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(headers_status, 200);
  EXPECT_TRUE(r.body.empty());
  EXPECT_GE(pauses, 1);
  EXPECT_EQ(got, counting_text(2000));
}

TEST(HttpClientTest, AnErrorAnswerToAStreamedCallIsCollected) {
  Upstream up;
  up.server->work("POST", "/stream", [](const HttpRequest&, HttpResponse& res) {
    send_error(res, 429, "busy", "try later");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  bool body_called = false;
  ClientStreaming streaming;
  streaming.on_headers = [](int status) { return status == 200; };
  streaming.on_body = [&](std::string_view, std::function<void()>) {
    body_called = true;
    return BodyFlow::kContinue;
  };
  ClientResult r = call(client, up.port, post("/stream"), std::move(streaming));
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(r.status, 429);
  EXPECT_FALSE(body_called);
  EXPECT_EQ(json::parse(r.body)["error"]["message"], "try later");
}

TEST(HttpClientTest, AReceiverThatStopsEndsTheCallAndTheUpstreamSeesItGo) {
  std::atomic<bool> client_left{false};
  Upstream up;
  add_counting_stream(up, 100'000'000, &client_left);
  up.start();
  HttpClient client(HttpClient::Options{});
  int pieces = 0;
  ClientStreaming streaming;
  streaming.on_body = [&](std::string_view, std::function<void()>) {
    return ++pieces < 3 ? BodyFlow::kContinue : BodyFlow::kStop;
  };
  ClientResult r = call(client, up.port, post("/stream"), std::move(streaming));
  EXPECT_EQ(r.error, ClientError::kStopped) << r.message;
  EXPECT_EQ(pieces, 3);
  EXPECT_EQ(client.counts().idle, 0u);
  // The upstream's writer learns the client has gone (bounded wait).
  EXPECT_TRUE(
      ecx::testing::poll_until(Deadline::after_ms(60000), [&] { return client_left.load(); }));
}

// The proxy's own client hung up: its call ends at once, and the upstream (an ecx
// service) sees its connection close and takes the work as abandoned.
TEST(HttpClientTest, ACancelledCallEndsAtOnceAndTheUpstreamSeesItsClientGo) {
  Gate running;
  std::atomic<bool> saw_abandoned{false};
  std::atomic<int> calls{0};
  Upstream up;
  up.server->work("POST", "/long", [&](const HttpRequest& req, HttpResponse& res) {
    calls++;
    auto gone = std::make_shared<Gate>();  // told when the client goes, if ever
    if (req.client_gone) req.client_gone->on_cancel([gone] { gone->open(); });
    running.open();
    gone->wait(std::chrono::seconds(30));
    saw_abandoned = req.abandoned();
    res.set_content("{}", "application/json");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  ClientRequest long_call = post("/long");
  long_call.cancel = std::make_shared<Cancellation>();
  auto cancel = long_call.cancel;
  std::promise<ClientResult> done;
  auto result = done.get_future();
  client.send("127.0.0.1", up.port, std::move(long_call),
              [&done](ClientResult r) { done.set_value(std::move(r)); });
  running.wait();
  cancel->cancel();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  ClientResult r = result.get();
  EXPECT_EQ(r.error, ClientError::kCancelled) << r.message;
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(client.counts().idle, 0u);
  EXPECT_TRUE(
      ecx::testing::poll_until(Deadline::after_ms(30000), [&] { return saw_abandoned.load(); }));
  // A call whose caller is already gone ends without being sent.
  ClientRequest late = post("/long");
  late.cancel = cancel;
  ClientResult never = call(client, up.port, std::move(late));
  EXPECT_EQ(never.error, ClientError::kCancelled) << never.message;
  EXPECT_EQ(calls, 1);
}

// The caller goes while a streamed piece is being handed over, and its cancellation's
// other callbacks are slow to run: the call still ends (once), cancelled. Before, the
// step after the piece saw the cancellation and dropped the call unanswered, and the
// client's own callback then found nothing to fail: a blocking call waited for ever.
TEST(HttpClientTest, ACallCancelledWhileAPieceIsHandedOverStillEnds) {
  Upstream up;
  add_counting_stream(up, 100'000'000);
  up.start();
  HttpClient client(HttpClient::Options{});
  ClientRequest request = post("/stream");
  auto cancel = std::make_shared<Cancellation>();
  request.cancel = cancel;
  // Registered before the client's: runs first and holds the client's back a while.
  cancel->on_cancel([] { std::this_thread::sleep_for(milliseconds(200)); });
  std::thread canceller;
  int pieces = 0;
  ClientStreaming streaming;
  streaming.on_body = [&](std::string_view, std::function<void()>) {
    if (++pieces == 2) {
      canceller = std::thread([cancel] { cancel->cancel(); });
      // The piece's handler returns only once the caller has gone.
      EXPECT_TRUE(
          ecx::testing::poll_until(Deadline::after_ms(10000), [&] { return cancel->cancelled(); }));
    }
    return BodyFlow::kContinue;
  };
  std::atomic<int> ends{0};
  std::promise<ClientResult> done;
  auto result = done.get_future();
  client.send(
      "127.0.0.1", up.port, std::move(request),
      [&](ClientResult r) {
        if (ends++ == 0) done.set_value(std::move(r));
      },
      std::move(streaming));
  bool ended = result.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  if (canceller.joinable()) canceller.join();
  ASSERT_TRUE(ended) << "the cancelled call never ended";
  EXPECT_EQ(result.get().error, ClientError::kCancelled);
  std::this_thread::sleep_for(milliseconds(300));  // a second end would come by now
  EXPECT_EQ(ends, 1);
  EXPECT_EQ(pieces, 2);
}

// A blocking streamed call cancelled at any moment: once call() has returned, none of
// its callbacks runs again (their state is the caller's, gone by then; under ASan a late
// one reads freed memory). A piece read before the cancellation, whose handler was still
// queued behind the call's end, used to reach the caller.
TEST(HttpClientTest, NoStreamingCallbackRunsAfterABlockingCallReturns) {
  Upstream up;
  add_counting_stream(up, 100'000'000);
  up.start();
  HttpClient client(HttpClient::Options{.threads = 1});
  std::mt19937 rng(7);
  for (int round = 0; round < 200; ++round) {
    auto pieces = std::make_unique<std::atomic<int>>(0);
    ClientRequest request = post("/stream");
    auto cancel = std::make_shared<Cancellation>();
    request.cancel = cancel;
    ClientStreaming streaming;
    streaming.on_headers = [counter = pieces.get()](int) { return counter->load() >= 0; };
    streaming.on_body = [counter = pieces.get()](std::string_view, std::function<void()>) {
      counter->fetch_add(1);
      return BodyFlow::kContinue;
    };
    const auto after = std::chrono::microseconds(rng() % 3000);
    std::thread canceller([cancel, after] {
      std::this_thread::sleep_for(after);
      cancel->cancel();
    });
    ClientResult r = client.call("127.0.0.1", up.port, std::move(request), std::move(streaming));
    pieces.reset();  // a callback from here on would touch freed memory
    canceller.join();
    ASSERT_NE(r.error, ClientError::kNone) << "an endless stream ended by itself";
  }
}

TEST(HttpClientTest, ManyCallsAtOnceShareAFewConnections) {
  Upstream up(/*idle_timeout_s=*/60, /*workers=*/4);
  up.server->work("POST", "/echo", [](const HttpRequest& req, HttpResponse& res) {
    res.set_content(req.body, "application/json");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  constexpr int kRounds = 10, kAtOnce = 20;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::promise<ClientResult>> done(kAtOnce);
    for (int i = 0; i < kAtOnce; ++i) {
      client.send("127.0.0.1", up.port, post("/echo", std::to_string(i)),
                  [&done, i](ClientResult r) { done[i].set_value(std::move(r)); });
    }
    for (int i = 0; i < kAtOnce; ++i) {
      auto f = done[i].get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready);
      ClientResult r = f.get();
      ASSERT_TRUE(r.ok()) << r.message;
      EXPECT_EQ(r.body, std::to_string(i));
    }
  }
  HttpClient::Counts counts = client.counts();
  EXPECT_LE(counts.connects, static_cast<uint64_t>(kAtOnce));
  EXPECT_EQ(counts.connects + counts.reuses, static_cast<uint64_t>(kRounds * kAtOnce));
}

// call(): the blocking form the health probes, etcd and the tools use.
TEST(HttpClientTest, ABlockingCallCarriesItsHeadersAndEndsWhenItsClientStops) {
  Gate gate;
  Gate entered;
  Upstream up;
  up.server->work("POST", "/whoami", [](const HttpRequest& req, HttpResponse& res) {
    std::string who = req.header("Authorization");
    res.set_content(who.empty() ? "none" : who, "text/plain");
  });
  up.server->work("POST", "/never", [&](const HttpRequest&, HttpResponse& res) {
    entered.open();
    gate.wait();
    res.set_content("{}", "application/json");
  });
  up.start();
  HttpClient client(HttpClient::Options{});
  ClientRequest whoami = post("/whoami");
  whoami.headers.emplace_back("Authorization", "token-1");
  ClientResult r = client.call("127.0.0.1", up.port, std::move(whoami));
  ASSERT_TRUE(r.ok()) << r.message;
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "token-1");

  // A call in flight when its client stops ends (it would never be answered), and a
  // call on a stopped client ends at once.
  std::thread stopper([&] {
    ASSERT_TRUE(entered.wait());
    client.stop();
  });
  ClientResult stopped = client.call("127.0.0.1", up.port, post("/never"));
  stopper.join();
  gate.open();
  EXPECT_EQ(stopped.error, ClientError::kCancelled) << stopped.message;
  ClientResult after = client.call("127.0.0.1", up.port, post("/whoami"));
  EXPECT_EQ(after.error, ClientError::kCancelled) << after.message;
}

// The server's async routes.

TEST(AsyncRouteTest, SlotsRunInArrivalOrderPastThemA503AndHealthAnswers) {
  std::mutex mu;
  std::vector<std::string> order;
  std::shared_ptr<AsyncReply> held;
  std::promise<void> first_started;
  Upstream up(/*idle_timeout_s=*/60, /*workers=*/1, /*max_queued=*/3);
  up.server->async_work("POST", "/work",
                        [&](std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply) {
                          std::lock_guard lock(mu);
                          order.push_back(req->body);
                          HttpResponse res;
                          res.set_content(req->body, "text/plain");
                          if (req->body == "first") {
                            held = std::move(reply);  // answered later, by the test
                            first_started.set_value();
                            return;
                          }
                          reply->respond(std::move(res));
                        });
  up.start();
  auto client = [&] {
    httplib::Client cli("127.0.0.1", up.port);
    cli.set_read_timeout(std::chrono::seconds(60));
    return cli;
  };
  std::vector<std::thread> clients;
  std::vector<int> statuses(4, 0);
  clients.emplace_back(
      [&] { statuses[0] = client().Post("/work", "first", "text/plain")->status; });
  ASSERT_EQ(first_started.get_future().wait_for(std::chrono::seconds(60)),
            std::future_status::ready);
  for (int i = 1; i < 4; ++i) {
    std::string body = "r" + std::to_string(i);
    clients.emplace_back(
        [&, i, body] { statuses[i] = client().Post("/work", body, "text/plain")->status; });
    // Arrived (and queued) before the next one is sent.
    bool queued = ecx::testing::poll_until(Deadline::after_ms(60000), [&] {
      return metric_in(up.server->render_metrics(), "ecx_http_queue_depth") == i;
    });
    ASSERT_TRUE(queued) << "request " << i << " was not queued";
  }
  auto refused = client().Post("/work", "over", "text/plain");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(refused->get_header_value("Retry-After"), "1");
  auto health = client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(metric_in(up.server->render_metrics(), "ecx_http_requests_running"), 1);
  {
    std::lock_guard lock(mu);
    HttpResponse res;
    res.set_content("first", "text/plain");
    held->respond(std::move(res));
    held.reset();
  }
  for (auto& c : clients) c.join();
  EXPECT_EQ(statuses, std::vector<int>({200, 200, 200, 200}));
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(order, std::vector<std::string>({"first", "r1", "r2", "r3"}));
  }
  EXPECT_EQ(metric_in(up.server->render_metrics(), "ecx_http_requests_running"), 0);
}

TEST(AsyncRouteTest, AReplyDroppedWithoutAnAnswerGivesAJson500AndFreesItsSlot) {
  Upstream up(/*idle_timeout_s=*/60, /*workers=*/1);
  up.server->async_work("POST", "/work",
                        [](std::shared_ptr<HttpRequest>, std::shared_ptr<AsyncReply>) {});
  up.start();
  httplib::Client cli("127.0.0.1", up.port);
  cli.set_read_timeout(std::chrono::seconds(60));
  for (int i = 0; i < 3; ++i) {  // one slot: each would wait forever if it were not freed
    auto res = cli.Post("/work", "{}", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 500);
    auto body = json::parse(res->body, nullptr, false);
    ASSERT_TRUE(body.is_object()) << res->body;
    EXPECT_EQ(body["error"]["type"], "internal_error");
  }
}

TEST(AsyncRouteTest, AnAsyncStreamWaitsForRoomAndLearnsTheClientLeft) {
  std::promise<bool> gone;
  Upstream up(/*idle_timeout_s=*/60, /*workers=*/1);
  // Pushes until the buffer is full, then waits for room, until the client has gone.
  struct Producer : std::enable_shared_from_this<Producer> {
    std::shared_ptr<AsyncReply> reply;
    AsyncStreamWriter* writer = nullptr;
    std::promise<bool>* gone = nullptr;
    int waits = 0;
    void run() {
      for (int i = 0; i < 1'000'000; ++i) {
        if (!writer->push("data: " + std::string(1000, 'x') + "\n\n")) {
          gone->set_value(waits > 0);
          return reply->end_stream();
        }
        if (!writer->has_room()) {
          ++waits;
          return writer->when_room([self = shared_from_this()] { self->run(); });
        }
      }
      reply->end_stream();
    }
  };
  up.server->async_work("POST", "/stream",
                        [&](std::shared_ptr<HttpRequest>, std::shared_ptr<AsyncReply> reply) {
                          auto p = std::make_shared<Producer>();
                          p->writer = &reply->start_stream(HttpResponse{}, "text/event-stream");
                          p->reply = std::move(reply);
                          p->gone = &gone;
                          p->run();
                        });
  up.start();
  {
    httplib::Client cli("127.0.0.1", up.port);
    size_t received = 0;
    httplib::Request req;
    req.method = "POST";
    req.path = "/stream";
    req.body = "{}";
    req.content_receiver = [&](const char*, size_t n, uint64_t, uint64_t) {
      received += n;
      return received < (4u << 20);  // leaves after 4 MiB (the buffer holds 1 MiB)
    };
    cli.send(req);
    EXPECT_GE(received, 4u << 20);
  }
  auto f = gone.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  EXPECT_TRUE(f.get()) << "the producer never had to wait for room";
}

}  // namespace
}  // namespace ecx::serve
