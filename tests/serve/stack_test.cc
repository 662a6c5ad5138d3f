// The whole stack as a user runs it: `ecx serve encoder|pd|proxy` processes on loopback,
// real HTTP. The same request must give byte-identical text through every connector.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

std::string redis_address() {
  const char* env = std::getenv("ECX_TEST_REDIS");
  return env ? env : "127.0.0.1:6391";
}

struct Service {
  std::optional<Subprocess> process;
  std::string host;
  int port = 0;
  std::string url() const { return "http://" + host + ":" + std::to_string(port); }
};

class Stack {
 public:
  // connector "" = no E (local); extra flags go to every service.
  Status start(const std::string& connector, const std::filesystem::path& dir,
               std::vector<std::string> extra = {}) {
    json ec = {{"connector", connector.substr(0, connector.find(':'))},
               {"extra", {{"pool_bytes", "96MiB"}}}};
    if (connector.find(':') != std::string::npos)
      ec["extra"]["mode"] = connector.substr(connector.find(':') + 1);
    if (connector == "disk") ec["extra"]["root"] = (dir / "disk").string();
    if (connector == "store") ec["extra"]["redis"] = redis_address();
    std::vector<std::string> common = {"--port",         "0",         "--ec-config", ec.dump(),
                                       "--allowed-root", dir.string()};
    common.insert(common.end(), extra.begin(), extra.end());
    bool local = connector == "local";
    if (!local) ECX_RETURN_IF_ERROR(launch(encoder, "encoder", common));
    ECX_RETURN_IF_ERROR(launch(pd, "pd", common));
    std::vector<std::string> proxy_flags = common;
    proxy_flags.insert(proxy_flags.end(),
                       {"--pd", pd.url(), "--connector", local ? "local" : "p2p"});
    if (!local) proxy_flags.insert(proxy_flags.end(), {"--encoders", encoder.url()});
    return launch(proxy, "proxy", proxy_flags);
  }

  static Status launch(Service& s, const std::string& role, const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {ECX_BINARY, "serve", role};
    argv.insert(argv.end(), flags.begin(), flags.end());
    ECX_ASSIGN_OR_RETURN(Subprocess p, Subprocess::spawn(argv));
    s.process.emplace(std::move(p));
    Deadline deadline = Deadline::after_ms(60000);
    std::string line;
    // Log lines (a warning of a service without a secret) may come before it.
    for (int i = 0; i < 64 && line.find("listening on http://") == std::string::npos; ++i) {
      ECX_ASSIGN_OR_RETURN(line, s.process->read_line(deadline));
    }
    auto at = line.rfind(':');
    if (line.find("listening on http://") == std::string::npos || at == std::string::npos) {
      return Internal(role + " did not start: " + line);
    }
    s.host = "127.0.0.1";
    s.port = std::atoi(line.substr(at + 1).c_str());
    return Status::Ok();
  }

  Service encoder, pd, proxy;
};

httplib::Result post(const Service& s, const std::string& path, const std::string& body) {
  httplib::Client cli(s.host, s.port);
  cli.set_read_timeout(std::chrono::seconds(120));
  return cli.Post(path, body, "application/json");
}

std::string png_url(int w, int h, uint64_t seed) {
  return engine::make_data_url(engine::encode_png(engine::synthetic_image(w, h, seed)).value(),
                               "image/png");
}

json chat(json content, bool stream = false) {
  return {{"model", "ecx-tiny-vl"},
          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"max_tokens", 16},
          {"ignore_eos", true},
          {"stream", stream}};
}

json two_image_request(bool stream = false) {
  std::string jpeg = engine::make_data_url(
      engine::encode_jpeg(engine::synthetic_image(300, 200, 8), 90).value(), "image/jpeg");
  return chat(json::array({{{"type", "text"}, {"text", "Compare these:"}},
                           {{"type", "image_url"}, {"image_url", {{"url", png_url(560, 560, 7)}}}},
                           {{"type", "image_url"}, {"image_url", {{"url", jpeg}}}}}),
              stream);
}

