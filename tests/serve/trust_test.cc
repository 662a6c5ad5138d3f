// A client that talks straight to the PD and brings its own ec_transfer_params
// (docs/SECURITY.md): it must not be able to choose the producer or the embeddings, nor poison what
// the PD serves to everyone afterwards. Real encoder, PD and proxy processes, real HTTP, a
// deployment secret generated for the stack.
#include <gtest/gtest.h>
#include <httplib.h>
#include <stdlib.h>

#include <nlohmann/json.hpp>

#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "support/stack_secret.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

std::string png_url(uint64_t seed) {
  return engine::make_data_url(engine::encode_png(engine::synthetic_image(280, 280, seed)).value(),
                               "image/png");
}

json chat(const std::string& image_url, json params = nullptr) {
  json body = {
      {"model", "ecx-tiny-vl"},
      {"messages",
       json::array({{{"role", "user"},
                     {"content", json::array({{{"type", "text"}, {"text", "What is this?"}},
                                              {{"type", "image_url"},
                                               {"image_url", {{"url", image_url}}}}})}}})},
      {"max_tokens", 12},
      {"ignore_eos", true}};
  if (!params.is_null()) body["ec_transfer_params"] = params;
  return body;
}

httplib::Result post(const std::string& url, const std::string& path, const json& body) {
  httplib::Client cli(url);
  cli.set_read_timeout(std::chrono::seconds(120));
  return cli.Post(path, body.dump(), "application/json");
}

class TrustStack : public ::testing::Test {
 protected:
  void SetUp() override {
    ecx::testing::use_new_stack_secret();  // E and PD share it; this test process is the client
    std::string ec = R"({"connector":"p2p","extra":{"pool_bytes":"64MiB"}})";
    for (auto [svc, role] : {std::pair{&e_, "encoder"}, std::pair{&pd_, "pd"}}) {
      auto r = spawn_service({ECX_BINARY, "serve", role, "--port", "0", "--ec-config", ec},
                             Deadline::after_ms(60000));
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      svc->emplace(std::move(*r));
    }
    auto p = spawn_service(
        {ECX_BINARY, "serve", "proxy", "--port", "0", "--encoders", (*e_).url, "--pd", (*pd_).url},
        Deadline::after_ms(60000));
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    proxy_.emplace(std::move(*p));
  }
  void TearDown() override {
    for (auto* s : {&proxy_, &pd_, &e_}) {
      if (*s) stop_service((*s)->process, Deadline::after_ms(10000));
    }
  }

  // E's genuine answer for an image: {"mm_hash", "ec_transfer_params"}.
  json encode(const std::string& image_url) {
    auto r = post(e_->url, "/v1/encode", json{{"image", image_url}});
    EXPECT_TRUE(r && r->status == 200);
    return r ? json::parse(r->body, nullptr, false) : json();
  }

  std::string text_of(const httplib::Result& r) {
    EXPECT_TRUE(r);
    if (!r) return "";
    EXPECT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body, nullptr, false);
    return j.is_object() ? j["choices"][0]["message"]["content"].get<std::string>() : "";
  }

  std::optional<RunningService> e_, pd_, proxy_;
};

