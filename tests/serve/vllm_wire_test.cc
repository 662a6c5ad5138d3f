// Interchangeable with vLLM on the wire (docs/SERVING.md, "vLLM's request shapes"):
// ecx's encoder answers the chat completion vLLM's EPD proxy sends an encode-only
// instance; ecx's PD takes the request that proxy forwards (its extra keys included);
// and ecx's proxy with --upstream-api vllm speaks that shape to its encoders. Real
// encoder, PD and proxy processes, real HTTP; a vLLM-shaped encoder faked in-process
// where the test needs one.
#include <gtest/gtest.h>
#include <httplib.h>

#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "ecx/common/mm_hash.h"
#include "ecx/connector/ec_transfer_params.h"
#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "support/service_metrics.h"
#include "support/stack_secret.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

const std::string kEcConfig = R"({"connector":"p2p","extra":{"pool_bytes":"64MiB"}})";

std::string png_url(uint64_t seed) {
  return engine::make_data_url(engine::encode_png(engine::synthetic_image(280, 280, seed)).value(),
                               "image/png");
}

json image_part(const std::string& url) {
  return {{"type", "image_url"}, {"image_url", {{"url", url}}}};
}

// Text, then images A, B and A again.
json three_image_chat(bool stream = false) {
  json content = json::array({{{"type", "text"}, {"text", "Compare these:"}},
                              image_part(png_url(41)),
                              image_part(png_url(42)),
                              image_part(png_url(41))});
  return {{"model", "ecx-tiny-vl"},
          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"max_tokens", 12},
          {"ignore_eos", true},
          {"stream", stream}};
}

// What vLLM's EPD proxy sends an encoder for `chat`: its image parts alone, each with a
// uuid; model null, stream false, no max_tokens.
json vllm_encoder_request(const json& chat) {
  json content = json::array();
  for (const json& part : chat["messages"][0]["content"]) {
    if (part["type"] != "image_url") continue;
    json p = part;
    p["uuid"] = "uuid-" + std::to_string(content.size());
    content.push_back(p);
  }
  return {{"model", nullptr},
          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"stream", false},
          {"mm_processor_kwargs", json::object()}};
}

httplib::Result post(const std::string& url, const std::string& path, const json& body) {
  httplib::Client cli(url);
  cli.set_read_timeout(std::chrono::seconds(120));
  return cli.Post(path, body.dump(), "application/json");
}

json answer_of(const httplib::Result& r) {
  EXPECT_TRUE(r);
  if (!r) return json();
  EXPECT_EQ(r->status, 200) << r->body;
  return json::parse(r->body, nullptr, false);
}

using ecx::testing::metric;
using ecx::testing::metric_reaches;

// Until the metric reads `want`, 2 s at most (far below the 30 s lease).
bool metric_reaches(const std::string& url, const std::string& name, double want) {
  return metric_reaches(url, name, want, Deadline::after_ms(2000));
}

// Services of one test, stopped proxy first.
class Services {
 public:
  ~Services() {
    for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
      stop_service(it->process, Deadline::after_ms(10000));
    }
  }
  Result<std::string> start(std::vector<std::string> flags) {
    flags.insert(flags.begin(), {ECX_BINARY, "serve"});
    ECX_ASSIGN_OR_RETURN(RunningService s, spawn_service(flags, Deadline::after_ms(60000)));
    running_.push_back(std::move(s));
    return running_.back().url;
  }
  // E, PD and a proxy whose encoders speak `upstream_api`; the URLs in that order.
  Result<std::vector<std::string>> start_stack(const std::string& upstream_api) {
    ECX_ASSIGN_OR_RETURN(std::string e,
                         start({"encoder", "--port", "0", "--ec-config", kEcConfig}));
    ECX_ASSIGN_OR_RETURN(std::string pd, start({"pd", "--port", "0", "--ec-config", kEcConfig}));
    ECX_ASSIGN_OR_RETURN(std::string proxy, start({"proxy", "--port", "0", "--encoders", e, "--pd",
                                                   pd, "--upstream-api", upstream_api}));
    return std::vector<std::string>{e, pd, proxy};
  }

 private:
  std::vector<RunningService> running_;
};