// Parses an SSE body: returns the concatenated content and checks the framing.
std::string parse_sse(const std::string& body, std::string* finish_reason) {
  std::string text;
  size_t pos = 0;
  bool done = false;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string event = body.substr(pos, end - pos);
    pos = end + 2;
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    std::string data = event.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    json chunk = json::parse(data, nullptr, false);
    EXPECT_FALSE(chunk.is_discarded()) << data;
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    const json& choice = chunk["choices"][0];
    if (choice["delta"].contains("content")) text += choice["delta"]["content"].get<std::string>();
    if (!choice["finish_reason"].is_null()) *finish_reason = choice["finish_reason"];
  }
  EXPECT_TRUE(done) << "stream did not end with [DONE]";
  EXPECT_EQ(pos, body.size());
  return text;
}

class StackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("ecx-stack-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::filesystem::path dir_;
};

TEST_F(StackTest, EveryConnectorGivesTheSameTextAsLocal) {
  std::map<std::string, std::string> texts;
  for (std::string connector : {"local", "p2p", "p2p:push", "disk", "store"}) {
    Stack stack;
    Status s = stack.start(connector, dir_);
    ASSERT_TRUE(s.ok()) << connector << ": " << s.to_string();
    auto res = post(stack.proxy, "/v1/chat/completions", two_image_request().dump());
    ASSERT_TRUE(res) << connector;
    ASSERT_EQ(res->status, 200) << connector << ": " << res->body;
    json out = json::parse(res->body);
    texts[connector] = out["choices"][0]["message"]["content"];
    EXPECT_EQ(texts[connector].size(), 16u);
    EXPECT_EQ(out["usage"]["completion_tokens"], 16);
    // The embeddings really travelled: nothing was recomputed, except in local mode.
    EXPECT_EQ(out["ecx_timings"]["items_recomputed"], connector == "local" ? 2 : 0) << connector;
    // Timings are this request's own: encoding only where PD encoded, never negative.
    EXPECT_GE(out["ecx_timings"]["ec_load_ms"].get<double>(), 0.0) << connector;
    if (connector == "local") {
      EXPECT_GT(out["ecx_timings"]["encode_ms"].get<double>(), 0.0);
    } else {
      EXPECT_EQ(out["ecx_timings"]["encode_ms"].get<double>(), 0.0) << connector;
    }
    // Streaming gives the same text, framed as OpenAI SSE.
    auto streamed = post(stack.proxy, "/v1/chat/completions", two_image_request(true).dump());
    ASSERT_TRUE(streamed);
    ASSERT_EQ(streamed->status, 200);
    EXPECT_NE(streamed->get_header_value("Content-Type").find("text/event-stream"),
              std::string::npos);
    std::string finish;
    EXPECT_EQ(parse_sse(streamed->body, &finish), texts[connector]) << connector;
    EXPECT_EQ(finish, "length");
  }
  for (const auto& [connector, text] : texts) EXPECT_EQ(text, texts["local"]) << connector;
}

