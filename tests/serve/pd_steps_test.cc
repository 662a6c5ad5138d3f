// The PD's chat completion, one step at a time (src/serve/pd_steps.h): each step on its
// own inputs, with the reference model and a real `local` connector where a step needs
// them, and a recording connector for what a request gives back.
#include "serve/pd_steps.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ecx/engine/image.h"
#include "openai/openai_request.h"

namespace ecx::serve {
namespace {

using nlohmann::json;

std::string png_url(int w, int h, uint64_t seed) {
  return engine::make_data_url(engine::encode_png(engine::synthetic_image(w, h, seed)).value(),
                               "image/png");
}

json image_part(const std::string& url) {
  return {{"type", "image_url"}, {"image_url", {{"url", url}}}};
}

json chat_body(json content, int max_tokens = 8) {
  return {{"model", "ecx-tiny-vl"},
          {"messages", json::array({{{"role", "user"}, {"content", content}}})},
          {"max_tokens", max_tokens},
          {"ignore_eos", true}};
}

ChatRequest parse(const json& body) {
  ChatRequest request;
  auto err = parse_chat_request(body.dump(), CommonServiceConfig{}, &request);
  EXPECT_FALSE(err) << err->message;
  return request;
}

// A connector that records what a request gives back; it loads nothing.
class RecordingConnector : public connector::EcConnector {
 public:
  std::vector<connector::LoadRequest> discarded;
  std::vector<std::string> finished;

  const std::string& name() const override { return name_; }
  connector::Role role() const override { return connector::Role::kConsumer; }
  const std::string& compat_hash() const override { return name_; }
  connector::FailurePolicy failure_policy() const override {
    return connector::FailurePolicy::kFail;
  }
  Result<connector::SaveSlot> begin_save(const MmHash&, const TensorMeta&) override {
    return Internal("a consumer saves nothing");
  }
  Result<connector::EcTransferParams> commit_save(const connector::SaveSlot&) override {
    return Internal("a consumer saves nothing");
  }
  Result<connector::EcTransferParams> saved_params(const MmHash&) override {
    return Internal("a consumer saves nothing");
  }
  void abort_save(const connector::SaveSlot&) override {}
  Status wait_for_readers(Deadline) override { return Status::Ok(); }
  Status release_params(const connector::EcTransferParams&) override { return Status::Ok(); }
  std::vector<bool> has_caches(const connector::LoadRequest& r) override {
    return std::vector<bool>(r.items.size(), false);
  }
  Status update_state_after_alloc(const connector::LoadRequest&, size_t) override {
    return Status::Ok();
  }
  connector::ConnectorMetadata build_connector_meta() override { return {}; }
  Status start_load_caches(const connector::ConnectorMetadata&) override { return Status::Ok(); }
  connector::LoadOutcome wait_for_load(const std::string&, Deadline) override { return {}; }
  std::vector<std::string> get_finished() override { return {}; }
  Result<cache::BlockRef> loaded(const std::string&, const MmHash& h) override {
    return NotFound(h.str());
  }
  void request_finished(const std::string& request_id) override { finished.push_back(request_id); }
  void discard(const connector::LoadRequest& request) override { discarded.push_back(request); }
  connector::ConnectorStats stats() const override { return {}; }

 private:
  std::string name_ = "recording";
};

class PdStepsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    config_ = new engine::ModelConfig();
    weights_ = new engine::Weights(engine::Weights::seeded(*config_));
    encoder_ = engine::VisionEncoder::create(*config_, *weights_).value().release();
    lm_ = engine::LanguageModel::create(*config_, *weights_).value().release();
  }
  static void TearDownTestSuite() {
    delete lm_;
    delete encoder_;
    delete weights_;
    delete config_;
  }

  // Decoded images of `request`; fails the test on an error.
  DecodedImages decode(const ChatRequest& request) {
    DecodedImages images;
    auto err = decode_images(request, *encoder_, engine::ImageLimits{}, &images);
    EXPECT_FALSE(err) << err->message;
    return images;
  }

