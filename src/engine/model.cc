#include "ecx/engine/model.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "ecx/common/checksum.h"
#include "ecx/common/safetensors.h"
#include "engine/ops.h"

namespace ecx::engine {
namespace {

using Shape = std::vector<int64_t>;

constexpr int64_t kMaxPromptTokens = 65536;

void block_shapes(std::vector<std::pair<std::string, Shape>>& out, const std::string& p, int d,
                  int ff) {
  out.push_back({p + ".ln1.g", {d}});
  out.push_back({p + ".ln1.b", {d}});
  out.push_back({p + ".qkv", {d, 3 * d}});
  out.push_back({p + ".out", {d, d}});
  out.push_back({p + ".ln2.g", {d}});
  out.push_back({p + ".ln2.b", {d}});
  out.push_back({p + ".fc1", {d, ff}});
  out.push_back({p + ".fc2", {ff, d}});
}

std::vector<std::pair<std::string, Shape>> weight_shapes(const ModelConfig& c) {
  std::vector<std::pair<std::string, Shape>> out;
  int patch_dim = c.patch * c.patch * 3;
  out.push_back({"vis.patch", {patch_dim, c.vit_width}});
  for (int i = 0; i < c.vit_depth; ++i)
    block_shapes(out, "vis.blk" + std::to_string(i), c.vit_width, 4 * c.vit_width);
  out.push_back({"vis.merge", {c.merge * c.merge * c.vit_width, c.vit_width}});
  out.push_back({"vis.proj", {c.vit_width, c.embed_dim}});
  out.push_back({"lm.embed", {kVocabSize, c.lm_width}});
  out.push_back({"lm.img_proj", {c.embed_dim, c.lm_width}});
  for (int i = 0; i < c.lm_layers; ++i)
    block_shapes(out, "lm.blk" + std::to_string(i), c.lm_width, c.lm_ff);
  out.push_back({"lm.ln_f.g", {c.lm_width}});
  out.push_back({"lm.ln_f.b", {c.lm_width}});
  out.push_back({"lm.head", {c.lm_width, kVocabSize}});
  return out;
}

// One transformer block's weights, resolved once.
struct Block {
  const float *ln1_g, *ln1_b, *qkv, *out, *ln2_g, *ln2_b, *fc1, *fc2;
  int d, ff;
};

// The data of tensor `name`, which must have `shape`.
Result<const float*> resolve(const Weights& w, const std::string& name, const Shape& shape) {
  ECX_ASSIGN_OR_RETURN(const Weights::Tensor* t, w.get(name, shape));
  return t->data.data();
}

Result<Block> resolve_block(const Weights& w, const std::string& p, int d, int ff) {
  Block b{};
  b.d = d;
  b.ff = ff;
  ECX_ASSIGN_OR_RETURN(b.ln1_g, resolve(w, p + ".ln1.g", {d}));
  ECX_ASSIGN_OR_RETURN(b.ln1_b, resolve(w, p + ".ln1.b", {d}));
  ECX_ASSIGN_OR_RETURN(b.qkv, resolve(w, p + ".qkv", {d, 3 * d}));
  ECX_ASSIGN_OR_RETURN(b.out, resolve(w, p + ".out", {d, d}));
  ECX_ASSIGN_OR_RETURN(b.ln2_g, resolve(w, p + ".ln2.g", {d}));
  ECX_ASSIGN_OR_RETURN(b.ln2_b, resolve(w, p + ".ln2.b", {d}));
  ECX_ASSIGN_OR_RETURN(b.fc1, resolve(w, p + ".fc1", {d, ff}));
  ECX_ASSIGN_OR_RETURN(b.fc2, resolve(w, p + ".fc2", {ff, d}));
  return b;
}

// Blocks `prefix`0 .. `prefix`(count-1).
Result<std::vector<Block>> resolve_blocks(const Weights& w, const std::string& prefix, int count,
                                          int d, int ff) {
  std::vector<Block> blocks;
  for (int i = 0; i < count; ++i) {
    ECX_ASSIGN_OR_RETURN(Block b, resolve_block(w, prefix + std::to_string(i), d, ff));
    blocks.push_back(b);
  }
  return blocks;
}

// x [rows, d] in place. Keys/values of earlier positions may come from a cache (LM).
// Query rows of one piece of an encoder's attention, between two cancellation checks.
constexpr int kAttentionChunkRows = 256;

// One transformer block on x [rows, d]. With `cancelled` (the encoder's, never causal),
// the attention runs in pieces of kAttentionChunkRows query rows (each row is computed
// alone, so the result is the same) and stops early, returning false, once it answers
// true.
bool run_block(const Block& b, std::vector<float>& x, int rows, int heads, bool causal,
               std::vector<float>* k_cache, std::vector<float>* v_cache,
               const std::function<bool()>* cancelled = nullptr) {
  const int d = b.d;
  std::vector<float> h(x);
  ops::layer_norm(h.data(), rows, d, b.ln1_g, b.ln1_b);
  std::vector<float> qkv(static_cast<size_t>(rows) * 3 * d);
  ops::matmul(h.data(), b.qkv, qkv.data(), rows, d, 3 * d);
  std::vector<float> q(static_cast<size_t>(rows) * d), k(q.size()), v(q.size());
  for (int r = 0; r < rows; ++r) {
    const float* src = qkv.data() + static_cast<size_t>(r) * 3 * d;
    std::memcpy(q.data() + static_cast<size_t>(r) * d, src, d * sizeof(float));
    std::memcpy(k.data() + static_cast<size_t>(r) * d, src + d, d * sizeof(float));
    std::memcpy(v.data() + static_cast<size_t>(r) * d, src + 2 * d, d * sizeof(float));
  }
  int offset = 0;
  const float *keys = k.data(), *values = v.data();
  int kv_rows = rows;
  if (k_cache != nullptr) {
    offset = static_cast<int>(k_cache->size() / d);
    k_cache->insert(k_cache->end(), k.begin(), k.end());
    v_cache->insert(v_cache->end(), v.begin(), v.end());
    keys = k_cache->data();
    values = v_cache->data();
    kv_rows = offset + rows;
  }
  std::vector<float> att(static_cast<size_t>(rows) * d);
  if (cancelled != nullptr && *cancelled && !causal) {
    for (int r0 = 0; r0 < rows; r0 += kAttentionChunkRows) {
      if ((*cancelled)()) return false;
      const int n = std::min(kAttentionChunkRows, rows - r0);
      const size_t at = static_cast<size_t>(r0) * d;
      ops::attention(q.data() + at, keys, values, att.data() + at, n, kv_rows, d, heads, false, 0);
    }
  } else {
    ops::attention(q.data(), keys, values, att.data(), rows, kv_rows, d, heads, causal, offset);
  }
  std::vector<float> proj(att.size());
  ops::matmul(att.data(), b.out, proj.data(), rows, d, d);
  ops::add(x.data(), proj.data(), proj.size());
  h = x;
  ops::layer_norm(h.data(), rows, d, b.ln2_g, b.ln2_b);
  std::vector<float> f(static_cast<size_t>(rows) * b.ff);
  ops::matmul(h.data(), b.fc1, f.data(), rows, d, b.ff);
  ops::gelu(f.data(), f.size());
  ops::matmul(f.data(), b.fc2, proj.data(), rows, b.ff, d);
  ops::add(x.data(), proj.data(), proj.size());
  return true;
}

}  // namespace

std::string ModelConfig::preprocessing_id() const {
  return "qwen2.5-vl-resize/patch" + std::to_string(patch) + "/merge" + std::to_string(merge) +
         "/min" + std::to_string(min_pixels) + "/max" + std::to_string(max_pixels) + "/clip-norm";
}

std::string ModelConfig::compat_hash() const {
  MmHash h = MmHash::sha256_of({model_id, std::to_string(seed), preprocessing_id(),
                                std::to_string(vit_width), std::to_string(vit_depth),
                                std::to_string(embed_dim), "bf16"});
  return model_id + "-" + h.str().substr(0, 16);
}

uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

Weights Weights::seeded(const ModelConfig& config) {
  Weights w;
  for (const auto& [name, shape] : weight_shapes(config)) {
    Tensor t;
    t.shape = shape;
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    t.data.resize(n);
    bool is_gain = name.ends_with(".g");
    bool is_bias = name.ends_with(".b");
    if (is_gain || is_bias) {
      std::fill(t.data.begin(), t.data.end(), is_gain ? 1.0f : 0.0f);
    } else {
      // Uniform in +-1/sqrt(fan_in), from a stream seeded by (seed, name).
      std::vector<uint64_t> bits(n);
      fill_pattern(bits.data(), n * sizeof(uint64_t),
                   config.seed ^ checksum64(name.data(), name.size()));
      float scale =
          (name == "lm.embed" ? 1.0f : 1.0f / std::sqrt(static_cast<float>(shape[0]))) * 1.7f;
      for (size_t i = 0; i < n; ++i) {
        double u = static_cast<double>(bits[i] >> 11) / static_cast<double>(1ull << 53);  // [0, 1)
        t.data[i] = static_cast<float>((2.0 * u - 1.0) * scale);
      }
    }
    w.tensors.emplace(name, std::move(t));
  }
  return w;
}

Result<const Weights::Tensor*> Weights::get(const std::string& name,
                                            std::vector<int64_t> shape) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) return NotFound("weights lack tensor '" + name + "'");
  if (it->second.shape != shape)
    return InvalidArgument("weights tensor '" + name + "' has the wrong shape");
  return &it->second;
}