class VllmWireTest : public ::testing::Test {
 protected:
  void SetUp() override { ecx::testing::use_new_stack_secret(); }
};

TEST(VllmKeys, ExtraKeysInParamsParseAndTheSignatureStillCoversEcxsOwnFields) {
  connector::EcTransferParams p;
  p.connector = "p2p";
  p.mode = "pull";
  p.engine_id = "e-1";
  p.mm_hash = MmHash::sha256_of({"image"});
  p.meta = TensorMeta{DType::kBF16, {100, 64}};
  p.num_tokens = 100;
  p.region = 3;
  p.length = 12800;
  p.pin = 9;
  p.sign("secret");
  json j = p.to_json();
  j["modality"] = "image";
  j["item_indices"] = {0, 2};
  j["metadata"] = {{"image_grid_thw", {{1, 10, 10}}}};
  j["transfer_id"] = "abc";
  auto parsed = connector::EcTransferParams::from_json(j);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_TRUE(parsed->verify("secret").ok());
  j["pin"] = 10;  // an ecx field changed: no longer what the encoder signed
  auto tampered = connector::EcTransferParams::from_json(j);
  ASSERT_TRUE(tampered.ok());
  EXPECT_EQ(tampered->verify("secret").code(), StatusCode::kPermissionDenied);
}

TEST_F(VllmWireTest, TheEncoderAnswersVllmsChatCompletionWithParamsPerImage) {
  Services services;
  auto e = services.start({"encoder", "--port", "0", "--ec-config", kEcConfig});
  ASSERT_TRUE(e.ok()) << e.status().to_string();

  json answer =
      answer_of(post(*e, "/v1/chat/completions", vllm_encoder_request(three_image_chat())));
  ASSERT_TRUE(answer.is_object());
  EXPECT_EQ(answer["object"], "chat.completion");
  EXPECT_EQ(answer["model"], "ecx-tiny-vl");
  EXPECT_TRUE(answer["id"].is_string());
  EXPECT_EQ(answer["usage"]["completion_tokens"], 0);
  const json& params = answer["ec_transfer_params"];
  ASSERT_EQ(params.size(), 2u) << params.dump();  // images A and B, each encoded once

  // Each entry is keyed by the mm_hash /v1/encode gives that image, which it names.
  std::map<std::string, json> expected_indices = {{png_url(41), {0, 2}}, {png_url(42), {1}}};
  for (const auto& [url, indices] : expected_indices) {
    json encoded = answer_of(post(*e, "/v1/encode", json{{"image", url}}));
    std::string hash = encoded["mm_hash"];
    EXPECT_TRUE(encoded["cached"].get<bool>()) << "the chat completion encoded it already";
    ASSERT_TRUE(params.contains(hash)) << params.dump();
    const json& entry = params[hash];
    EXPECT_EQ(entry["modality"], "image");
    EXPECT_EQ(entry["item_indices"], indices);
    EXPECT_EQ(entry["metadata"], json::object());
    EXPECT_EQ(entry["mm_hash"], hash);
    EXPECT_EQ(entry["num_tokens"], encoded["num_tokens"]);
    // The /v1/encode answer pinned the block once more: give that pin back.
    auto released = post(*e, "/v1/ec/release",
                         json{{"ec_transfer_params", {{hash, encoded["ec_transfer_params"]}}}});
    ASSERT_TRUE(released && released->status == 200);
  }
  // The entries, extra keys and all, release the pins they hold.
  auto released = post(*e, "/v1/ec/release", json{{"ec_transfer_params", params}});
  ASSERT_TRUE(released);
  ASSERT_EQ(released->status, 200) << released->body;
  EXPECT_EQ(json::parse(released->body)["released"], 2);
  EXPECT_TRUE(metric_reaches(*e, "ecx_pool_pins", 0));

  // A bad image among good ones takes no pins; a streamed request is refused.
  json bad = vllm_encoder_request(three_image_chat());
  bad["messages"][0]["content"][1]["image_url"]["url"] = "data:image/png;base64,aGVsbG8gd29ybGQh";
  auto refused = post(*e, "/v1/chat/completions", bad);
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 422) << refused->body;
  json streamed = vllm_encoder_request(three_image_chat());
  streamed["stream"] = true;
  auto not_streamed = post(*e, "/v1/chat/completions", streamed);
  ASSERT_TRUE(not_streamed);
  EXPECT_EQ(not_streamed->status, 400) << not_streamed->body;
  EXPECT_EQ(metric(*e, "ecx_pool_pins"), 0);
}