  // Genuine-looking params for an image: its mm_hash and geometry.
  json params_for(const engine::PreparedImage& image) {
    connector::EcTransferParams p;
    p.connector = "p2p";
    p.engine_id = "e-test";
    p.mm_hash = image.mm_hash;
    p.meta = encoder_->output_meta(image);
    p.num_tokens = static_cast<uint64_t>(image.tokens());
    return p.to_json();
  }

  static engine::ModelConfig* config_;
  static engine::Weights* weights_;  // the encoder and the language model read them
  static engine::VisionEncoder* encoder_;
  static engine::LanguageModel* lm_;
};

engine::ModelConfig* PdStepsTest::config_ = nullptr;
engine::Weights* PdStepsTest::weights_ = nullptr;
engine::VisionEncoder* PdStepsTest::encoder_ = nullptr;
engine::LanguageModel* PdStepsTest::lm_ = nullptr;

TEST_F(PdStepsTest, ParseResolvesImagesAndRefusesWhatIsOverTheLimits) {
  ChatRequest request = parse(chat_body(
      json::array({{{"type", "text"}, {"text", "look:"}}, image_part(png_url(56, 56, 1))})));
  ASSERT_EQ(request.messages.size(), 1u);
  ASSERT_EQ(request.messages[0].parts.size(), 2u);
  EXPECT_EQ(request.messages[0].parts[1].kind, ContentPart::kImage);
  EXPECT_FALSE(request.messages[0].parts[1].media_bytes.empty());
  EXPECT_EQ(request.max_tokens, 8);

  CommonServiceConfig one_image;
  one_image.max_images = 1;
  ChatRequest refused;
  auto err = parse_chat_request(
      chat_body(json::array({image_part(png_url(56, 56, 1)), image_part(png_url(56, 56, 2))}))
          .dump(),
      one_image, &refused);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 413);
  err = parse_chat_request("{\"model\": ", CommonServiceConfig{}, &refused);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 400);
}

