#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "ecx/common/checksum.h"
#include "ecx/common/subprocess.h"
#include "ecx/engine/image.h"
#include "ecx/engine/model.h"

namespace ecx::engine {
namespace {

TEST(Image, PngAndJpegDecodeWhatWasEncoded) {
  Image img = synthetic_image(97, 61, 3);
  auto png = encode_png(img);
  ASSERT_TRUE(png.ok());
  auto back = decode_image(*png, {});
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->width, 97);
  EXPECT_EQ(back->height, 61);
  EXPECT_EQ(back->rgb, img.rgb);  // lossless
  auto jpg = encode_jpeg(img, 90);
  ASSERT_TRUE(jpg.ok());
  auto j = decode_image(*jpg, {});
  ASSERT_TRUE(j.ok()) << j.status().to_string();
  EXPECT_EQ(j->width, 97);
  EXPECT_EQ(j->height, 61);
}

// An image's size from its header alone, as decoding finds it, under the same limits.
TEST(Image, TheSizeIsReadFromTheHeaderUnderTheDecodeLimits) {
  Image img = synthetic_image(97, 61, 3);
  for (const std::string& bytes : {encode_png(img).value(), encode_jpeg(img, 90).value()}) {
    auto size = read_image_size(bytes, {});
    ASSERT_TRUE(size.ok()) << size.status().to_string();
    EXPECT_EQ(size->width, 97);
    EXPECT_EQ(size->height, 61);
    EXPECT_EQ(read_image_size(bytes, {.max_bytes = 1 << 20, .max_pixels = 1000}).status().code(),
              StatusCode::kResourceExhausted);
    EXPECT_EQ(read_image_size(bytes.substr(0, 12), {}).status().code(),
              StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(read_image_size("hello", {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(Image, BadInputIsAClearErrorNotACrash) {
  EXPECT_EQ(decode_image("hello", {}).status().code(), StatusCode::kInvalidArgument);
  auto png = encode_png(synthetic_image(64, 64, 1)).value();
  std::string truncated = png.substr(0, png.size() / 2);
  EXPECT_EQ(decode_image(truncated, {}).status().code(), StatusCode::kInvalidArgument);
  auto jpg = encode_jpeg(synthetic_image(64, 64, 1), 80).value();
  std::string broken = jpg.substr(0, 40);
  EXPECT_EQ(decode_image(broken, {}).status().code(), StatusCode::kInvalidArgument);
  // Limits are enforced from the header, before decoding.
  auto big = decode_image(png, {.max_bytes = 1 << 20, .max_pixels = 1000});
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  auto heavy = decode_image(png, {.max_bytes = 10, .max_pixels = 1 << 20});
  EXPECT_EQ(heavy.status().code(), StatusCode::kResourceExhausted);
}

// Found by the png_decode fuzzer (tests/fuzz/corpus/png_decode/regress-itxt-declares-1.9GB):
// libpng allocates and zeroes a chunk's declared length before reading it, so a few
// hundred bytes claiming a 1.9 GB text chunk cost 1.9 GB. Refused before libpng sees it.
TEST(Image, PngChunkLongerThanTheDataIsRefusedWithoutAllocatingIt) {
  std::string png = encode_png(synthetic_image(6, 4, 1)).value();
  const size_t after_ihdr = 8 + 12 + 13;
  std::string chunk("\x73\x00\x00\x20iTXtkeyword", 15);  // declares 0x73000020 bytes
  png.insert(after_ihdr, chunk);
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  auto decoded = decode_image(png, {});
  getrusage(RUSAGE_SELF, &after);
  ASSERT_EQ(decoded.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(decoded.status().message().find("chunk iTXt at offset 33"), std::string::npos)
      << decoded.status().message();
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 256 * 1024) << "peak RSS grew (KiB)";
}

TEST(Image, Base64AndDataUrls) {
  for (const std::string& s :
       std::vector<std::string>{"", "a", "ab", "abc", "abcd", std::string("\0\xff\x10", 3)}) {
    auto back = base64_decode(base64_encode(s));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s);
  }
  EXPECT_FALSE(base64_decode("abc").ok());
  EXPECT_FALSE(base64_decode("ab!d").ok());
  EXPECT_FALSE(base64_decode("a=bc").ok());
  auto url = make_data_url("xyz", "image/png");
  EXPECT_EQ(*decode_data_url(url), "xyz");
  EXPECT_FALSE(decode_data_url("http://example.com/a.png").ok());
  EXPECT_FALSE(decode_data_url("data:text/plain;base64,eHl6").ok());
  EXPECT_FALSE(decode_data_url("data:image/png,raw").ok());
}

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    weights_ = Weights::seeded(config_);
    encoder_ = std::move(VisionEncoder::create(config_, weights_).value());
    lm_ = std::move(LanguageModel::create(config_, weights_).value());
  }
  std::vector<std::byte> encode(const Image& img) {
    auto prepared = encoder_->prepare(img).value();
    std::vector<std::byte> out(encoder_->output_meta(prepared).byte_size());
    EXPECT_TRUE(encoder_->encode(prepared, out).ok());
    return out;
  }
  ModelConfig config_;
  Weights weights_;
  std::unique_ptr<VisionEncoder> encoder_;
  std::unique_ptr<LanguageModel> lm_;
};

TEST_F(ModelTest, QwenGeometry) {
  auto seed = encoder_->prepare(synthetic_image(560, 560, 1));
  ASSERT_TRUE(seed.ok());
  EXPECT_EQ(seed->tokens(), 400);
  EXPECT_EQ(encoder_->output_meta(*seed).byte_size(), 1'638'400u);
  auto heavy = encoder_->prepare(synthetic_image(1920, 1080, 1));
  ASSERT_TRUE(heavy.ok());
  EXPECT_EQ(heavy->tokens(), 2691);  // 39 x 69
  auto tiny = encoder_->prepare(synthetic_image(10, 10, 1));
  ASSERT_TRUE(tiny.ok());
  EXPECT_GE(tiny->grid_h * 28 * tiny->grid_w * 28, 56 * 56);  // raised to min_pixels
  // The grid from the size alone is the one prepare makes.
  for (auto [w, h] : {std::pair{560, 560}, {1920, 1080}, {10, 10}, {4000, 3000}, {29, 5000}}) {
    auto prepared = encoder_->prepare(synthetic_image(w, h, 1));
    auto grid = encoder_->grid_for(w, h);
    ASSERT_EQ(prepared.ok(), grid.ok()) << w << "x" << h;
    if (!grid.ok()) continue;
    EXPECT_EQ(grid->h, prepared->grid_h) << w << "x" << h;
    EXPECT_EQ(grid->w, prepared->grid_w) << w << "x" << h;
    EXPECT_EQ(grid->tokens(), prepared->tokens());
  }
  EXPECT_FALSE(encoder_->grid_for(0, 10).ok());
  EXPECT_FALSE(encoder_->grid_for(1, 500).ok());  // aspect ratio over 200
}

TEST_F(ModelTest, EncoderIsDeterministicAndHashesPixels) {
  Image a = synthetic_image(280, 196, 5), b = synthetic_image(280, 196, 6);
  auto ea1 = encode(a), ea2 = encode(a), eb = encode(b);
  EXPECT_EQ(ea1, ea2);
  EXPECT_NE(ea1, eb);
  EXPECT_EQ(encoder_->prepare(a)->mm_hash, encoder_->prepare(a)->mm_hash);
  EXPECT_NE(encoder_->prepare(a)->mm_hash, encoder_->prepare(b)->mm_hash);
}

TEST_F(ModelTest, GenerationIsDeterministicAndDependsOnTheImage) {
  auto ea = encode(synthetic_image(280, 280, 1));
  auto eb = encode(synthetic_image(280, 280, 2));
  auto run = [&](const std::vector<std::byte>& emb) {
    std::string text;
    int n = 0;
    std::vector<PromptPart> prompt = {
        {"user: describe ", {}, 0}, {"", emb, 100}, {"\nassistant: ", {}, 0}};
    auto r = lm_->generate(
        prompt, {.max_tokens = 24, .ignore_eos = true},
        [&](const std::string& t) {
          text += t;
          return true;
        },
        &n, nullptr);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(n, 24);
    return text;
  };
  std::string t1 = run(ea), t2 = run(ea), t3 = run(eb);
  EXPECT_EQ(t1, t2);
  EXPECT_EQ(t1.size(), 24u);
  EXPECT_NE(t1, t3);
  for (char ch : t1) EXPECT_TRUE(ch >= 32 && ch <= 126);
}

TEST_F(ModelTest, ExportedWeightsLoadBackToTheSameModel) {
  auto path = std::filesystem::temp_directory_path() /
              ("ecx-weights-" + std::to_string(::getpid()) + ".safetensors");
  ASSERT_TRUE(weights_.save(path.string()).ok());
  auto loaded = Weights::load(path.string(), config_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  auto enc2 = VisionEncoder::create(config_, *loaded);
  ASSERT_TRUE(enc2.ok());
  Image img = synthetic_image(140, 140, 9);
  auto p = (*enc2)->prepare(img).value();
  std::vector<std::byte> out((*enc2)->output_meta(p).byte_size());
  ASSERT_TRUE((*enc2)->encode(p, out).ok());
  EXPECT_EQ(out, encode(img));
  // A file of another model is refused by name.
  ModelConfig other = config_;
  other.vit_width = 32;
  auto wrong = Weights::load(path.string(), other);
  EXPECT_FALSE(wrong.ok());
  std::filesystem::remove(path);
}

TEST_F(ModelTest, CliExportWritesTheSeededWeights) {
  auto path = std::filesystem::temp_directory_path() /
              ("ecx-cli-weights-" + std::to_string(::getpid()) + ".safetensors");
  auto p = Subprocess::spawn({ECX_BINARY, "weights", "export", "--out", path.string()});
  ASSERT_TRUE(p.ok());
  auto code = p->wait(Deadline::after_ms(60000));
  ASSERT_TRUE(code.ok());
  ASSERT_EQ(*code, 0);
  auto loaded = Weights::load(path.string(), config_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  ASSERT_EQ(loaded->tensors.size(), weights_.tensors.size());
  for (const auto& [name, t] : weights_.tensors) {
    ASSERT_EQ(loaded->tensors.at(name).data, t.data) << name;
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace ecx::engine