TEST_F(StackTest, BadInputGetsClearErrorsAndTheServerKeepsServing) {
  Stack stack;
  ASSERT_TRUE(stack
                  .start("p2p", dir_,
                         {"--max-images", "3", "--max-image-pixels", "1000000", "--max-image-bytes",
                          "2000000"})
                  .ok());
  std::filesystem::path outside = std::filesystem::temp_directory_path() /
                                  ("ecx-outside-" + std::to_string(::getpid()) + ".png");
  std::ofstream(outside, std::ios::binary)
      << engine::encode_png(engine::synthetic_image(56, 56, 1)).value();
  auto image = [](const std::string& url) {
    return json{{"type", "image_url"}, {"image_url", {{"url", url}}}};
  };
  struct Case {
    const char* what;
    std::string body;
    int status;
  };
  std::vector<Case> cases = {
      {"malformed JSON", "{\"model\": ", 400},
      {"wrong field type", json{{"model", "ecx-tiny-vl"}, {"messages", "hello"}}.dump(), 400},
      {"max_tokens not a number",
       [] {
         json j = chat("hi");
         j["max_tokens"] = "ten";
         return j.dump();
       }(),
       400},
      {"bad base64", chat(json::array({image("data:image/png;base64,@@@@")})).dump(), 400},
      {"undecodable image",
       chat(json::array({image("data:image/png;base64,aGVsbG8gd29ybGQh")})).dump(), 422},
      {"too many pixels", chat(json::array({image(png_url(1200, 1000, 2))})).dump(), 413},
      {"too many bytes",
       chat(json::array({image("data:image/png;base64," + std::string(3'000'000, 'A'))})).dump(),
       413},
      {"too many images",
       chat(json::array({image(png_url(56, 56, 1)), image(png_url(56, 56, 2)),
                         image(png_url(56, 56, 3)), image(png_url(56, 56, 4))}))
           .dump(),
       413},
      {"unknown model",
       [] {
         json j = chat("hi");
         j["model"] = "gpt-9";
         return j.dump();
       }(),
       400},
      {"file outside the allowed root",
       chat(json::array({image("file://" + outside.string())})).dump(), 400},
      {"path traversal",
       chat(json::array({image("file://" + (dir_ / ".." / outside.filename()).string())})).dump(),
       400},
      {"remote URL", chat(json::array({image("http://example.com/cat.png")})).dump(), 400},
      {"nesting bomb", "{\"model\":\"ecx-tiny-vl\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"x\":" +
                           std::string(100000, '[') + std::string(100000, ']') + "}", 400},
      {"include_usage not a boolean", [] { json j = chat("hi"); j["stream_options"] = {{"include_usage", "yes"}}; return j.dump(); }(), 400},
      {"max_tokens past 32 bits", [] { json j = chat("hi"); j["max_tokens"] = 4294967297LL; return j.dump(); }(), 400},
      {"prompt longer than the model", chat(std::string(20000, 'x')).dump(), 400},
  };
  for (const auto& c : cases) {
    auto res = post(stack.proxy, "/v1/chat/completions", c.body);
    ASSERT_TRUE(res) << c.what;
    EXPECT_EQ(res->status, c.status) << c.what << ": " << res->body;
    json err = json::parse(res->body, nullptr, false);
    ASSERT_FALSE(err.is_discarded()) << c.what << ": not JSON: " << res->body;
    EXPECT_TRUE(err["error"]["message"].is_string()) << c.what;
  }
  std::filesystem::remove(outside);
  // PD and E validate too, when called directly.
  auto e = post(stack.encoder, "/v1/encode", "{\"image\": 5}");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 400);
  json bad_params = two_image_request();
  bad_params["ec_transfer_params"] = {
      {"abc", {{"connector", "p2p"}, {"mm_hash", "abc"}, {"dtype", "Q9"}, {"shape", {1}}}}};
  auto pd = post(stack.pd, "/v1/chat/completions", bad_params.dump());
  ASSERT_TRUE(pd);
  EXPECT_EQ(pd->status, 200) << "params for an mm_hash the request does not contain are ignored: "
                             << pd->body;
  // Still serving: health, models, a good request, and files under the root work.
  httplib::Client cli(stack.proxy.host, stack.proxy.port);
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto models = cli.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "ecx-tiny-vl");
  std::ofstream(dir_ / "ok.png", std::ios::binary)
      << engine::encode_png(engine::synthetic_image(112, 112, 4)).value();
  auto good = post(stack.proxy, "/v1/chat/completions",
                   chat(json::array({image("file://" + (dir_ / "ok.png").string())})).dump());
  ASSERT_TRUE(good);
  EXPECT_EQ(good->status, 200) << good->body;
  auto metrics = httplib::Client(stack.pd.host, stack.pd.port).Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("ecx_ec_load_seconds_count"), std::string::npos) << metrics->body;
  auto proxy_metrics = cli.Get("/metrics");
  ASSERT_TRUE(proxy_metrics);
  EXPECT_NE(proxy_metrics->body.find("ecx_proxy_failures_total{reason=\"bad_request\"}"),
            std::string::npos)
      << proxy_metrics->body;
}