// Every media part vLLM takes, as a proxy in front of vLLM engines reads it, and as ecx's
// reference engine refuses what it cannot encode.
TEST(ChatPartsTest, VideoAndAudioAreMediaForVllmAndAClear400ForTheReferenceEngine) {
  const std::string video = engine::make_data_url("not really an mp4", "video/mp4");
  json parts =
      json::array({{{"type", "video_url"}, {"video_url", {{"url", video}}}},
                   {{"type", "input_audio"},
                    {"input_audio", {{"data", engine::base64_encode("RIFF")}, {"format", "wav"}}}},
                   {{"type", "audio_url"},
                    {"audio_url", {{"url", engine::make_data_url("ID3", "audio/mpeg")}}}},
                   {{"type", "input_image"}, {"image_url", png_url(8, 8, 1)}},
                   {{"type", "refusal"}, {"refusal", "no"}}});
  ChatRequest request;
  auto err = parse_chat_request(chat_body(parts).dump(), CommonServiceConfig{}, &request,
                                PartPolicy::kVllm);
  ASSERT_FALSE(err) << err->message;
  const auto& got = request.messages[0].parts;
  ASSERT_EQ(got.size(), 5u);
  EXPECT_EQ(got[0].kind, ContentPart::kVideo);
  EXPECT_EQ(got[0].media_bytes, "not really an mp4");
  EXPECT_EQ(got[0].modality(), "video");
  EXPECT_EQ(got[1].kind, ContentPart::kAudio);
  EXPECT_EQ(got[1].media_bytes, "RIFF");
  EXPECT_EQ(got[2].kind, ContentPart::kAudio);
  EXPECT_EQ(got[3].kind, ContentPart::kImage);
  EXPECT_EQ(got[3].media_key(), "image_url");
  EXPECT_EQ(got[4].kind, ContentPart::kText);
  EXPECT_EQ(got[4].text, "no");
  EXPECT_EQ(got[4].text_key(), "refusal");
  EXPECT_EQ(request.media_count(), 4);

  for (size_t i = 0; i < 4; ++i) {
    ChatRequest refused;
    err = parse_chat_request(chat_body(json::array({parts[i]})).dump(), CommonServiceConfig{},
                             &refused);
    ASSERT_TRUE(err);
    EXPECT_EQ(err->http_status, 400);
    EXPECT_NE(err->message.find(parts[i]["type"].get<std::string>()), std::string::npos);
    EXPECT_NE(err->message.find("--upstream-api vllm"), std::string::npos) << err->message;
  }
  // Parts that carry embeddings are not taken: a client does not choose what PD reads.
  ChatRequest refused;
  err = parse_chat_request(
      chat_body(json::array({{{"type", "image_embeds"}, {"image_embeds", "AAAA"}}})).dump(),
      CommonServiceConfig{}, &refused, PartPolicy::kVllm);
  ASSERT_TRUE(err);
  EXPECT_NE(err->message.find("a client does not choose embeddings"), std::string::npos)
      << err->message;
  // A video part must hold a video: the media type of its data URL is checked.
  err = parse_chat_request(
      chat_body(json::array({{{"type", "video_url"}, {"video_url", {{"url", png_url(8, 8, 1)}}}}}))
          .dump(),
      CommonServiceConfig{}, &refused, PartPolicy::kVllm);
  ASSERT_TRUE(err);
  EXPECT_NE(err->message.find("not a video/* type"), std::string::npos) << err->message;
  // Videos and audio count against max_images, as images do.
  refused = ChatRequest();
  CommonServiceConfig two_items;
  two_items.max_images = 2;
  err = parse_chat_request(chat_body(parts).dump(), two_items, &refused, PartPolicy::kVllm);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 413);
}

TEST_F(PdStepsTest, DecodeGivesEveryImagePartItsSlotAndEachDistinctImageOnce) {
  std::string a = png_url(56, 56, 1), b = png_url(112, 56, 2);
  ChatRequest request =
      parse(chat_body(json::array({image_part(a), image_part(b), image_part(a)})));
  DecodedImages images = decode(request);
  ASSERT_EQ(images.slots.size(), 3u);
  ASSERT_EQ(images.distinct.size(), 2u);
  EXPECT_EQ(images.slots[0].mm_hash, images.slots[2].mm_hash);
  EXPECT_EQ(images.slots[0].mm_hash, images.distinct[0].mm_hash);
  EXPECT_EQ(images.slots[1].mm_hash, images.distinct[1].mm_hash);
  EXPECT_EQ(images.slots[0].tokens, 4);  // 56x56 px: a 2x2 grid of 28 px
  EXPECT_EQ(images.slots[1].tokens, 8);
}

TEST_F(PdStepsTest, DecodeAnswers422ForAnUndecodableImageAnd413PastThePixelLimit) {
  ChatRequest broken = parse(chat_body(
      json::array({image_part("data:image/png;base64,aGVsbG8gd29ybGQh")})));  // "hello world!"
  DecodedImages images;
  auto err = decode_images(broken, *encoder_, engine::ImageLimits{}, &images);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 422);
  EXPECT_EQ(err->type, "invalid_image");

  ChatRequest large = parse(chat_body(json::array({image_part(png_url(200, 200, 3))})));
  engine::ImageLimits small;
  small.max_pixels = 100 * 100;
  err = decode_images(large, *encoder_, small, &images);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 413);
}