TEST_F(VllmWireTest, ThePdTakesTheRequestVllmsProxyForwards) {
  Services services;
  auto e = services.start({"encoder", "--port", "0", "--ec-config", kEcConfig});
  auto pd = services.start({"pd", "--port", "0", "--ec-config", kEcConfig});
  ASSERT_TRUE(e.ok() && pd.ok());
  auto forwarded = [&](bool tamper) {
    json chat = three_image_chat();
    json params = answer_of(
        post(*e, "/v1/chat/completions", vllm_encoder_request(chat)))["ec_transfer_params"];
    // What vLLM's proxy adds: uuids on the images, ec_items among the params.
    json items = json::array();
    for (auto& [hash, entry] : params.items()) {
      items.push_back({{"mm_hash", hash}, {"transfer_id", "t-" + hash.substr(0, 8)}});
      if (tamper) entry["pin"] = entry["pin"].get<uint64_t>() + 1;
    }
    for (size_t i = 1; i < 4; ++i)
      chat["messages"][0]["content"][i]["uuid"] = "u" + std::to_string(i);
    params["ec_items"] = items;  // where vLLM's proxy puts it
    chat["ec_items"] = items;    // and at the top level, which ecx ignores just as well
    chat["ec_transfer_params"] = params;
    return answer_of(post(*pd, "/v1/chat/completions", chat));
  };
  json genuine = forwarded(false);
  ASSERT_TRUE(genuine.is_object());
  EXPECT_EQ(genuine["ecx_timings"]["items_recomputed"], 0) << "the PD did not load the params";
  EXPECT_LE(metric(*pd, "ecx_ec_params_rejected_total"), 0);
  // The signature still covers ecx's fields: a changed one is refused, the item recomputed.
  auto restart = services.start({"pd", "--port", "0", "--ec-config", kEcConfig});
  ASSERT_TRUE(restart.ok());
  pd = restart;  // a PD that does not hold the images yet
  json tampered = forwarded(true);
  ASSERT_TRUE(tampered.is_object());
  EXPECT_EQ(tampered["ecx_timings"]["items_recomputed"], 2);
  EXPECT_EQ(tampered["choices"][0]["message"]["content"],
            genuine["choices"][0]["message"]["content"]);
}

TEST_F(VllmWireTest, AProxyInVllmModeGivesTheSameAnswerAsTheDefault) {
  std::map<std::string, json> answers, streamed;
  for (std::string api : {"ecx", "vllm"}) {
    Services services;
    auto urls = services.start_stack(api);
    ASSERT_TRUE(urls.ok()) << api << ": " << urls.status().to_string();
    const std::string &e = (*urls)[0], &proxy = (*urls)[2];
    answers[api] = answer_of(post(proxy, "/v1/chat/completions", three_image_chat()));
    ASSERT_TRUE(answers[api].is_object()) << api;
    EXPECT_EQ(answers[api]["ecx_timings"]["items_recomputed"], 0) << api;
    EXPECT_EQ(metric(e, "ecx_encode_requests_total{cache=\"miss\"}"), 2) << api;
    // In vllm mode each distinct image came to E as a chat completion, never otherwise.
    EXPECT_EQ(metric(e, "ecx_encode_chat_requests_total"), api == "vllm" ? 2 : -1) << api;
    auto s = post(proxy, "/v1/chat/completions", three_image_chat(true));
    ASSERT_TRUE(s && s->status == 200) << api;
    streamed[api] = s->body;
    // Every pin ends with its request, in either mode.
    EXPECT_TRUE(metric_reaches(e, "ecx_pool_pins", 0)) << api;
  }
  for (const char* field : {"choices", "usage"}) {
    EXPECT_EQ(answers["vllm"][field].dump(), answers["ecx"][field].dump()) << field;
  }
  // The streamed text too (chunk ids and timestamps aside).
  auto text_of = [](const std::string& sse) {
    std::string text;
    for (size_t at = sse.find("\"content\":\""); at != std::string::npos;
         at = sse.find("\"content\":\"", at + 1)) {
      text += sse.substr(at + 11, sse.find('"', at + 11) - at - 11);
    }
    return text;
  };
  EXPECT_FALSE(text_of(streamed["ecx"]).empty());
  EXPECT_EQ(text_of(streamed["vllm"]), text_of(streamed["ecx"]));
}

