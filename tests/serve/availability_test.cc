// The proxy keeps serving while its upstreams die: /health reports from connection
// state, an encoder's images go to another encoder, and with no encoder left the PD
// encodes them itself. Real `ecx serve` processes on loopback, real HTTP.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"
#include "support/poll.h"
#include "support/sanitizer.h"
#include "support/service_process.h"

namespace ecx::serve {
namespace {

using ecx::testing::chat;
using ecx::testing::image_request;
using ecx::testing::Service;
using ecx::testing::start;
using nlohmann::json;

std::vector<std::string> service_flags(const std::string& connector) {
  json ec = {{"connector", connector}, {"extra", {{"pool_bytes", "96MiB"}}}};
  return {"--port", "0", "--ec-config", ec.dump(), "--connector", connector};
}

std::string join(const std::vector<Service*>& services) {
  std::string out;
  for (const Service* s : services) out += (out.empty() ? "" : ",") + s->url;
  return out;
}

using ecx::testing::poll_until;

// GET /health: {status, body}; {0, null} when the proxy did not answer.
std::pair<int, json> health(const Service& proxy) {
  auto res = proxy.client(5).Get("/health");
  if (!res) return {0, json()};
  return {res->status, json::parse(res->body, nullptr, false)};
}

std::string metrics(const Service& s) {
  auto res = s.client(5).Get("/metrics");
  return res ? res->body : "";
}

TEST(ProxyAvailability, HealthIs503WithAReasonOnceTheOnlyPdDiesAnd200WhenItIsBack) {
  Service pd, proxy;
  ASSERT_TRUE(start(pd, "pd", service_flags("local")).ok());
  auto proxy_flags = service_flags("local");
  proxy_flags.insert(proxy_flags.end(), {"--pd", pd.url});
  ASSERT_TRUE(start(proxy, "proxy", proxy_flags).ok());
  auto [status, body] = health(proxy);
  ASSERT_EQ(status, 200) << body;
  EXPECT_EQ(body["status"], "ok");
  EXPECT_EQ(body["pd_reachable"], 1);

  ASSERT_TRUE(pd.kill_now().ok());
  json last;
  EXPECT_TRUE(poll_until(Deadline::after_ms(5000),
                         [&] {
                           auto [s, b] = health(proxy);
                           last = b;
                           return s == 503;
                         }))
      << "proxy /health still says " << last;
  EXPECT_EQ(last["status"], "unavailable");
  ASSERT_TRUE(last["reason"].is_string()) << last;
  EXPECT_NE(last["reason"].get<std::string>().find(pd.url), std::string::npos) << last;
  EXPECT_EQ(last["pd_reachable"], 0);
  // Nothing can serve a request now: 502, promptly (the dead PD refuses the connection).
  auto res = chat(proxy, image_request(1));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 502) << res->body;

  // A PD comes back at the same address: healthy again, and serving.
  Service again;
  auto flags = service_flags("local");
  flags[1] = std::to_string(pd.port);
  ASSERT_TRUE(start(again, "pd", flags).ok());
  EXPECT_TRUE(poll_until(Deadline::after_ms(5000), [&] { return health(proxy).first == 200; }))
      << health(proxy).second;
  res = chat(proxy, image_request(2));
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

TEST(ProxyAvailability, NonStreamingSuccessIsCountedWithItsHttpStatus) {
  Service pd, proxy;
  ASSERT_TRUE(start(pd, "pd", service_flags("local")).ok());
  auto proxy_flags = service_flags("local");
  proxy_flags.insert(proxy_flags.end(), {"--pd", pd.url});
  ASSERT_TRUE(start(proxy, "proxy", proxy_flags).ok());
  auto res = chat(proxy, image_request(3));
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  auto streamed = chat(proxy, image_request(4, /*max_tokens=*/4, /*stream=*/true));
  ASSERT_TRUE(streamed);
  ASSERT_EQ(streamed->status, 200) << streamed->body;
  std::string text = metrics(proxy);
  EXPECT_NE(text.find("ecx_proxy_requests_total{status=\"200\"} 2"), std::string::npos) << text;
  EXPECT_EQ(text.find("status=\"-1\""), std::string::npos) << text;
}

// E, PD and a proxy over the given encoders, p2p.
struct EpdStack {
  std::vector<Service> encoders;
  Service pd, proxy;
  std::vector<std::string> encoder_flags, proxy_flags;  // beyond the usual ones

