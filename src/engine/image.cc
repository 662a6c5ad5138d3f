#include "ecx/engine/image.h"

#include <cctype>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// libjpeg needs stdio's FILE declared first.
#include <jpeglib.h>
#include <png.h>

namespace ecx::engine {
namespace {

bool is_png(std::string_view b) {
  return b.size() >= 8 && std::memcmp(b.data(), "\x89PNG\r\n\x1a\n", 8) == 0;
}
bool is_jpeg(std::string_view b) {
  return b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF &&
         static_cast<uint8_t>(b[1]) == 0xD8 && static_cast<uint8_t>(b[2]) == 0xFF;
}

Status check_dims(uint64_t w, uint64_t h, const ImageLimits& limits) {
  if (w == 0 || h == 0) return InvalidArgument("cannot decode image: zero width or height");
  if (w * h > limits.max_pixels) {
    return Status(StatusCode::kResourceExhausted,
                  "image of " + std::to_string(w) + "x" + std::to_string(h) +
                      " pixels exceeds the limit of " + std::to_string(limits.max_pixels) +
                      " pixels");
  }
  return Status::Ok();
}

// libpng allocates and zeroes a chunk's declared length before it reads the chunk, and the
// simplified API only warns about a length over its own limit: a 200-byte file that
// declares a 1.9 GB text chunk costs 1.9 GB of memory and seconds of CPU. The whole file
// is in memory here, so every chunk up to IEND must fit in what is left of it; that bounds
// what libpng allocates for a chunk by the (limited) size of the input.
Status check_png_chunks(std::string_view b) {
  size_t pos = 8;  // after the signature
  while (b.size() - pos >= 8) {
    const auto* p = reinterpret_cast<const unsigned char*>(b.data() + pos);
    uint64_t length =
        (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | p[3];
    std::string type(b.substr(pos + 4, 4));
    for (char& c : type) {
      if (!std::isalpha(static_cast<unsigned char>(c))) c = '?';
    }
    if (length + 12 > b.size() - pos) {
      return InvalidArgument("cannot decode PNG: chunk " + type + " at offset " +
                             std::to_string(pos) + " (" + std::to_string(length) +
                             " data bytes) runs past the end of the data (" +
                             std::to_string(b.size() - pos) + " bytes left)");
    }
    if (type == "IEND") break;
    pos += 12 + length;
  }
  return Status::Ok();
}

// Reads a PNG's header into `img` under `limits`; on success the caller frees `img`
// (png_image_free, or a finished read).
Status begin_png(std::string_view bytes, const ImageLimits& limits, png_image& img) {
  ECX_RETURN_IF_ERROR(check_png_chunks(bytes));
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) {
    return InvalidArgument(std::string("cannot decode PNG: ") + img.message);
  }
  Status dims = check_dims(img.width, img.height, limits);
  if (!dims.ok()) png_image_free(&img);
  return dims;
}

Result<Image> decode_png(std::string_view bytes, const ImageLimits& limits) {
  png_image img;
  ECX_RETURN_IF_ERROR(begin_png(bytes, limits, img));
  img.format = PNG_FORMAT_RGB;
  Image out;
  out.width = static_cast<int>(img.width);
  out.height = static_cast<int>(img.height);
  out.rgb.resize(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, out.rgb.data(), 0, nullptr)) {
    std::string why = img.message;
    png_image_free(&img);
    return InvalidArgument("cannot decode PNG: " + why);
  }
  return out;
}

struct JpegError {
  jpeg_error_mgr mgr;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void jpeg_quiet(j_common_ptr, int) {}

// Progressive JPEGs with thousands of scans burn CPU for nothing: stop at 100.
constexpr int kMaxJpegScans = 100;
void jpeg_scan_limit(j_common_ptr cinfo) {
  auto* d = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (d->input_scan_number > kMaxJpegScans) {
    std::snprintf(reinterpret_cast<JpegError*>(cinfo->err)->message, JMSG_LENGTH_MAX,
                  "more than %d progressive scans", kMaxJpegScans);
    std::longjmp(reinterpret_cast<JpegError*>(cinfo->err)->jump, 1);
  }
}

// Only plain C objects live in this frame, so longjmp skips no destructor. Returns 0 on
// success, 1 on a decode error (message in err), 2 when the image is over max_pixels.
// Without `rgb`, only the header is read.
int decode_jpeg_raw(const unsigned char* data, size_t size, uint64_t max_pixels, JpegError* err,
                    unsigned* width, unsigned* height, std::vector<uint8_t>* rgb) {
  jpeg_decompress_struct cinfo;
  jpeg_progress_mgr progress;
  progress.progress_monitor = jpeg_scan_limit;
  cinfo.err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = jpeg_error_exit;
  err->mgr.emit_message = jpeg_quiet;
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return 1;
  }
  jpeg_create_decompress(&cinfo);
  cinfo.progress = &progress;
  jpeg_mem_src(&cinfo, data, size);
  jpeg_read_header(&cinfo, TRUE);
  *width = cinfo.image_width;
  *height = cinfo.image_height;
  if (*width == 0 || *height == 0 || uint64_t{*width} * *height > max_pixels) {
    jpeg_destroy_decompress(&cinfo);
    return 2;
  }
  if (rgb == nullptr) {  // the header's size only
    jpeg_destroy_decompress(&cinfo);
    return 0;
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  *width = cinfo.output_width;
  *height = cinfo.output_height;
  rgb->resize(static_cast<size_t>(*width) * *height * 3);
  while (cinfo.output_scanline < cinfo.output_height) {
    unsigned char* row = rgb->data() + static_cast<size_t>(cinfo.output_scanline) * *width * 3;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return 0;
}

Result<Image> decode_jpeg(std::string_view bytes, const ImageLimits& limits) {
  JpegError err;
  unsigned width = 0, height = 0;
  Image out;
  int rc = decode_jpeg_raw(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
                           limits.max_pixels, &err, &width, &height, &out.rgb);
  if (rc == 1) return InvalidArgument(std::string("cannot decode JPEG: ") + err.message);
  if (rc == 2) {
    ECX_RETURN_IF_ERROR(check_dims(width, height, limits));
    return InvalidArgument("cannot decode JPEG: bad dimensions");
  }
  out.width = static_cast<int>(width);
  out.height = static_cast<int>(height);
  return out;
}

Result<ImageSize> read_png_size(std::string_view bytes, const ImageLimits& limits) {
  png_image img;
  ECX_RETURN_IF_ERROR(begin_png(bytes, limits, img));
  ImageSize size{static_cast<int>(img.width), static_cast<int>(img.height)};
  png_image_free(&img);
  return size;
}

Result<ImageSize> read_jpeg_size(std::string_view bytes, const ImageLimits& limits) {
  JpegError err;
  unsigned width = 0, height = 0;
  int rc = decode_jpeg_raw(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
                           limits.max_pixels, &err, &width, &height, nullptr);
  if (rc == 1) return InvalidArgument(std::string("cannot decode JPEG: ") + err.message);
  ECX_RETURN_IF_ERROR(check_dims(width, height, limits));
  return ImageSize{static_cast<int>(width), static_cast<int>(height)};
}

Status check_size(std::string_view bytes, const ImageLimits& limits) {
  if (bytes.size() <= limits.max_bytes) return Status::Ok();
  return Status(StatusCode::kResourceExhausted, "image of " + std::to_string(bytes.size()) +
                                                    " bytes exceeds the limit of " +
                                                    std::to_string(limits.max_bytes) + " bytes");
}

constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

}  // namespace

Result<Image> decode_image(std::string_view bytes, const ImageLimits& limits) {
  ECX_RETURN_IF_ERROR(check_size(bytes, limits));
  if (is_png(bytes)) return decode_png(bytes, limits);
  if (is_jpeg(bytes)) return decode_jpeg(bytes, limits);
  return InvalidArgument("cannot decode image: not a PNG or JPEG");
}

Result<ImageSize> read_image_size(std::string_view bytes, const ImageLimits& limits) {
  ECX_RETURN_IF_ERROR(check_size(bytes, limits));
  if (is_png(bytes)) return read_png_size(bytes, limits);
  if (is_jpeg(bytes)) return read_jpeg_size(bytes, limits);
  return InvalidArgument("cannot decode image: not a PNG or JPEG");
}

Result<std::string> encode_png(const Image& image) {
  png_image img;
  std::memset(&img, 0, sizeof(img));
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(image.width);
  img.height = static_cast<png_uint_32>(image.height);
  img.format = PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, image.rgb.data(), 0, nullptr)) {
    return Internal(std::string("encode PNG: ") + img.message);
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, image.rgb.data(), 0, nullptr)) {
    return Internal(std::string("encode PNG: ") + img.message);
  }
  out.resize(size);
  return out;
}