TEST_F(TrustStack, AClientCannotChooseTheEmbeddingsThePdUses) {
  // The right answers come from a PD that encodes everything itself: independent of
  // what the PD under attack holds in its cache.
  auto local = spawn_service({ECX_BINARY, "serve", "pd", "--port", "0", "--connector", "local"},
                             Deadline::after_ms(60000));
  ASSERT_TRUE(local.ok()) << local.status().to_string();
  const std::string a1 = png_url(101), a2 = png_url(102), b = png_url(202);
  std::map<std::string, std::string> right;
  for (const auto& img : {a1, a2, b}) {
    right[img] = text_of(post(local->url, "/v1/chat/completions", chat(img)));
  }
  stop_service(local->process, Deadline::after_ms(10000));
  ASSERT_NE(right[a1], right[b]);

  // Straight to the PD: image A1, with E's genuine params for image B relabelled as A1's.
  json e1 = encode(a1), e2 = encode(a2), eb = encode(b);
  std::string hash_a1 = e1["mm_hash"], hash_a2 = e2["mm_hash"];
  json swapped = eb["ec_transfer_params"];
  swapped["mm_hash"] = hash_a1;
  auto r1 = post(pd_->url, "/v1/chat/completions", chat(a1, {{hash_a1, swapped}}));
  EXPECT_EQ(text_of(r1), right[a1]) << "the PD answered from image B's embeddings";

  // Image A2 with params naming a producer of the client's choosing, unsigned.
  json forged = e2["ec_transfer_params"];
  forged["engine_id"] = "evil";
  forged.erase("signature");
  auto r2 = post(pd_->url, "/v1/chat/completions", chat(a2, {{hash_a2, forged}}));
  EXPECT_EQ(text_of(r2), right[a2]);

  // Nothing was poisoned: everyone gets each image's own answer afterwards.
  for (const auto& img : {a1, a2, b}) {
    EXPECT_EQ(text_of(post(proxy_->url, "/v1/chat/completions", chat(img))), right[img]);
  }
  // The PD refused both forgeries (and recomputed those items).
  httplib::Client cli(pd_->url);
  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("ecx_ec_params_rejected_total 2"), std::string::npos)
      << metrics->body;
}

// Secure by default: a service started without the deployment secret says so in its
// first log line, in /health and in a metric; with the secret, /health and the metric
// say it has one.
TEST(SecureByDefault, AServiceWithoutASecretSaysSoInItsFirstLogLineHealthAndMetrics) {
  std::string saved = std::getenv("ECX_AUTH_TOKEN") ? std::getenv("ECX_AUTH_TOKEN") : "";
  for (bool with_secret : {false, true}) {
    if (with_secret) {
      ecx::testing::use_new_stack_secret();
    } else {
      ::unsetenv("ECX_AUTH_TOKEN");
    }
    std::string ec = R"({"connector":"p2p","extra":{"pool_bytes":"64MiB"}})";
    auto pd = spawn_service({ECX_BINARY, "serve", "pd", "--port", "0", "--ec-config", ec},
                            Deadline::after_ms(60000));
    ASSERT_TRUE(pd.ok()) << pd.status().to_string();
    httplib::Client cli(pd->url);
    auto health = cli.Get("/health");
    auto metrics = cli.Get("/metrics");
    stop_service(pd->process, Deadline::after_ms(10000));
    ASSERT_TRUE(health && metrics);
    json h = json::parse(health->body, nullptr, false);
    const std::string first_line = pd->before.substr(0, pd->before.find('\n'));
    if (with_secret) {
      EXPECT_EQ(h["auth"], "secret") << health->body;
      EXPECT_FALSE(h.contains("warnings")) << health->body;
      EXPECT_NE(metrics->body.find("ecx_auth_secret_configured 1"), std::string::npos);
      EXPECT_EQ(first_line.find("event=insecure"), std::string::npos) << first_line;
    } else {
      EXPECT_EQ(h["auth"], "none") << health->body;
      ASSERT_TRUE(h["warnings"].is_array()) << health->body;
      EXPECT_NE(h["warnings"][0].get<std::string>().find("no deployment secret"),
                std::string::npos);
      EXPECT_NE(metrics->body.find("ecx_auth_secret_configured 0"), std::string::npos);
      EXPECT_NE(first_line.find("event=insecure service=pd"), std::string::npos) << first_line;
    }
  }
  if (saved.empty()) {
    ::unsetenv("ECX_AUTH_TOKEN");
  } else {
    ::setenv("ECX_AUTH_TOKEN", saved.c_str(), 1);
  }
}

}  // namespace
}  // namespace ecx::serve