TEST_F(PdStepsTest, PlanLoadTakesTheImagesOwnParamsAndRefusesMismatchedOnes) {
  ChatRequest request = parse(
      chat_body(json::array({image_part(png_url(56, 56, 1)), image_part(png_url(56, 56, 2))})));
  DecodedImages images = decode(request);
  json params = {{images.distinct[0].mm_hash.str(), params_for(images.distinct[0])}};
  // Params for an image this request does not contain are ignored, malformed or not.
  params["not-an-image-of-this-request"] = {{"dtype", "Q9"}};
  connector::LoadRequest load;
  auto err = plan_load("req-1", images, params, *encoder_, &load);
  ASSERT_FALSE(err) << err->message;
  EXPECT_EQ(load.request_id, "req-1");
  ASSERT_EQ(load.items.size(), 2u);
  ASSERT_TRUE(load.items[0].params.has_value());
  EXPECT_EQ(load.items[0].params->engine_id, "e-test");
  EXPECT_EQ(load.items[0].meta, encoder_->output_meta(images.distinct[0]));
  EXPECT_FALSE(load.items[1].params.has_value());

  // Image 1's params under image 0's mm_hash: another image's embeddings.
  json swapped = {{images.distinct[0].mm_hash.str(), params_for(images.distinct[1])}};
  connector::LoadRequest refused;
  err = plan_load("req-2", images, swapped, *encoder_, &refused);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 400);
}

TEST_F(PdStepsTest, BuildPromptLaysOutRolesTextAndImagesAndCountsTheirTokens) {
  ChatRequest request = parse(chat_body(
      json::array({{{"type", "text"}, {"text", "compare"}}, image_part(png_url(56, 56, 1))})));
  DecodedImages images = decode(request);
  Prompt prompt = build_prompt(request, images.slots);
  ASSERT_EQ(prompt.parts.size(), 5u);
  EXPECT_EQ(prompt.parts[0].text, "user: ");
  EXPECT_EQ(prompt.parts[1].text, "compare");
  EXPECT_EQ(prompt.parts[2].image_tokens, 4);
  EXPECT_EQ(prompt.parts[3].text, "\n");
  EXPECT_EQ(prompt.parts[4].text, "assistant: ");
  ASSERT_EQ(prompt.images.size(), 1u);
  EXPECT_EQ(prompt.images[0].first, 2u);
  EXPECT_EQ(prompt.images[0].second, images.slots[0].mm_hash);
  // BOS + "user: " + "compare" + 4 image tokens + "\n" + "assistant: ".
  EXPECT_EQ(prompt.tokens(), 1 + 6 + 7 + 4 + 1 + 11);
}

TEST_F(PdStepsTest, PromptLengthCheckUsesTheBuiltPrompt) {
  ChatRequest request = parse(chat_body("hello", /*max_tokens=*/10));
  Prompt prompt = build_prompt(request, {});
  int64_t tokens = prompt.tokens();
  EXPECT_FALSE(check_prompt_length(prompt, 10, tokens + 10));
  auto err = check_prompt_length(prompt, 10, tokens + 9);
  ASSERT_TRUE(err);
  EXPECT_EQ(err->http_status, 400);
  EXPECT_EQ(err->type, "context_length_exceeded");
  EXPECT_NE(err->message.find(std::to_string(tokens) + " tokens"), std::string::npos)
      << err->message;
}