  Status start_all(int encoder_count) {
    encoders.resize(encoder_count);
    std::vector<Service*> list;
    for (auto& e : encoders) {
      auto flags = service_flags("p2p");
      flags.insert(flags.end(), encoder_flags.begin(), encoder_flags.end());
      ECX_RETURN_IF_ERROR(start(e, "encoder", flags));
      list.push_back(&e);
    }
    ECX_RETURN_IF_ERROR(start(pd, "pd", service_flags("p2p")));
    auto flags = service_flags("p2p");
    flags.insert(flags.end(), {"--pd", pd.url, "--encoders", join(list)});
    flags.insert(flags.end(), proxy_flags.begin(), proxy_flags.end());
    return start(proxy, "proxy", flags);
  }
};

TEST(ProxyAvailability, TheOnlyEncoderDyingUnderABurstFailsNoRequest) {
  EpdStack stack;
  ASSERT_TRUE(stack.start_all(1).ok());
  constexpr int kRequests = 20;
  std::mutex mu;
  std::condition_variable cv;
  int answered = 0;                      // guarded by mu
  std::vector<int> statuses(kRequests);  // each written by its own client thread
  std::vector<std::string> bodies(kRequests);
  std::vector<std::thread> clients;
  auto send = [&](int i) {
    clients.emplace_back([&, i] {
      auto res = chat(stack.proxy, image_request(100 + i));
      statuses[i] = res ? res->status : 0;
      bodies[i] = res ? res->body : httplib::to_string(res.error());
      std::lock_guard lock(mu);
      ++answered;
      cv.notify_all();
    });
  };
  // Half the burst is flowing when the encoder dies (one answer is back, most are not);
  // the other half comes after, while the proxy may still think it alive.
  for (int i = 0; i < kRequests / 2; ++i) send(i);
  {
    std::unique_lock lock(mu);
    cv.wait_for(lock, std::chrono::seconds(120), [&] { return answered > 0; });
  }
  ASSERT_TRUE(stack.encoders[0].kill_now().ok());
  for (int i = kRequests / 2; i < kRequests; ++i) send(i);
  for (auto& t : clients) t.join();
  int recomputed = 0;
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_EQ(statuses[i], 200) << "request " << i << ": " << bodies[i];
    json out = json::parse(bodies[i], nullptr, false);
    if (statuses[i] == 200) recomputed += out["ecx_timings"]["items_recomputed"].get<int>();
  }
  // Requests that came after the encoder were encoded by the PD, and the proxy says so.
  EXPECT_GT(recomputed, 0);
  EXPECT_NE(metrics(stack.proxy).find("ecx_proxy_encoder_fallbacks_total"), std::string::npos);
  // Still healthy (the PD serves), though degraded.
  json last;
  EXPECT_TRUE(poll_until(Deadline::after_ms(5000), [&] {
    auto [s, b] = health(stack.proxy);
    last = b;
    return s == 200 && b["status"] == "degraded";
  })) << last;
}

TEST(ProxyAvailability, AnotherEncoderTakesOverWhenOneDies) {
  EpdStack stack;
  ASSERT_TRUE(stack.start_all(2).ok());
  auto warm = chat(stack.proxy, image_request(200));
  ASSERT_TRUE(warm);
  ASSERT_EQ(warm->status, 200) << warm->body;
  ASSERT_TRUE(stack.encoders[0].kill_now().ok());
  // At once (the proxy may not have noticed yet) and later: every image is encoded by
  // the live encoder, so the PD loads it instead of encoding it.
  for (int i = 0; i < 6; ++i) {
    auto res = chat(stack.proxy, image_request(300 + i));
    ASSERT_TRUE(res) << i;
    ASSERT_EQ(res->status, 200) << i << ": " << res->body;
    EXPECT_EQ(json::parse(res->body)["ecx_timings"]["items_recomputed"], 0)
        << i << ": " << res->body;
  }
  std::string text = metrics(stack.proxy);
  EXPECT_EQ(text.find("ecx_proxy_encoder_fallbacks_total"), std::string::npos) << text;
  EXPECT_NE(
      text.find("ecx_proxy_upstream_up{role=\"encoder\",url=\"" + stack.encoders[1].url + "\"} 1"),
      std::string::npos)
      << text;
}

// The soft and hard "Max open files" of process `pid`, from /proc/PID/limits.
std::pair<std::string, std::string> open_files_limits(pid_t pid) {
  std::ifstream limits("/proc/" + std::to_string(pid) + "/limits");
  std::string line;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    std::istringstream fields(line.substr(14));
    std::string soft, hard;
    fields >> soft >> hard;
    return {soft, hard};
  }
  return {"", ""};
}