// Plain C objects only in this frame (see decode_jpeg_raw). *buffer is malloc'd by
// libjpeg; the caller frees it whatever the result.
int encode_jpeg_raw(const Image* image, int quality, JpegError* err, unsigned char** buffer,
                    unsigned long* size) {
  jpeg_compress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = jpeg_error_exit;
  if (setjmp(err->jump)) {
    jpeg_destroy_compress(&cinfo);
    return 1;
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, buffer, size);
  cinfo.image_width = static_cast<JDIMENSION>(image->width);
  cinfo.image_height = static_cast<JDIMENSION>(image->height);
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    auto* row = const_cast<unsigned char*>(
        image->rgb.data() + static_cast<size_t>(cinfo.next_scanline) * image->width * 3);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  return 0;
}

Result<std::string> encode_jpeg(const Image& image, int quality) {
  JpegError err;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  int rc = encode_jpeg_raw(&image, quality, &err, &buffer, &size);
  std::string out = rc == 0 ? std::string(reinterpret_cast<char*>(buffer), size) : std::string();
  std::free(buffer);
  if (rc != 0) return Internal(std::string("encode JPEG: ") + err.message);
  return out;
}

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int k = 18; k >= 0; k -= 6) out.push_back(kBase64[(v >> k) & 63]);
  }
  if (i < in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    if (i + 1 < in.size()) v |= uint8_t(in[i + 1]) << 8;
    out.push_back(kBase64[(v >> 18) & 63]);
    out.push_back(kBase64[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? kBase64[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

Result<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return InvalidArgument("bad base64: length is not a multiple of 4");
  int8_t table[256];
  std::memset(table, -1, sizeof(table));
  for (int k = 0; k < 64; ++k) table[static_cast<uint8_t>(kBase64[k])] = static_cast<int8_t>(k);
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    int pad = 0;
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = text[i + k];
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        pad++;
        v <<= 6;
        continue;
      }
      if (pad > 0 || table[static_cast<uint8_t>(c)] < 0) {
        return InvalidArgument("bad base64: unexpected character at offset " +
                               std::to_string(i + k));
      }
      v = (v << 6) | static_cast<uint32_t>(table[static_cast<uint8_t>(c)]);
    }
    out.push_back(static_cast<char>((v >> 16) & 0xFF));
    if (pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(v & 0xFF));
  }
  return out;
}