TEST_F(PdStepsTest, LoadEncodesLocallyAndAttachFillsEveryImagePart) {
  ChatRequest request = parse(chat_body(
      json::array({{{"type", "text"}, {"text", "what is it?"}}, image_part(png_url(56, 56, 4))})));
  DecodedImages images = decode(request);
  PreparedImages prepared;
  for (const auto& image : images.distinct) prepared.put(image);
  connector::ConnectorContext ctx;
  ctx.recompute = [&](const MmHash& h, const TensorMeta&, std::span<std::byte> out) -> Status {
    auto image = prepared.get(h);
    if (!image) return NotFound(h.str());
    return encoder_->encode(*image, out);
  };
  auto cc = connector::ConnectorConfig::from_name("local", connector::Role::kConsumer).value();
  cc.extra["compat_hash"] = config_->compat_hash();
  cc.extra["engine_id"] = "pd-steps-test";
  auto conn = connector::create_connector(cc, ctx);
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  connector::LoadRequest load;
  ASSERT_FALSE(plan_load("req-load", images, json::object(), *encoder_, &load));

  LoadReport report = load_embeddings(**conn, load, Deadline::after_ms(60000));
  ASSERT_TRUE(report.outcome.status.ok()) << report.outcome.status.to_string();
  EXPECT_EQ(report.recomputed, 1);
  EXPECT_GE(report.ec_load_ms(), 0.0);
  Prompt prompt = build_prompt(request, images.slots);
  auto err = attach_embeddings(
      prompt, [&](const MmHash& h) { return (*conn)->loaded("req-load", h); }, config_->embed_dim);
  ASSERT_FALSE(err) << err->message;
  EXPECT_EQ(prompt.parts[prompt.images[0].first].image.size(),
            encoder_->output_meta(images.distinct[0]).byte_size());
  // The language model counts the same prompt the length check counted.
  Generation generation = generate(*lm_, prompt, request, [](const std::string&) { return true; });
  ASSERT_TRUE(generation.status.ok()) << generation.status.to_string();
  EXPECT_EQ(generation.prompt_tokens, prompt.tokens());
  EXPECT_EQ(generation.generated, 8);
  (*conn)->request_finished("req-load");
}

TEST_F(PdStepsTest, LoadOfNothingIsOkAtOnce) {
  RecordingConnector conn;
  LoadReport report = load_embeddings(conn, connector::LoadRequest{}, Deadline::after_ms(1000));
  EXPECT_TRUE(report.outcome.status.ok());
  EXPECT_EQ(report.recomputed, 0);
  EXPECT_EQ(report.outcome.bytes, 0u);
}

TEST_F(PdStepsTest, LoadErrorIs504OnADeadlineElse502) {
  EXPECT_EQ(load_error(DeadlineExceeded("late")).http_status, 504);
  RequestError evicted = load_error(Status(StatusCode::kEvicted, "gone"));
  EXPECT_EQ(evicted.http_status, 502);
  EXPECT_EQ(evicted.type, "ec_load_failed");
}

TEST_F(PdStepsTest, AttachRefusesMissingOrMisshapenEmbeddings) {
  ChatRequest request = parse(chat_body(json::array({image_part(png_url(56, 56, 5))})));
  DecodedImages images = decode(request);
  Prompt prompt = build_prompt(request, images.slots);
  auto missing = attach_embeddings(
      prompt, [](const MmHash& h) -> Result<cache::BlockRef> { return NotFound(h.str()); },
      config_->embed_dim);
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->http_status, 500);
  // A block one token short.
  std::vector<std::byte> block(cache::kBlockHeaderBytes + 3 * config_->embed_dim * 2);
  auto short_block = attach_embeddings(
      prompt,
      [&](const MmHash& h) -> Result<cache::BlockRef> {
        cache::BlockRef ref;
        ref.mm_hash = h;
        ref.block = block.data();
        ref.block_length = block.size();
        return ref;
      },
      config_->embed_dim);
  ASSERT_TRUE(short_block);
  EXPECT_EQ(short_block->http_status, 500);
}

TEST_F(PdStepsTest, GenerateIsGreedyAndStopsWhenTheCallerSaysSo) {
  ChatRequest request = parse(chat_body("Say something.", /*max_tokens=*/6));
  Prompt prompt = build_prompt(request, {});
  std::string first, second;
  Generation a = generate(*lm_, prompt, request, [&](const std::string& t) {
    first += t;
    return true;
  });
  Generation b = generate(*lm_, prompt, request, [&](const std::string& t) {
    second += t;
    return true;
  });
  ASSERT_TRUE(a.status.ok());
  EXPECT_EQ(first, second);
  EXPECT_EQ(a.generated, 6);
  EXPECT_STREQ(finish_reason(a, request.max_tokens), "length");
  int seen = 0;
  Generation stopped =
      generate(*lm_, prompt, request, [&](const std::string&) { return ++seen < 2; });
  EXPECT_LT(stopped.generated, 6);
  EXPECT_STREQ(finish_reason(stopped, request.max_tokens), "stop");
}