// A service started with a low soft open-files limit raises it to the hard one; past
// --max-connections it still answers /health but refuses work with a JSON 503.
TEST(ServiceLimits, PastItsConnectionLimitAnEncoderAnswersHealthAndRefusesWork) {
  rlimit mine{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &mine), 0);
  rlimit low = mine;
  low.rlim_cur = std::min<rlim_t>(mine.rlim_cur, 512);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);  // inherited by the service
  Service encoder;
  std::vector<std::string> flags = service_flags("p2p");
  flags.insert(flags.end(), {"--max-connections", "3"});
  Status started = start(encoder, "encoder", flags);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &mine), 0);
  ASSERT_TRUE(started.ok()) << started.to_string();
  auto [soft, hard] = open_files_limits(encoder.process->pid());
  EXPECT_FALSE(hard.empty());
  EXPECT_EQ(soft, hard);
  std::vector<httplib::Client> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(encoder.client(5));
    held.back().set_keep_alive(true);
    ASSERT_TRUE(held.back().Get("/v1/models"));
  }
  auto refused = encoder.client(5).Post("/v1/encode", "{}", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(refused->get_header_value("Retry-After"), "1");
  auto body = json::parse(refused->body, nullptr, false);
  EXPECT_EQ(body["error"]["type"], "server_busy") << refused->body;
  EXPECT_NE(refused->body.find("--max-connections"), std::string::npos) << refused->body;
  auto [status, report] = health(encoder);
  EXPECT_EQ(status, 200) << report;
  EXPECT_NE(metrics(encoder).find("ecx_http_connections_refused_total 1"), std::string::npos);
}

// A data URL of a PNG of `side` x `side` black pixels (a few KB that decode to many
// pixels: the image an attacker sends), and a /v1/encode body holding it.
std::string black_image_url(int side) {
  engine::Image black;
  black.width = side;
  black.height = side;
  black.rgb.assign(static_cast<size_t>(side) * side * 3, 0);
  return engine::make_data_url(engine::encode_png(black).value(), "image/png");
}
std::string black_image_body(int side) { return json{{"image", black_image_url(side)}}.dump(); }

// The value on the line that starts with `line_prefix` (not a # HELP line), or 0.
double metric_value(const std::string& text, const std::string& line_prefix) {
  auto at = text.find("\n" + line_prefix);
  return at == std::string::npos ? 0 : std::atof(text.c_str() + at + 1 + line_prefix.size());
}

// A TCP connection to `s` from the loopback address `from` (127.0.0.x), or -1.
int connect_from(const Service& s, const char* from) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, from, &local.sin_addr);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(s.port));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Many addresses that each hold their share of connections, trickling headers they never
// finish, fill a service to its --max-connections: a new client (another address) is
// still served, the largest holders' late connections making room, and the trickling
// ones are closed once their headers are late (10 s), not after the 60 s idle timeout.
TEST(ServiceLimits, TricklingConnectionsFromManyAddressesKeepNoNewClientOut) {
  rlimit mine{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &mine), 0);
  rlimit raised = mine;
  raised.rlim_cur = std::min<rlim_t>(mine.rlim_max, 8192);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
  Service encoder;
  auto flags = service_flags("p2p");
  flags.insert(flags.end(), {"--max-connections", "1000"});
  ASSERT_TRUE(start(encoder, "encoder", flags).ok());
  // Watched through one connection opened first (a new one would be a newcomer itself).
  httplib::Client watch = encoder.client(30);
  watch.set_keep_alive(true);
  auto open_connections = [&] {
    auto res = watch.Get("/metrics");
    return res ? metric_value(res->body, "ecx_http_open_connections ") : -1;
  };
  ASSERT_EQ(open_connections(), 1);
  // 4 addresses x 250: the service is full, every address within its share (256).
  std::vector<int> trickling;
  for (const char* from : {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}) {
    for (int i = 0; i < 250; ++i) {
      int fd = connect_from(encoder, from);
      ASSERT_GE(fd, 0) << from << " #" << i << ": " << std::strerror(errno);
      const char start[] = "POST /v1/encode HTTP/1.1\r\nHost: e\r\n";
      ASSERT_EQ(::send(fd, start, sizeof(start) - 1, MSG_NOSIGNAL),
                static_cast<ssize_t>(sizeof(start) - 1));
      trickling.push_back(fd);
    }
  }
  ASSERT_TRUE(ecx::testing::poll_until(Deadline::after_ms(30000), [&] {
    return open_connections() >= 1000;
  })) << open_connections();
  const auto filled = std::chrono::steady_clock::now();
  // Headers begun over a second ago and still not whole: those connections may be asked
  // to make room (one whose headers are arriving now never is).
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto served = encoder.client(30).Post("/v1/encode", black_image_body(56), "application/json");
  ASSERT_TRUE(served) << httplib::to_string(served.error());
  EXPECT_EQ(served->status, 200) << served->body;
  EXPECT_GE(metric_value(metrics(encoder), "ecx_http_connections_yielded_total "), 1);
  // Every trickling connection ends by its header deadline (a read sees the close).
  int closed = 0;
  for (int fd : trickling) {
    pollfd p{fd, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        filled + std::chrono::seconds(25) - std::chrono::steady_clock::now());
    char byte;
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count()))) == 1 &&
        ::recv(fd, &byte, 1, 0) <= 0) {
      ++closed;
    }
    ::close(fd);
  }
  EXPECT_EQ(closed, static_cast<int>(trickling.size()));
  ::setrlimit(RLIMIT_NOFILE, &mine);
}