TEST_F(StackTest, TheSameImageTwiceInOneRequestIsEncodedOnce) {
  Stack stack;
  ASSERT_TRUE(stack.start("p2p", dir_).ok());
  std::string url = png_url(280, 280, 21);
  json body = chat(json::array({{{"type", "image_url"}, {"image_url", {{"url", url}}}},
                                {{"type", "text"}, {"text", "and again"}},
                                {{"type", "image_url"}, {"image_url", {{"url", url}}}}}));
  // Several clients at once, all with the same image: every request succeeds.
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&] {
      auto res = post(stack.proxy, "/v1/chat/completions", body.dump());
      if (res && res->status == 200) ok++;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 4);
  httplib::Client e(stack.encoder.host, stack.encoder.port);
  auto metrics = e.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("ecx_encode_requests_total{cache=\"miss\"} 1"), std::string::npos)
      << metrics->body;
}

// The image's encodes (misses) an encoder counted, from its /metrics.
int encode_misses(const Service& e) {
  httplib::Client client(e.host, e.port);
  auto metrics = client.Get("/metrics");
  if (!metrics) return -1;
  const std::string name = "ecx_encode_requests_total{cache=\"miss\"} ";
  auto at = metrics->body.find(name);
  return at == std::string::npos ? 0 : std::atoi(metrics->body.c_str() + at + name.size());
}

// Two encoders, one image sent 4 times: routed by content it is encoded once (the same
// encoder holds it for the repeats); round robin sends the repeats to the other encoder
// too, which encodes it again.
TEST_F(StackTest, ContentRoutingSendsARepeatedImageToTheEncoderThatHoldsIt) {
  for (const std::string routing : {"content", "round-robin"}) {
    json ec = {{"connector", "p2p"}, {"extra", {{"pool_bytes", "96MiB"}}}};
    const std::vector<std::string> common = {"--port", "0", "--ec-config", ec.dump()};
    Service e1, e2, pd, proxy;
    ASSERT_TRUE(Stack::launch(e1, "encoder", common).ok());
    ASSERT_TRUE(Stack::launch(e2, "encoder", common).ok());
    ASSERT_TRUE(Stack::launch(pd, "pd", common).ok());
    std::vector<std::string> flags = common;
    flags.insert(flags.end(), {"--pd", pd.url(), "--encoders", e1.url() + "," + e2.url(),
                               "--encoder-routing", routing});
    ASSERT_TRUE(Stack::launch(proxy, "proxy", flags).ok());
    const json body =
        chat(json::array({{{"type", "image_url"}, {"image_url", {{"url", png_url(96, 96, 5)}}}},
                          {{"type", "text"}, {"text", "what is it"}}}));
    for (int i = 0; i < 4; ++i) {
      // (The proxy listens once its first probe round reached its encoders.)
      auto res = post(proxy, "/v1/chat/completions", body.dump());
      ASSERT_TRUE(res && res->status == 200) << routing << " " << i;
    }
    const int misses = encode_misses(e1) + encode_misses(e2);
    EXPECT_EQ(misses, routing == "content" ? 1 : 2) << routing;
  }
}

TEST_F(StackTest, BenchServeMeasuresEveryRequest) {
  Stack stack;
  ASSERT_TRUE(stack.start("p2p", dir_).ok());
  auto json_path = dir_ / "serve.json";
  auto bench = Subprocess::spawn({ECX_BINARY, "bench", "serve", "--base-url", stack.proxy.url(),
                                  "--num-prompts", "6", "--images", "2", "--input-len", "50",
                                  "--output-len", "8", "--json", json_path.string()});
  ASSERT_TRUE(bench.ok());
  std::string output;
  while (true) {
    auto line = bench->read_line(Deadline::after_ms(120000));
    if (!line.ok()) break;
    output += *line + "\n";
  }
  ASSERT_EQ(*bench->wait(Deadline::after_ms(60000)), 0) << output;
  for (const char* label :
       {"Successful requests:", "Mean TTFT (ms):", "P99 ITL (ms):", "Mean EC load (ms):"}) {
    EXPECT_NE(output.find(label), std::string::npos) << label;
  }
  std::ifstream in(json_path);
  json j = json::parse(in);
  EXPECT_EQ(j["successful_requests"], 6);
  EXPECT_EQ(j["failed_requests"], 0);
  EXPECT_EQ(j["total_output_tokens"], 48);
  EXPECT_GT(j["mean_ttft_ms"].get<double>(), 0.0);
}