TEST_F(PdStepsTest, RespondBuildsTheCompletionChunksAndUsageOnce) {
  ChatRequest request = parse(chat_body("hi", /*max_tokens=*/4));
  Generation generation;
  generation.prompt_tokens = 20;
  generation.generated = 4;
  json timings = {{"ec_load_ms", 1.5}};
  json completion = completion_json("chatcmpl-1", request, "abcd", generation, timings);
  EXPECT_EQ(completion["object"], "chat.completion");
  EXPECT_EQ(completion["model"], "ecx-tiny-vl");
  EXPECT_EQ(completion["choices"][0]["message"]["content"], "abcd");
  EXPECT_EQ(completion["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(completion["usage"], usage_json(generation));
  EXPECT_EQ(completion["usage"]["total_tokens"], 24);
  EXPECT_EQ(completion["ecx_timings"], timings);

  json token = chunk_json("chatcmpl-1", "ecx-tiny-vl", {{"content", "a"}}, nullptr);
  EXPECT_EQ(token["object"], "chat.completion.chunk");
  EXPECT_EQ(token["choices"][0]["delta"]["content"], "a");
  EXPECT_TRUE(token["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(token.contains("ecx_timings"));
  json last = chunk_json("chatcmpl-1", "ecx-tiny-vl", json::object(), "length", &timings);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(last["ecx_timings"], timings);
  json usage = usage_chunk_json("chatcmpl-1", "ecx-tiny-vl", generation);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"], usage_json(generation));
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
}

TEST_F(PdStepsTest, AHoldDiscardsTheParamsOfARequestThatNeverLoaded) {
  ChatRequest request = parse(chat_body(json::array({image_part(png_url(56, 56, 6))})));
  DecodedImages images = decode(request);
  json params = {{images.distinct[0].mm_hash.str(), params_for(images.distinct[0])},
                 {"junk", {{"connector", 5}}}};
  RecordingConnector conn;
  PreparedImages prepared;
  {
    RequestHold hold(prepared, conn, "req-early");
    hold.discard_on_failure(params_as_load("req-early", params));
    hold.hold_images(images.distinct);
    EXPECT_NE(prepared.get(images.distinct[0].mm_hash), nullptr);
  }  // the request failed here (say, its prompt was too long)
  ASSERT_EQ(conn.discarded.size(), 1u);
  ASSERT_EQ(conn.discarded[0].items.size(), 1u) << "params that do not parse pin nothing";
  EXPECT_EQ(conn.discarded[0].items[0].mm_hash, images.distinct[0].mm_hash);
  EXPECT_TRUE(conn.finished.empty());
  EXPECT_EQ(prepared.get(images.distinct[0].mm_hash), nullptr);
}

TEST_F(PdStepsTest, AHoldFinishesALoadedRequestExactlyOnce) {
  ChatRequest request = parse(chat_body(json::array({image_part(png_url(56, 56, 7))})));
  DecodedImages images = decode(request);
  RecordingConnector conn;
  PreparedImages prepared;
  prepared.put(images.distinct[0]);  // another request in flight holds the same image
  {
    RequestHold hold(prepared, conn, "req-loaded");
    hold.hold_images(images.distinct);
    hold.load_started();
    hold.release();
    hold.release();
  }
  EXPECT_EQ(conn.finished, std::vector<std::string>{"req-loaded"});
  EXPECT_TRUE(conn.discarded.empty());
  EXPECT_NE(prepared.get(images.distinct[0].mm_hash), nullptr) << "the other request's image";
}

}  // namespace
}  // namespace ecx::serve