Status Weights::save(const std::string& path) const {
  std::vector<SafetensorsTensor> list;
  for (const auto& [name, t] : tensors) {
    list.push_back({name, TensorMeta{DType::kF32, t.shape},
                    std::span<const std::byte>(reinterpret_cast<const std::byte*>(t.data.data()),
                                               t.data.size() * sizeof(float))});
  }
  return write_safetensors(path, list, {{"format", "ecx-reference-model"}});
}

Result<Weights> Weights::load(const std::string& path, const ModelConfig& config) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open weights " + path, errno);
  struct stat st {};
  ::fstat(fd, &st);
  auto header = read_safetensors_header(fd, static_cast<uint64_t>(st.st_size));
  if (!header.ok()) {
    ::close(fd);
    return header.status().with_context(path);
  }
  Weights w;
  for (const auto& [name, shape] : weight_shapes(config)) {
    const SafetensorsEntry* e = header->find(name);
    Status s;
    if (e == nullptr) s = NotFound(path + " lacks tensor '" + name + "'");
    if (s.ok() && (e->meta.dtype != DType::kF32 || e->meta.shape != shape)) {
      s = InvalidArgument(path + ": tensor '" + name + "' is " + e->meta.to_string() +
                          ", the model needs F32");
    }
    Tensor t;
    t.shape = shape;
    if (s.ok()) {
      t.data.resize(e->meta.element_count());
      s = read_safetensors_tensor(
          fd, *header, *e,
          {reinterpret_cast<std::byte*>(t.data.data()), t.data.size() * sizeof(float)});
    }
    if (!s.ok()) {
      ::close(fd);
      return s;
    }
    w.tensors.emplace(name, std::move(t));
  }
  ::close(fd);
  return w;
}

