// Pins end when their request ends, not when their lease does (30 s): every params an
// encoder hands out pins its block until the PD that read it releases it, or, for a
// request abandoned between E and PD, until the proxy gives the params back
// (POST /v1/ec/release). Real encoder, PD and proxy processes, p2p, real HTTP.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"
#include "support/service_metrics.h"
#include "support/stack_secret.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

// Far below the lease (30 s): only a release ends a pin this soon.
constexpr int64_t kReleasedWithinMs = 2000;

const std::string kEcConfig = R"({"connector":"p2p","extra":{"pool_bytes":"64MiB"}})";

std::string png_url(uint64_t seed) {
  return engine::make_data_url(engine::encode_png(engine::synthetic_image(112, 112, seed)).value(),
                               "image/png");
}

std::string chat_body(uint64_t image_seed) {
  json content =
      json::array({{{"type", "text"}, {"text", "Describe:"}},
                   {{"type", "image_url"}, {"image_url", {{"url", png_url(image_seed)}}}}});
  return json{{"model", "ecx-tiny-vl"},
              {"messages", json::array({{{"role", "user"}, {"content", content}}})},
              {"max_tokens", 4},
              {"ignore_eos", true}}
      .dump();
}

httplib::Result post(const std::string& url, const std::string& path, const std::string& body) {
  httplib::Client cli(url);
  cli.set_read_timeout(std::chrono::seconds(120));
  return cli.Post(path, body, "application/json");
}

using ecx::testing::metric;
using ecx::testing::metric_reaches;

class PinsTest : public ::testing::Test {
 protected:
  void SetUp() override { ecx::testing::use_new_stack_secret(); }
  void TearDown() override {
    for (auto* s : {&proxy_, &pd_, &e_}) {
      if (*s) stop_service((*s)->process, Deadline::after_ms(10000));
    }
  }

  static Result<RunningService> start(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {ECX_BINARY, "serve"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    return spawn_service(argv, Deadline::after_ms(60000));
  }
  void start_encoder() {
    auto e = start({"encoder", "--port", "0", "--ec-config", kEcConfig});
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    e_.emplace(std::move(*e));
  }
  void start_pd() {
    auto pd = start({"pd", "--port", "0", "--ec-config", kEcConfig});
    ASSERT_TRUE(pd.ok()) << pd.status().to_string();
    pd_.emplace(std::move(*pd));
  }
  void start_proxy(const std::string& pd_url) {
    auto proxy = start({"proxy", "--port", "0", "--encoders", e_->url, "--pd", pd_url});
    ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();
    proxy_.emplace(std::move(*proxy));
  }

  std::optional<RunningService> e_, pd_, proxy_;
};

TEST_F(PinsTest, TheEncoderHoldsNoPinsRightAfterABurstOfRepeatedImages) {
  ASSERT_NO_FATAL_FAILURE(start_encoder());
  ASSERT_NO_FATAL_FAILURE(start_pd());
  ASSERT_NO_FATAL_FAILURE(start_proxy(pd_->url));
  // 20 requests over 3 images, 4 clients at once: most images are already held by the
  // encoder (cache hits) and by the PD (local hits).
  constexpr int kRequests = 20, kClients = 4;
  std::atomic<int> next{0}, ok{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&] {
      for (int i = next++; i < kRequests; i = next++) {
        auto res = post(proxy_->url, "/v1/chat/completions", chat_body(1000 + i % 3));
        if (res && res->status == 200) ok++;
      }
    });
  }
  for (auto& t : clients) t.join();
  ASSERT_EQ(ok.load(), kRequests);
  double pins = -1;
  EXPECT_TRUE(
      metric_reaches(e_->url, "ecx_pool_pins", 0, Deadline::after_ms(kReleasedWithinMs), &pins))
      << "the encoder still holds " << pins << " pins";
  EXPECT_EQ(metric(e_->url, "ecx_pool_entries"), 3);
}

TEST_F(PinsTest, ARequestNoPdTakesGivesItsPinsBackToTheEncoder) {
  ASSERT_NO_FATAL_FAILURE(start_encoder());
  // A PD address where nothing listens: a bound socket that never listens refuses
  // every connection, and keeps the port from being reused meanwhile.
  int sock = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ASSERT_NO_FATAL_FAILURE(start_proxy("http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port))));

  for (uint64_t seed : {2000, 2001}) {
    auto res = post(proxy_->url, "/v1/chat/completions", chat_body(seed));
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 502) << res->body;
  }
  ::close(sock);
  double pins = -1;
  EXPECT_TRUE(
      metric_reaches(e_->url, "ecx_pool_pins", 0, Deadline::after_ms(kReleasedWithinMs), &pins))
      << "the encoder still holds " << pins << " pins";
  EXPECT_TRUE(metric_reaches(proxy_->url, "ecx_proxy_params_released_total", 2,
                             Deadline::after_ms(kReleasedWithinMs), &pins))
      << pins;
  EXPECT_EQ(metric(e_->url, "ecx_pool_entries"), 2) << "the embeddings stay cached";
}

TEST_F(PinsTest, TheEncoderReleasesTheParamsItIssuedAndRefusesMalformedOnes) {
  ASSERT_NO_FATAL_FAILURE(start_encoder());
  auto encoded = post(e_->url, "/v1/encode", json{{"image", png_url(3000)}}.dump());
  ASSERT_TRUE(encoded);
  ASSERT_EQ(encoded->status, 200) << encoded->body;
  json answer = json::parse(encoded->body);
  EXPECT_EQ(metric(e_->url, "ecx_pool_pins"), 1);

  json release = {{"ec_transfer_params",
                   {{answer["mm_hash"].get<std::string>(), answer["ec_transfer_params"]}}}};
  auto released = post(e_->url, "/v1/ec/release", release.dump());
  ASSERT_TRUE(released);
  ASSERT_EQ(released->status, 200) << released->body;
  EXPECT_EQ(json::parse(released->body)["released"], 1);
  double pins = -1;
  EXPECT_TRUE(
      metric_reaches(e_->url, "ecx_pool_pins", 0, Deadline::after_ms(kReleasedWithinMs), &pins))
      << pins;

  for (const std::string& bad :
       {std::string("{\"ec_transfer_params\": 5}"), std::string("[1]"), std::string("{"),
        json{{"ec_transfer_params", {{"abc", {{"connector", "p2p"}}}}}}.dump()}) {
    auto res = post(e_->url, "/v1/ec/release", bad);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << bad << ": " << res->body;
    EXPECT_TRUE(json::parse(res->body)["error"]["message"].is_string()) << res->body;
  }
}

}  // namespace
}  // namespace ecx::serve