// Work that cannot be served is not done: an image whose tokens could never fit the
// model's context is refused before it is encoded.
TEST(EncoderWork, AnImageThatCannotFitTheContextIsRefusedBeforeItIsEncoded) {
  Service encoder;
  auto flags = service_flags("p2p");
  flags.insert(flags.end(), {"--max-model-len", "1024"});
  ASSERT_TRUE(start(encoder, "encoder", flags).ok());
  // 1400 x 1400 px: 50 x 50 = 2500 tokens, more than the 1024 of the context.
  auto refused = encoder.client().Post("/v1/encode", black_image_body(1400), "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400) << refused->body;
  auto body = json::parse(refused->body, nullptr, false);
  EXPECT_EQ(body["error"]["type"], "context_length_exceeded") << refused->body;
  std::string m = metrics(encoder);
  EXPECT_EQ(metric_value(m, "ecx_encode_failures_total{reason=\"context_length_exceeded\"} "), 1);
  EXPECT_EQ(metric_value(m, "ecx_encode_requests_total{cache=\"miss\"} "), 0) << "it was encoded";
  // One that fits (224 x 224 px: 64 tokens) is encoded.
  auto served = encoder.client().Post("/v1/encode", black_image_body(224), "application/json");
  ASSERT_TRUE(served);
  EXPECT_EQ(served->status, 200) << served->body;
}

// Work whose caller is gone stops: a client that hangs up during a long encode ends it
// at its next step, and an encoder whose every worker is stuck says so in /health.
TEST(EncoderWork, AnEncodeWhoseClientLeftStopsAndStuckWorkersMakeHealthDegraded) {
  Service encoder;
  auto flags = service_flags("p2p");
  flags.insert(flags.end(), {"--workers", "1", "--stuck-after-s", "1"});
  ASSERT_TRUE(start(encoder, "encoder", flags).ok());
  const std::string huge = black_image_body(2000);  // 71 x 71 = 5041 tokens: seconds
  // The first caller stays: once its encode has run past --stuck-after-s, /health says
  // the encoder is degraded (and so a proxy stops sending it work).
  std::thread staying([&] {
    auto res = encoder.client(300).Post("/v1/encode", huge, "application/json");
    EXPECT_TRUE(res);
  });
  ASSERT_TRUE(poll_until(Deadline::after_ms(10000), [&] {
    return metric_value(metrics(encoder), "ecx_http_requests_running ") == 1;
  })) << metrics(encoder);
  std::thread waiting([&] {  // behind it in the queue
    auto res = encoder.client(300).Post("/v1/encode", black_image_body(224), "application/json");
    EXPECT_TRUE(res);
  });
  EXPECT_TRUE(poll_until(Deadline::after_ms(60000), [&] {
    auto [status, report] = health(encoder);
    return status == 503 && report["status"] == "degraded";
  }));
  staying.join();
  waiting.join();
  auto [status, report] = health(encoder);
  EXPECT_EQ(status, 200) << report;
  // The second caller hangs up a moment after sending: its encode stops early.
  {
    httplib::Client leaving = encoder.client(1);
    // 100 x 100 = 10000 tokens: a minute or more here, were it not stopped.
    auto res = leaving.Post("/v1/encode", black_image_body(2800), "application/json");
    EXPECT_FALSE(res);  // read timeout: the client gave up and closed
  }
  EXPECT_TRUE(poll_until(Deadline::after_ms(60000), [&] {
    return metric_value(metrics(encoder), "ecx_encode_failures_total{reason=\"cancelled\"} ") == 1;
  })) << metrics(encoder);
}

// A client that hangs up on the proxy ends the proxy's calls for it: the encoder sees its
// connection close and stops the encode, and nothing is forwarded to the PD.
TEST(ProxyWork, AClientThatHangsUpOnTheProxyStopsItsEncodeAndNothingReachesThePd) {
  EpdStack stack;
  ASSERT_TRUE(stack.start_all(1).ok());
  const Service& encoder = stack.encoders[0];
  // 2800 x 2800 px: 100 x 100 = 10000 tokens, a minute or more to encode here.
  json content =
      json::array({{{"type", "text"}, {"text", "Describe:"}},
                   {{"type", "image_url"}, {"image_url", {{"url", black_image_url(2800)}}}}});
  const std::string body = json{
      {"model", "ecx-tiny-vl"},
      {"messages", json::array({{{"role", "user"}, {"content", content}}})},
      {"max_tokens", 4}}.dump();
  {
    httplib::Client leaving = stack.proxy.client(1);
    // The encode has begun before the client gives up (the proxy answers nothing sooner).
    auto res = leaving.Post("/v1/chat/completions", body, "application/json");
    EXPECT_FALSE(res) << res->status << " " << res->body;  // read timeout: closed
  }
  EXPECT_TRUE(poll_until(Deadline::after_ms(60000), [&] {
    return metric_value(metrics(encoder), "ecx_encode_failures_total{reason=\"cancelled\"} ") == 1;
  })) << metrics(encoder);
  EXPECT_TRUE(poll_until(Deadline::after_ms(10000), [&] {
    return metric_value(metrics(stack.proxy), "ecx_proxy_client_disconnects_total ") == 1;
  })) << metrics(stack.proxy);
  EXPECT_EQ(metric_value(metrics(stack.pd), "ecx_requests_total{status=\"ok\"} "), 0);
  // The stack serves the next client at once (the encoder's worker is free again).
  auto served = chat(stack.proxy, image_request(7));
  ASSERT_TRUE(served);
  EXPECT_EQ(served->status, 200) << served->body;
  EXPECT_EQ(metric_value(metrics(stack.pd), "ecx_requests_total{status=\"ok\"} "), 1);
}

// KiB of a process's /proc status field ("VmRSS", "VmHWM"); -1 when unreadable.
int64_t status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atoll(line.c_str() + field.size() + 1);
  }
  return -1;
}

