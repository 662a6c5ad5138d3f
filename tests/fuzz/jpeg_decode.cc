// Fuzz target: decode_image on JPEG input (the checks: decode_image_check.h). Input
// without the JPEG signature (FF D8 FF) is skipped, so the time goes to libjpeg-turbo and
// ecx's wrapper (png_decode covers the other branch).
#include "fuzz/decode_image_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3 || data[0] != 0xFF || data[1] != 0xD8 || data[2] != 0xFF) return 0;
  check_decode_image(data, size);
  return 0;
}