// A vLLM-shaped encoder and a PD faked in-process: what the proxy sends each, and how it
// treats an encoder with no release endpoint.
class FakeUpstream {
 public:
  FakeUpstream() {
    port_ = server_.bind_to_any_port("127.0.0.1");  // listening: connections queue
    server_.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("{}", "application/json");
    });
  }
  ~FakeUpstream() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  // Serves, once every answer() is set.
  void start() {
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Answers POST `path` with `status` and `body`, and records what it got.
  void answer(const std::string& path, int status, const std::string& body) {
    server_.Post(path,
                 [this, path, status, body](const httplib::Request& req, httplib::Response& res) {
                   {
                     std::lock_guard lock(mu_);
                     received_[path].push_back(req.body);
                   }
                   cv_.notify_all();
                   res.status = status;
                   res.set_content(body, "application/json");
                 });
  }
  // Lists `model` at GET /v1/models, as vLLM does.
  void serve_model(const std::string& model) {
    server_.Get("/v1/models", [model](const httplib::Request&, httplib::Response& res) {
      res.set_content(
          json{{"object", "list"}, {"data", {{{"id", model}, {"object", "model"}}}}}.dump(),
          "application/json");
    });
  }
  // The bodies POSTed to `path`, once there are `n` (or what there is after 10 s).
  std::vector<std::string> received(const std::string& path, size_t n) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return received_[path].size() >= n; });
    return received_[path];
  }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<std::string>> received_;  // guarded by mu_
};

// Starts `encoder` and `pd` (their answers set) and a proxy in vllm mode in front of them.
Result<std::string> start_vllm_proxy(Services& services, FakeUpstream& encoder, FakeUpstream& pd) {
  pd.serve_model("ecx-tiny-vl");
  encoder.start();
  pd.start();
  return services.start({"proxy", "--port", "0", "--encoders", encoder.url(), "--pd", pd.url(),
                         "--upstream-api", "vllm"});
}