// The context check is the chat's, not each image's: four images that each fit the
// context alone but not together are refused by E before any of them is encoded (the
// proxy sends every encode call the chat's image sizes), with a 400 naming the total; so
// are they when a client sends them to E's chat completion itself, or lists the sizes in
// its own /v1/encode call. (Without the chat's sizes, E encoded each image: each fits.)
TEST(EncoderWork, AChatWhoseImagesTogetherCannotFitIsRefusedBeforeAnyIsEncoded) {
  EpdStack stack;
  stack.encoder_flags = {"--max-model-len", "1024"};
  ASSERT_TRUE(stack.start_all(1).ok());
  // 600 x 600 px: 21 x 21 = 441 tokens each, 1764 together.
  json content = json::array({{{"type", "text"}, {"text", "Compare:"}}});
  for (int i = 0; i < 4; ++i) {
    engine::Image image = engine::synthetic_image(600, 600, 40 + i);
    content.push_back(
        {{"type", "image_url"},
         {"image_url",
          {{"url", engine::make_data_url(engine::encode_png(image).value(), "image/png")}}}});
  }
  const json messages = json::array({{{"role", "user"}, {"content", content}}});
  const std::string body =
      json{{"model", "ecx-tiny-vl"}, {"messages", messages}, {"max_tokens", 4}}.dump();
  auto refused = chat(stack.proxy, body);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400) << refused->body;
  auto answer = json::parse(refused->body, nullptr, false);
  EXPECT_EQ(answer["error"]["type"], "context_length_exceeded") << refused->body;
  EXPECT_NE(refused->body.find("1764 tokens"), std::string::npos) << refused->body;
  // Straight to E: its chat completion, and /v1/encode with the chat's sizes.
  Service& e = stack.encoders[0];
  auto direct = e.client().Post("/v1/chat/completions",
                                json{{"model", "ecx-tiny-vl"}, {"messages", messages}}.dump(),
                                "application/json");
  ASSERT_TRUE(direct);
  EXPECT_EQ(direct->status, 400) << direct->body;
  EXPECT_NE(direct->body.find("1764 tokens"), std::string::npos) << direct->body;
  json listed = {{"image", black_image_url(600)},
                 {"chat_image_sizes", {{600, 600}, {600, 600}, {600, 600}, {600, 600}}}};
  auto one = e.client().Post("/v1/encode", listed.dump(), "application/json");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 400) << one->body;
  std::string m = metrics(e);
  EXPECT_EQ(metric_value(m, "ecx_encode_requests_total{cache=\"miss\"} "), 0)
      << "an image was encoded:\n"
      << m;
  EXPECT_EQ(metric_value(m, "ecx_encode_failures_total{reason=\"context_length_exceeded\"} "),
            4 + 1 + 1)
      << m;
  // A malformed list is a 400 naming it; the image alone (441 tokens) is encoded.
  for (const json& sizes : {json{{600}}, json{{0, 600}}, json("600x600")}) {
    listed["chat_image_sizes"] = sizes;
    auto bad = e.client().Post("/v1/encode", listed.dump(), "application/json");
    ASSERT_TRUE(bad);
    EXPECT_EQ(bad->status, 400) << bad->body;
    EXPECT_NE(bad->body.find("chat_image_sizes"), std::string::npos) << bad->body;
  }
  listed["chat_image_sizes"] = {{600, 600}};
  auto fits = e.client().Post("/v1/encode", listed.dump(), "application/json");
  ASSERT_TRUE(fits);
  EXPECT_EQ(fits->status, 200) << fits->body;
}

