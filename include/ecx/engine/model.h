// The reference model: real data geometry (Qwen2.5-VL style preprocessing, embeddings
// of width 2048 in bf16), scaled-down compute so the whole pipeline runs on a CPU.
//
//   VisionEncoder  image -> 28 px grid -> 14 px patches -> ViT blocks -> 2x2 merge ->
//                  projection -> bf16 [tokens, embed_dim]   (tokens = H/28 * W/28)
//   LanguageModel  byte tokens + image embeddings -> small decoder-only transformer with
//                  a KV cache -> greedy decoding
// Deterministic: BLAS runs single-threaded here, so every process produces the same bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/common/tensor_meta.h"
#include "ecx/engine/image.h"

namespace ecx::engine {

struct ModelConfig {
  std::string model_id = "ecx-tiny-vl";
  uint64_t seed = 20261130;
  // Preprocessing (Qwen2.5-VL): sizes rounded to multiples of 28 px, pixel bounds.
  int patch = 14;
  int merge = 2;
  uint64_t min_pixels = 56 * 56;
  uint64_t max_pixels = 16384ull * 28 * 28;
  // Vision tower.
  int vit_width = 64;
  int vit_depth = 1;
  int vit_heads = 4;
  int embed_dim = 2048;  // the LM embedding width of Qwen2.5-VL-3B
  // Language model.
  int lm_width = 128;
  int lm_layers = 2;
  int lm_heads = 4;
  int lm_ff = 256;

  // Identifies model + preprocessing + dtype: producers and consumers must agree.
  std::string compat_hash() const;
  // Preprocessing settings that change an image's encoding (part of its mm_hash).
  std::string preprocessing_id() const;
};

// Named float32 tensors.
struct Weights {
  struct Tensor {
    std::vector<int64_t> shape;
    std::vector<float> data;
  };
  std::map<std::string, Tensor> tensors;

  // The model's weights generated from config.seed (deterministic).
  static Weights seeded(const ModelConfig& config);
  // Loads F32 tensors from a safetensors file; every tensor the model needs must be
  // present with the right shape.
  static Result<Weights> load(const std::string& path, const ModelConfig& config);
  Status save(const std::string& path) const;
  Result<const Tensor*> get(const std::string& name, std::vector<int64_t> shape) const;
};

struct PreparedImage {
  MmHash mm_hash;
  int grid_h = 0;  // tokens along the height (resized height / 28)
  int grid_w = 0;
  std::vector<float> pixels;  // normalized, [resized_h, resized_w, 3]
  int tokens() const { return grid_h * grid_w; }
};

class VisionEncoder {
 public:
  static Result<std::unique_ptr<VisionEncoder>> create(const ModelConfig& config,
                                                       const Weights& weights);
  ~VisionEncoder();

  // The token grid of an image of this size (the resize prepare does), from its size
  // alone: what an image costs the context before it is decoded.
  struct Grid {
    int h = 0;
    int w = 0;
    int64_t tokens() const { return int64_t{h} * w; }
  };
  Result<Grid> grid_for(int width, int height) const;
  // Resizes and normalizes; computes the mm_hash over model, preprocessing, size, pixels.
  Result<PreparedImage> prepare(const Image& image) const;
  // The output tensor's geometry for a prepared image: bf16 [tokens, embed_dim].
  TensorMeta output_meta(const PreparedImage& image) const;
  // Encodes into `out` (exactly output_meta().byte_size() bytes). `cancelled`, when set,
  // is asked between steps and between pieces of the attention: once it answers true the
  // encode stops with kCancelled (its caller's request was abandoned).
  Status encode(const PreparedImage& image, std::span<std::byte> out,
                const std::function<bool()>& cancelled = {}) const;

 private:
  struct Impl;
  explicit VisionEncoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Byte-level tokenizer: tokens 0..255 are bytes; then BOS and EOS.
constexpr int kBosToken = 256;
constexpr int kEosToken = 257;
constexpr int kVocabSize = 258;

// One piece of a prompt: text, or an image's embeddings (bf16 [tokens, embed_dim]).
struct PromptPart {
  std::string text;
  std::span<const std::byte> image;  // empty for text
  int64_t image_tokens = 0;
};

struct GenerateOptions {
  int max_tokens = 16;
  bool ignore_eos = false;
};

class LanguageModel {
 public:
  static Result<std::unique_ptr<LanguageModel>> create(const ModelConfig& config,
                                                       const Weights& weights);
  ~LanguageModel();

  // Prefill the prompt, then greedy decoding. `on_token` receives each generated
  // token's text as it is produced (printable ASCII); returning false stops early.
  // Returns the number of prompt tokens; *generated gets the count generated.
  Result<int64_t> generate(const std::vector<PromptPart>& prompt, const GenerateOptions& options,
                           const std::function<bool(const std::string&)>& on_token, int* generated,
                           double* prefill_ms) const;

 private:
  struct Impl;
  explicit LanguageModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// bf16 helpers (round to nearest even).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);

}  // namespace ecx::engine
