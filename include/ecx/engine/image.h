// Images: decoding (PNG, JPEG) to RGB8 with limits checked before any pixel is
// allocated, encoding (for tests, the demo and clients), and base64 data URLs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/common/status.h"

namespace ecx::engine {

struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // width * height * 3, row-major
};

struct ImageLimits {
  uint64_t max_bytes = 20ull << 20;      // encoded size
  uint64_t max_pixels = 4096ull * 4096;  // width * height of the decoded image
};

// Decodes PNG or JPEG (detected from the magic bytes). Errors: kInvalidArgument for
// data that is not a supported image or is corrupt ("cannot decode ..."),
// kResourceExhausted for images over a limit (checked from the header, before decoding).
Result<Image> decode_image(std::string_view bytes, const ImageLimits& limits);

// The width and height a PNG or JPEG declares, read from its header alone (no pixel is
// decoded), with the errors of decode_image for what the header shows.
struct ImageSize {
  int width = 0;
  int height = 0;
};
Result<ImageSize> read_image_size(std::string_view bytes, const ImageLimits& limits);

Result<std::string> encode_png(const Image& image);
Result<std::string> encode_jpeg(const Image& image, int quality);

// Base64 (RFC 4648, with padding). decode rejects anything else with kInvalidArgument.
std::string base64_encode(std::string_view bytes);
Result<std::string> base64_decode(std::string_view text);

// "data:image/png;base64,..." -> the decoded bytes; kInvalidArgument otherwise, and for
// a media type other than `type`/* ("image", "video", "audio").
Result<std::string> decode_data_url(std::string_view url, std::string_view type = "image");
std::string make_data_url(std::string_view bytes, std::string_view mime);

// A deterministic test picture (gradients and shapes from `seed`).
Image synthetic_image(int width, int height, uint64_t seed);

}  // namespace ecx::engine