// In front of vLLM, a proxy told no --model serves what its PDs list at GET /v1/models (a
// client names the model vLLM serves, not ecx's default); until a PD has said, a request
// gets a 503 that names the fix.
TEST_F(VllmWireTest, AProxyInFrontOfVllmLearnsTheServedModelFromItsPds) {
  const std::string served = "Qwen/Qwen2.5-VL-3B-Instruct";
  FakeUpstream encoder, pd, silent_pd;
  encoder.answer(
      "/v1/chat/completions", 200,
      json{{"object", "chat.completion"}, {"ec_transfer_params", json::object()}}.dump());
  pd.answer("/v1/chat/completions", 200, R"({"object":"chat.completion","choices":[]})");
  pd.serve_model(served);
  encoder.start();
  pd.start();
  silent_pd.start();
  Services services;
  auto proxy = services.start({"proxy", "--port", "0", "--encoders", encoder.url(), "--pd",
                               pd.url(), "--upstream-api", "vllm"});
  ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();
  httplib::Client cli(*proxy);
  // The prober asks the PD at start; a slow first round is asked again 250 ms later.
  json listed;
  for (Deadline bound = Deadline::after_ms(10000); !bound.expired();
       std::this_thread::sleep_for(std::chrono::milliseconds(50))) {
    auto models = cli.Get("/v1/models");
    ASSERT_TRUE(models);
    listed = json::parse(models->body, nullptr, false);
    ASSERT_TRUE(listed.is_object()) << models->body;
    if (!listed["data"].empty()) break;
  }
  ASSERT_EQ(listed["data"].size(), 1u) << listed.dump();
  EXPECT_EQ(listed["data"][0]["id"], served);

  json chat = {{"model", served},
               {"messages", {{{"role", "user"}, {"content", "hello"}}}},
               {"max_tokens", 4}};
  auto ok = post(*proxy, "/v1/chat/completions", chat);
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_EQ(pd.received("/v1/chat/completions", 1).size(), 1u);

  chat["model"] = "ecx-tiny-vl";
  auto other = post(*proxy, "/v1/chat/completions", chat);
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 400) << other->body;
  EXPECT_NE(other->body.find("model_not_found"), std::string::npos) << other->body;
  EXPECT_NE(other->body.find(served), std::string::npos) << "names what is served: " << other->body;

  // A PD that lists no model: nothing is known, and the client is told how to fix it.
  auto blind = services.start({"proxy", "--port", "0", "--encoders", encoder.url(), "--pd",
                               silent_pd.url(), "--upstream-api", "vllm"});
  ASSERT_TRUE(blind.ok()) << blind.status().to_string();
  chat["model"] = served;
  auto unknown = post(*blind, "/v1/chat/completions", chat);
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 503) << unknown->body;
  EXPECT_NE(unknown->body.find("--model"), std::string::npos) << unknown->body;
}

TEST_F(VllmWireTest, AProxyInVllmModeSpeaksVllmsShapeAndForwardsTheParamsUnchanged) {
  FakeUpstream encoder, pd;
  json entry = {{"modality", "image"},
                {"item_indices", {0}},
                {"metadata", {{"image_grid_thw", {{1, 10, 10}}}}},
                {"peer_host", "10.0.0.1"},
                {"peer_port", 5601}};
  encoder.answer(
      "/v1/chat/completions", 200,
      json{{"object", "chat.completion"}, {"ec_transfer_params", {{"vllm-hash", entry}}}}.dump());
  encoder.answer("/v1/ec/release", 404, R"({"detail":"Not Found"})");
  pd.answer("/v1/chat/completions", 500, R"({"error":{"message":"decode failed"}})");
  Services services;
  auto proxy = start_vllm_proxy(services, encoder, pd);
  ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();
  json chat = three_image_chat();
  chat["messages"][0]["content"][2]["uuid"] = "client-uuid";
  auto res = post(*proxy, "/v1/chat/completions", chat);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 500) << res->body;  // the PD's answer

  // One chat completion per distinct image: the image alone, with a uuid, not streamed.
  std::vector<std::string> sent = encoder.received("/v1/chat/completions", 2);
  ASSERT_EQ(sent.size(), 2u);
  std::set<std::string> uuids;
  for (const std::string& body : sent) {
    json j = json::parse(body);
    EXPECT_EQ(j["model"], "ecx-tiny-vl");
    EXPECT_EQ(j["stream"], false);
    EXPECT_FALSE(j.contains("max_tokens"));
    ASSERT_EQ(j["messages"].size(), 1u);
    const json& content = j["messages"][0]["content"];
    ASSERT_EQ(content.size(), 1u) << body;
    EXPECT_EQ(content[0]["type"], "image_url");
    uuids.insert(content[0]["uuid"].get<std::string>());
  }
  // The client's own uuid is replaced by the image's content hash: a chosen uuid would
  // make its image stand for another user's in vLLM's caches.
  EXPECT_FALSE(uuids.count("client-uuid"));
  EXPECT_EQ(uuids.size(), 2u);
  // The PD gets the entry unchanged, and each image the uuid its encoder saw.
  json forwarded = json::parse(pd.received("/v1/chat/completions", 1).at(0));
  EXPECT_EQ(forwarded["ec_transfer_params"], json({{"vllm-hash", entry}}));
  const json& parts = forwarded["messages"][0]["content"];
  for (size_t i = 1; i < 4; ++i) EXPECT_TRUE(uuids.count(parts[i]["uuid"])) << parts[i].dump();
  EXPECT_EQ(parts[1]["uuid"], parts[3]["uuid"]) << "the same image, the same uuid";

  // Abandoned: the proxy tries to give the params back; a 404 means nothing to release.
  EXPECT_EQ(encoder.received("/v1/ec/release", 1).size(), 1u);
  EXPECT_EQ(metric(*proxy, "ecx_proxy_params_released_total"), -1);
}