// ---------------------------------------------------------------- vision encoder

struct VisionEncoder::Impl {
  ModelConfig config;
  const float* patch = nullptr;
  const float* merge = nullptr;
  const float* proj = nullptr;
  std::vector<Block> blocks;
};

VisionEncoder::VisionEncoder(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
VisionEncoder::~VisionEncoder() = default;

Result<std::unique_ptr<VisionEncoder>> VisionEncoder::create(const ModelConfig& c,
                                                             const Weights& w) {
  ops::use_single_thread();
  auto impl = std::make_unique<Impl>();
  impl->config = c;
  const int dv = c.vit_width;
  ECX_ASSIGN_OR_RETURN(impl->patch, resolve(w, "vis.patch", {c.patch * c.patch * 3, dv}));
  ECX_ASSIGN_OR_RETURN(impl->merge, resolve(w, "vis.merge", {c.merge * c.merge * dv, dv}));
  ECX_ASSIGN_OR_RETURN(impl->proj, resolve(w, "vis.proj", {dv, c.embed_dim}));
  ECX_ASSIGN_OR_RETURN(impl->blocks, resolve_blocks(w, "vis.blk", c.vit_depth, dv, 4 * dv));
  return std::unique_ptr<VisionEncoder>(new VisionEncoder(std::move(impl)));
}

Result<VisionEncoder::Grid> VisionEncoder::grid_for(int width, int height) const {
  const ModelConfig& c = impl_->config;
  const int unit = c.patch * c.merge;  // 28
  const double h = height, w = width;
  if (width <= 0 || height <= 0) return InvalidArgument("image has zero width or height");
  if (std::max(h, w) / std::min(h, w) > 200)
    return InvalidArgument("image aspect ratio exceeds 200");
  // Qwen2.5-VL smart resize.
  double h_bar = std::max<double>(unit, std::round(h / unit) * unit);
  double w_bar = std::max<double>(unit, std::round(w / unit) * unit);
  if (h_bar * w_bar > static_cast<double>(c.max_pixels)) {
    double beta = std::sqrt(h * w / static_cast<double>(c.max_pixels));
    h_bar = std::max<double>(unit, std::floor(h / beta / unit) * unit);
    w_bar = std::max<double>(unit, std::floor(w / beta / unit) * unit);
  } else if (h_bar * w_bar < static_cast<double>(c.min_pixels)) {
    double beta = std::sqrt(static_cast<double>(c.min_pixels) / (h * w));
    h_bar = std::ceil(h * beta / unit) * unit;
    w_bar = std::ceil(w * beta / unit) * unit;
  }
  return Grid{static_cast<int>(h_bar) / unit, static_cast<int>(w_bar) / unit};
}

Result<PreparedImage> VisionEncoder::prepare(const Image& image) const {
  const ModelConfig& c = impl_->config;
  const int unit = c.patch * c.merge;  // 28
  const double h = image.height, w = image.width;
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return InvalidArgument("image has inconsistent dimensions");
  }
  ECX_ASSIGN_OR_RETURN(Grid grid, grid_for(image.width, image.height));
  PreparedImage out;
  const int rh = grid.h * unit, rw = grid.w * unit;
  out.grid_h = grid.h;
  out.grid_w = grid.w;
  out.pixels.resize(static_cast<size_t>(rh) * rw * 3);
  static constexpr float kMean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
  static constexpr float kStd[3] = {0.26862954f, 0.26130258f, 0.27577711f};
  // Bilinear resize (pixel centres aligned), then CLIP normalization.
  for (int y = 0; y < rh; ++y) {
    double sy = std::clamp((y + 0.5) * h / rh - 0.5, 0.0, h - 1);
    int y0 = static_cast<int>(sy), y1 = std::min(y0 + 1, image.height - 1);
    double fy = sy - y0;
    for (int x = 0; x < rw; ++x) {
      double sx = std::clamp((x + 0.5) * w / rw - 0.5, 0.0, w - 1);
      int x0 = static_cast<int>(sx), x1 = std::min(x0 + 1, image.width - 1);
      double fx = sx - x0;
      for (int ch = 0; ch < 3; ++ch) {
        auto px = [&](int yy, int xx) {
          return image.rgb[(static_cast<size_t>(yy) * image.width + xx) * 3 + ch];
        };
        double v = (1 - fy) * ((1 - fx) * px(y0, x0) + fx * px(y0, x1)) +
                   fy * ((1 - fx) * px(y1, x0) + fx * px(y1, x1));
        out.pixels[(static_cast<size_t>(y) * rw + x) * 3 + ch] =
            (static_cast<float>(v / 255.0) - kMean[ch]) / kStd[ch];
      }
    }
  }
  std::string dims = std::to_string(image.width) + "x" + std::to_string(image.height);
  out.mm_hash = MmHash::sha256_of(
      {c.model_id, c.preprocessing_id(), dims,
       std::string_view(reinterpret_cast<const char*>(image.rgb.data()), image.rgb.size())});
  return out;
}

