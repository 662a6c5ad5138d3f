// Fuzz target: decode_image on PNG input (the checks: decode_image_check.h). Input without
// the PNG signature is skipped, so the time goes to libpng and ecx's wrapper (the
// jpeg_decode target covers the other branch).
#include <cstring>

#include "fuzz/decode_image_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8 || std::memcmp(data, "\x89PNG\r\n\x1a\n", 8) != 0) return 0;
  check_decode_image(data, size);
  return 0;
}