// What a proxy in front of vLLM forwards is rebuilt from what it read: vLLM takes a part
// that carries a uuid by the first media key it finds, whatever its type, so a client's
// extra keys (a uuid, a second URL) must not reach the PD: with them it could file its
// image under another user's item in the PD's caches.
TEST_F(VllmWireTest, AProxyInVllmModeForwardsOnlyWhatItReadOfEachPart) {
  FakeUpstream encoder, pd;
  encoder.answer(
      "/v1/chat/completions", 200,
      json{{"object", "chat.completion"}, {"ec_transfer_params", json::object()}}.dump());
  pd.answer("/v1/chat/completions", 200, R"({"object":"chat.completion","choices":[]})");
  Services services;
  auto proxy = start_vllm_proxy(services, encoder, pd);
  ASSERT_TRUE(proxy.ok()) << proxy.status().to_string();
  const std::string victim = png_url(41), attacker = png_url(42);
  const std::string video = engine::make_data_url("an mp4", "video/mp4");
  json content = json::array(
      {{{"type", "text"}, {"text", "hi"}, {"image_url", {{"url", attacker}}}, {"uuid", "evil"}},
       {{"type", "video_url"}, {"video_url", {{"url", video}}}, {"image_url", {{"url", attacker}}}},
       {{"type", "image_url"}, {"image_url", {{"url", victim}, {"detail", "auto"}}}, {"uuid", "x"}},
       {{"type", "input_image"}, {"image_url", victim}}});
  json chat = {{"model", "ecx-tiny-vl"},
               {"messages", json::array({{{"role", "user"}, {"content", content}}})},
               {"max_tokens", 4}};
  auto res = post(*proxy, "/v1/chat/completions", chat);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
  json forwarded = json::parse(pd.received("/v1/chat/completions", 1).at(0));
  const json& parts = forwarded["messages"][0]["content"];
  ASSERT_EQ(parts.size(), 4u) << parts.dump();
  EXPECT_EQ(parts[0], json({{"type", "text"}, {"text", "hi"}}));
  const std::string video_uuid = MmHash::sha256_of({"video", "an mp4"}).str();
  EXPECT_EQ(parts[1],
            json({{"type", "video_url"}, {"video_url", {{"url", video}}}, {"uuid", video_uuid}}));
  // Both images are the victim's bytes: the same uuid, their content hash, and the
  // Responses-style input_image goes on as an image_url part.
  for (size_t i : {2, 3}) {
    EXPECT_EQ(parts[i]["type"], "image_url") << parts[i].dump();
    EXPECT_EQ(parts[i]["image_url"], json({{"url", victim}})) << parts[i].dump();
    EXPECT_EQ(parts[i].size(), 3u) << parts[i].dump();  // type, image_url, uuid
  }
  EXPECT_EQ(parts[2]["uuid"], parts[3]["uuid"]);
  EXPECT_NE(parts[2]["uuid"], "x");
  EXPECT_EQ(forwarded.dump().find(attacker), std::string::npos) << "the smuggled image went on";
  EXPECT_EQ(forwarded.dump().find("evil"), std::string::npos);
  // A part that carries embeddings is refused, naming it.
  chat["messages"][0]["content"] =
      json::array({{{"type", "image_embeds"}, {"image_embeds", "AA"}}});
  res = post(*proxy, "/v1/chat/completions", chat);
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_NE(res->body.find("image_embeds"), std::string::npos) << res->body;
}

}  // namespace
}  // namespace ecx::serve
