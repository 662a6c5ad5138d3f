// What the PNG and JPEG fuzz targets check of decode_image (include/ecx/engine/image.h),
// with the limits a service uses by default: an error is kInvalidArgument or
// kResourceExhausted; a decoded image has dimensions within the limits and exactly
// width * height * 3 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ecx/engine/image.h"
#include "fuzz/fuzz_target.h"

inline void check_decode_image(const uint8_t* data, size_t size) {
  using namespace ecx::engine;
  static const ImageLimits limits;
  auto image = decode_image(std::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (!image.ok()) {
    auto code = image.status().code();
    ECX_FUZZ_CHECK(
        code == ecx::StatusCode::kInvalidArgument || code == ecx::StatusCode::kResourceExhausted,
        "unexpected error code");
    return;
  }
  ECX_FUZZ_CHECK(image->width > 0 && image->height > 0, "empty decoded image");
  ECX_FUZZ_CHECK(uint64_t(image->width) * uint64_t(image->height) <= limits.max_pixels,
                 "decoded image over max_pixels");
  ECX_FUZZ_CHECK(image->rgb.size() == size_t(image->width) * size_t(image->height) * 3,
                 "pixel buffer size != width * height * 3");
}