// The body budget bounds memory: each body byte is charged 4 times, and what the proxy
// makes of a request (its parsed form, the calls to E, the body for the PD) stays within
// that, so large concurrent requests keep its peak memory within --max-buffered-bytes.
TEST(ProxyWork, LargeConcurrentBodiesKeepTheProxyWithinItsBodyBudget) {
#if ECX_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator keeps freed memory (quarantine) and ignores "
                  "mallopt: the release build measures memory";
#endif
  EpdStack stack;
  constexpr int64_t kBudget = 512 << 20;
  stack.encoder_flags = {"--max-model-len", "1024"};  // E refuses these images unencoded
  stack.proxy_flags = {"--max-buffered-bytes", std::to_string(kBudget)};
  ASSERT_TRUE(stack.start_all(1).ok());
  // Three images of noise (incompressible: about 10 MiB each as a data URL).
  json content = json::array({{{"type", "text"}, {"text", "Describe:"}}});
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    engine::Image noise;
    noise.width = noise.height = 1600;
    noise.rgb.resize(static_cast<size_t>(1600) * 1600 * 3);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull;
    for (auto& b : noise.rgb) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      b = static_cast<uint8_t>(x);
    }
    auto png = engine::encode_png(noise).value();
    content.push_back(
        {{"type", "image_url"}, {"image_url", {{"url", engine::make_data_url(png, "image/png")}}}});
  }
  const std::string body = json{
      {"model", "ecx-tiny-vl"},
      {"messages", json::array({{{"role", "user"}, {"content", content}}})},
      {"max_tokens", 4}}.dump();
  ASSERT_GT(body.size(), 25u << 20);
  const pid_t proxy = stack.proxy.process->pid();
  const int64_t before_kib = status_kib(proxy, "VmRSS");
  constexpr int kClients = 8;  // 8 x 4 x the body: twice the budget
  std::vector<int> statuses(kClients, 0);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      auto res = chat(stack.proxy, body);
      statuses[i] = res ? res->status : 0;
    });
  }
  for (auto& t : clients) t.join();
  const int64_t peak_kib = status_kib(proxy, "VmHWM");
  int encoded_and_refused = 0;
  for (int status : statuses) {
    EXPECT_TRUE(status == 400 || status == 503) << status;  // refused by E, or by the budget
    encoded_and_refused += status == 400;
  }
  EXPECT_GT(encoded_and_refused, 0);
  EXPECT_LE((peak_kib - before_kib) * 1024, kBudget)
      << "peak " << peak_kib / 1024 << " MiB, " << before_kib / 1024 << " MiB before";
  auto [status, report] = health(stack.proxy);
  EXPECT_EQ(status, 200) << report;
}

}  // namespace
}  // namespace ecx::serve