Result<std::string> decode_data_url(std::string_view url, std::string_view type) {
  if (url.substr(0, 5) != "data:") return InvalidArgument("not a data: URL");
  auto comma = url.find(',');
  if (comma == std::string_view::npos) return InvalidArgument("data: URL without a comma");
  std::string_view header = url.substr(5, comma - 5);
  if (header.size() < 7 || header.substr(header.size() - 7) != ";base64") {
    return InvalidArgument("data: URL must be base64-encoded (';base64,')");
  }
  if (header.size() <= type.size() || header.substr(0, type.size()) != type ||
      header[type.size()] != '/') {
    return InvalidArgument("data: URL is not a " + std::string(type) + "/* type");
  }
  return base64_decode(url.substr(comma + 1));
}

std::string make_data_url(std::string_view bytes, std::string_view mime) {
  return "data:" + std::string(mime) + ";base64," + base64_encode(bytes);
}

Image synthetic_image(int width, int height, uint64_t seed) {
  Image img;
  img.width = width;
  img.height = height;
  img.rgb.resize(static_cast<size_t>(width) * height * 3);
  uint64_t s = seed * 0x9e3779b97f4a7c15ULL + 1;
  auto next = [&] {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  };
  int cx = static_cast<int>(next() % static_cast<uint64_t>(width));
  int cy = static_cast<int>(next() % static_cast<uint64_t>(height));
  int r = 10 + static_cast<int>(next() %
                                static_cast<uint64_t>(std::max(1, std::min(width, height) / 3)));
  uint8_t tint[3] = {uint8_t(next()), uint8_t(next()), uint8_t(next())};
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &img.rgb[(static_cast<size_t>(y) * width + x) * 3];
      bool inside = (x - cx) * (x - cx) + (y - cy) * (y - cy) < r * r;
      p[0] = inside ? tint[0] : static_cast<uint8_t>(x * 255 / std::max(1, width - 1));
      p[1] = inside ? tint[1] : static_cast<uint8_t>(y * 255 / std::max(1, height - 1));
      p[2] = inside ? tint[2] : static_cast<uint8_t>((x + y + seed) & 0xFF);
    }
  }
  return img;
}

}  // namespace ecx::engine