TensorMeta VisionEncoder::output_meta(const PreparedImage& image) const {
  return TensorMeta{DType::kBF16, {image.tokens(), impl_->config.embed_dim}};
}

Status VisionEncoder::encode(const PreparedImage& image, std::span<std::byte> out,
                             const std::function<bool()>& cancelled) const {
  const Status stopped(StatusCode::kCancelled, "encode cancelled: its request was abandoned");
  const ModelConfig& c = impl_->config;
  TensorMeta meta = output_meta(image);
  if (out.size() != meta.byte_size()) {
    return InvalidArgument("encode: output of " + std::to_string(out.size()) + " bytes for " +
                           meta.to_string());
  }
  const int p = c.patch, m = c.merge, dv = c.vit_width;
  const int ph = image.grid_h * m, pw = image.grid_w * m;  // patches
  const int rw = pw * p;
  const int patch_dim = p * p * 3;
  // Patches in merge order: for each merged token (gy, gx), its m x m patches.
  const int tokens = image.tokens();
  const int patches = tokens * m * m;
  std::vector<float> flat(static_cast<size_t>(patches) * patch_dim);
  int idx = 0;
  for (int gy = 0; gy < image.grid_h; ++gy) {
    for (int gx = 0; gx < image.grid_w; ++gx) {
      for (int sy = 0; sy < m; ++sy) {
        for (int sx = 0; sx < m; ++sx, ++idx) {
          int py = gy * m + sy, px = gx * m + sx;
          float* dst = flat.data() + static_cast<size_t>(idx) * patch_dim;
          for (int yy = 0; yy < p; ++yy) {
            const float* src =
                image.pixels.data() + (static_cast<size_t>(py * p + yy) * rw + px * p) * 3;
            std::memcpy(dst + yy * p * 3, src, p * 3 * sizeof(float));
          }
        }
      }
    }
  }
  (void)ph;
  std::vector<float> x(static_cast<size_t>(patches) * dv);
  ops::matmul(flat.data(), impl_->patch, x.data(), patches, patch_dim, dv);
  // 2x2 merge: consecutive m*m patch rows form one token row of width m*m*dv.
  std::vector<float> merged(static_cast<size_t>(tokens) * dv);
  ops::matmul(x.data(), impl_->merge, merged.data(), tokens, m * m * dv, dv);
  if (cancelled && cancelled()) return stopped;
  for (const Block& b : impl_->blocks) {
    if (!run_block(b, merged, tokens, c.vit_heads, false, nullptr, nullptr, &cancelled)) {
      return stopped;
    }
  }
  if (cancelled && cancelled()) return stopped;
  std::vector<float> emb(static_cast<size_t>(tokens) * c.embed_dim);
  ops::matmul(merged.data(), impl_->proj, emb.data(), tokens, dv, c.embed_dim);
  auto* dst = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < emb.size(); ++i) dst[i] = float_to_bf16(emb[i]);
  return Status::Ok();
}