TEST_F(StackTest, EvalReportsIdenticalAnswers) {
  auto eval = Subprocess::spawn({ECX_BINARY, "eval", "--requests", "2", "--max-tokens", "8",
                                 "--connectors", "p2p,disk", "--redis", redis_address()});
  ASSERT_TRUE(eval.ok());
  std::string output;
  while (true) {
    auto line = eval->read_line(Deadline::after_ms(180000));
    if (!line.ok()) break;
    output += *line + "\n";
  }
  EXPECT_EQ(*eval->wait(Deadline::after_ms(60000)), 0) << output;
  EXPECT_NE(output.find("p2p             2/2 answers identical to local"), std::string::npos)
      << output;
  EXPECT_NE(output.find("disk            2/2 answers identical to local"), std::string::npos)
      << output;
}

TEST_F(StackTest, SigtermLetsAStreamInFlightFinish) {
  Stack stack;
  ASSERT_TRUE(stack.start("p2p", dir_).ok());
  json body = two_image_request(true);
  body["max_tokens"] = 400;
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  std::string received;
  std::thread client([&] {
    httplib::Client cli(stack.pd.host, stack.pd.port);
    cli.set_read_timeout(std::chrono::seconds(120));
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/chat/completions";
    req.body = body.dump();
    req.set_header("Content-Type", "application/json");
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      std::lock_guard lock(mu);
      received.append(data, n);
      started = true;
      cv.notify_all();
      return true;
    };
    cli.send(req);
  });
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return started; }));
  }
  // SIGTERM while the answer is streaming: the PD finishes it, then exits 0.
  ASSERT_TRUE(stack.pd.process->kill(SIGTERM).ok());
  client.join();
  auto code = stack.pd.process->wait(Deadline::after_ms(60000));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  std::string finish;
  std::string text = parse_sse(received, &finish);
  EXPECT_EQ(text.size(), 400u);
  EXPECT_EQ(finish, "length");
}

TEST_F(StackTest, ServicesReadAConfigFile) {
  std::ofstream(dir_ / "pd.toml") << "port = 0\nmodel = \"renamed-model\"\nconnector = \"local\"\n";
  Service pd;
  ASSERT_TRUE(Stack::launch(pd, "pd", {"--config", (dir_ / "pd.toml").string()}).ok());
  httplib::Client cli(pd.host, pd.port);
  auto models = cli.Get("/v1/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "renamed-model");
  // A flag on the command line wins over the file.
  Service pd2;
  ASSERT_TRUE(
      Stack::launch(pd2, "pd", {"--config", (dir_ / "pd.toml").string(), "--model", "flag-model"})
          .ok());
  auto models2 = httplib::Client(pd2.host, pd2.port).Get("/v1/models");
  ASSERT_TRUE(models2);
  EXPECT_EQ(json::parse(models2->body)["data"][0]["id"], "flag-model");
}

TEST_F(StackTest, DeadEncoderIsReplacedByPdDeadPdGives502AndSigtermDrains) {
  Stack stack;
  ASSERT_TRUE(stack.start("p2p", dir_).ok());
  ASSERT_TRUE(stack.encoder.process->kill(SIGKILL).ok());
  ASSERT_TRUE(stack.encoder.process->wait(Deadline::after_ms(20000)).ok());
  // No encoder left: the PD encodes the images itself.
  auto res = post(stack.proxy, "/v1/chat/completions", two_image_request().dump());
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(json::parse(res->body)["ecx_timings"]["items_recomputed"], 2) << res->body;
  // A text-only request needs no encoder; with the PD stopped (SIGTERM: clean exit 0)
  // the proxy answers 502.
  ASSERT_TRUE(stack.pd.process->kill(SIGTERM).ok());
  auto code = stack.pd.process->wait(Deadline::after_ms(20000));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  auto text_only = post(stack.proxy, "/v1/chat/completions", chat("hello").dump());
  ASSERT_TRUE(text_only);
  EXPECT_EQ(text_only->status, 502) << text_only->body;
  ASSERT_TRUE(stack.proxy.process->kill(SIGTERM).ok());
  EXPECT_EQ(*stack.proxy.process->wait(Deadline::after_ms(20000)), 0);
}

}  // namespace
}  // namespace ecx::serve
