// Fuzz target: decode_image (include/ecx/engine/image.h) on JPEG input, with the limits a
// service uses by default. Input without the JPEG signature (FF D8 FF) is skipped, so the time
// goes to libjpeg-turbo and ecx's wrapper (png_decode covers the other branch).
// Invariants: an error is kInvalidArgument or kResourceExhausted; a decoded image has
// dimensions within the limits and exactly width * height * 3 bytes.
#include <string_view>

#include "ecx/engine/image.h"
#include "fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ecx::engine;
  if (size < 3 || data[0] != 0xFF || data[1] != 0xD8 || data[2] != 0xFF) return 0;
  static const ImageLimits limits;
  auto image = decode_image(std::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (!image.ok()) {
    auto code = image.status().code();
    ECX_FUZZ_CHECK(
        code == ecx::StatusCode::kInvalidArgument || code == ecx::StatusCode::kResourceExhausted,
        "unexpected error code");
    return 0;
  }
  ECX_FUZZ_CHECK(image->width > 0 && image->height > 0, "empty decoded image");
  ECX_FUZZ_CHECK(uint64_t(image->width) * uint64_t(image->height) <= limits.max_pixels,
                 "decoded image over max_pixels");
  ECX_FUZZ_CHECK(image->rgb.size() == size_t(image->width) * size_t(image->height) * 3,
                 "pixel buffer size != width * height * 3");
  return 0;
}