// ---------------------------------------------------------------- language model

namespace {

// Tokens of a prompt: BOS, one per text byte, an image's tokens.
int64_t prompt_tokens(const std::vector<PromptPart>& prompt) {
  int64_t tokens = 1;
  for (const auto& part : prompt) {
    tokens += part.image.empty() ? static_cast<int64_t>(part.text.size()) : part.image_tokens;
  }
  return tokens;
}

// Adds the sinusoidal encoding of position `pos` to `row` [d].
void add_position(float* row, int64_t pos, int d) {
  for (int i = 0; i < d; i += 2) {
    double freq = std::pow(10000.0, -static_cast<double>(i) / d);
    row[i] += static_cast<float>(std::sin(pos * freq));
    if (i + 1 < d) row[i + 1] += static_cast<float>(std::cos(pos * freq));
  }
}

// Keys and values of every position so far, per block.
struct KvCache {
  explicit KvCache(size_t blocks) : k(blocks), v(blocks) {}
  std::vector<std::vector<float>> k, v;
};

}  // namespace

struct LanguageModel::Impl {
  ModelConfig config;
  const float *embed = nullptr, *img_proj = nullptr, *ln_g = nullptr, *ln_b = nullptr,
              *head = nullptr;
  std::vector<Block> blocks;

  // The prompt's embeddings [tokens, lm_width], positions not yet added.
  Result<std::vector<float>> embed_prompt(const std::vector<PromptPart>& prompt) const;
  // Appends an image's embeddings, projected to lm_width, to `x`.
  Status embed_image(const PromptPart& part, std::vector<float>& x) const;
  // Runs `rows` new positions `h` through every block, extending `cache`.
  void forward(std::vector<float>& h, int rows, KvCache& cache) const;
  // The greedy choice after hidden state `last`.
  int next_token(const float* last, bool ignore_eos) const;
  // Generates after the prompt's last hidden state; returns how many tokens it produced.
  int decode(const float* last, int64_t pos, const GenerateOptions& options,
             const std::function<bool(const std::string&)>& on_token, KvCache& cache) const;
};

LanguageModel::LanguageModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LanguageModel::~LanguageModel() = default;

Result<std::unique_ptr<LanguageModel>> LanguageModel::create(const ModelConfig& c,
                                                             const Weights& w) {
  ops::use_single_thread();
  auto impl = std::make_unique<Impl>();
  impl->config = c;
  const int d = c.lm_width;
  ECX_ASSIGN_OR_RETURN(impl->embed, resolve(w, "lm.embed", {kVocabSize, d}));
  ECX_ASSIGN_OR_RETURN(impl->img_proj, resolve(w, "lm.img_proj", {c.embed_dim, d}));
  ECX_ASSIGN_OR_RETURN(impl->ln_g, resolve(w, "lm.ln_f.g", {d}));
  ECX_ASSIGN_OR_RETURN(impl->ln_b, resolve(w, "lm.ln_f.b", {d}));
  ECX_ASSIGN_OR_RETURN(impl->head, resolve(w, "lm.head", {d, kVocabSize}));
  ECX_ASSIGN_OR_RETURN(impl->blocks, resolve_blocks(w, "lm.blk", c.lm_layers, d, c.lm_ff));
  return std::unique_ptr<LanguageModel>(new LanguageModel(std::move(impl)));
}

Result<std::vector<float>> LanguageModel::Impl::embed_prompt(
    const std::vector<PromptPart>& prompt) const {
  const int d = config.lm_width;
  // Check the length before allocating anything for it.
  int64_t expected_len = prompt_tokens(prompt);
  if (expected_len > kMaxPromptTokens) {
    return Status(StatusCode::kResourceExhausted, "prompt of " + std::to_string(expected_len) +
                                                      " tokens exceeds " +
                                                      std::to_string(kMaxPromptTokens));
  }
  std::vector<float> x;
  x.reserve(static_cast<size_t>(expected_len) * d);
  auto push_token = [&](int tok) {
    x.insert(x.end(), embed + static_cast<size_t>(tok) * d,
             embed + static_cast<size_t>(tok + 1) * d);
  };
  push_token(kBosToken);
  for (const auto& part : prompt) {
    if (part.image.empty()) {
      for (unsigned char ch : part.text) push_token(ch);
      continue;
    }
    ECX_RETURN_IF_ERROR(embed_image(part, x));
  }
  return x;
}

Status LanguageModel::Impl::embed_image(const PromptPart& part, std::vector<float>& x) const {
  const int d = config.lm_width;
  if (part.image.size() != static_cast<size_t>(part.image_tokens) * config.embed_dim * 2) {
    return InvalidArgument("image embedding of " + std::to_string(part.image.size()) +
                           " bytes for " + std::to_string(part.image_tokens) + " tokens");
  }
  std::vector<float> img(static_cast<size_t>(part.image_tokens) * config.embed_dim);
  const auto* src = reinterpret_cast<const uint16_t*>(part.image.data());
  for (size_t i = 0; i < img.size(); ++i) img[i] = bf16_to_float(src[i]);
  size_t base = x.size();
  x.resize(base + static_cast<size_t>(part.image_tokens) * d);
  ops::matmul(img.data(), img_proj, x.data() + base, static_cast<int>(part.image_tokens),
              config.embed_dim, d);
  return Status::Ok();
}

void LanguageModel::Impl::forward(std::vector<float>& h, int rows, KvCache& cache) const {
  for (size_t l = 0; l < blocks.size(); ++l) {
    run_block(blocks[l], h, rows, config.lm_heads, true, &cache.k[l], &cache.v[l]);
  }
}

int LanguageModel::Impl::next_token(const float* last, bool ignore_eos) const {
  const int d = config.lm_width;
  std::vector<float> h(last, last + d);
  ops::layer_norm(h.data(), 1, d, ln_g, ln_b);
  std::vector<float> logits(kVocabSize);
  ops::matmul(h.data(), head, logits.data(), 1, d, kVocabSize);
  // Printable ASCII only (the byte tokenizer never emits broken UTF-8), plus EOS.
  int best = -1;
  for (int t = 32; t <= 126; ++t) {
    if (best < 0 || logits[t] > logits[best]) best = t;
  }
  if (!ignore_eos && logits[kEosToken] > logits[best]) best = kEosToken;
  return best;
}

int LanguageModel::Impl::decode(const float* last, int64_t pos, const GenerateOptions& options,
                                const std::function<bool(const std::string&)>& on_token,
                                KvCache& cache) const {
  const int d = config.lm_width;
  int count = 0;
  int tok = next_token(last, options.ignore_eos);
  while (count < options.max_tokens && tok != kEosToken) {
    ++count;
    if (!on_token(std::string(1, static_cast<char>(tok)))) break;
    if (count == options.max_tokens) break;
    std::vector<float> h(embed + static_cast<size_t>(tok) * d,
                         embed + static_cast<size_t>(tok + 1) * d);
    add_position(h.data(), pos++, d);
    forward(h, 1, cache);
    tok = next_token(h.data(), options.ignore_eos);
  }
  return count;
}

Result<int64_t> LanguageModel::generate(const std::vector<PromptPart>& prompt,
                                        const GenerateOptions& options,
                                        const std::function<bool(const std::string&)>& on_token,
                                        int* generated, double* prefill_ms) const {
  const int d = impl_->config.lm_width;
  auto t0 = std::chrono::steady_clock::now();
  ECX_ASSIGN_OR_RETURN(std::vector<float> x, impl_->embed_prompt(prompt));
  const int64_t prompt_len = static_cast<int64_t>(x.size() / d);
  for (int64_t pos = 0; pos < prompt_len; ++pos) add_position(x.data() + pos * d, pos, d);
  KvCache cache(impl_->blocks.size());
  impl_->forward(x, static_cast<int>(prompt_len), cache);
  if (prefill_ms)
    *prefill_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  int count = impl_->decode(x.data() + (prompt_len - 1) * d, prompt_len, options, on_token, cache);
  if (generated) *generated = count;
  return prompt_len;
}

}  // namespace ecx::engine
