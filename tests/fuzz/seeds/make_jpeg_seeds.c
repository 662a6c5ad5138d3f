/* Writes small JPEG seeds for the jpeg_decode fuzz target with libjpeg(-turbo): one file
 * per encoder setting a decoder has a separate path for (baseline, progressive,
 * arithmetic coding, optimized tables, restart markers, grayscale, CMYK, chroma
 * subsampling, odd sizes). Run by make_corpus.py: make_jpeg_seeds OUT_DIR. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

struct seed {
  const char* name;
  int width, height, components;
  J_COLOR_SPACE space;
  int quality, progressive, arith, optimize, restart_rows, h_samp, v_samp;
};

static const struct seed seeds[] = {
    {"baseline-16x16", 16, 16, 3, JCS_RGB, 85, 0, 0, 0, 0, 2, 2},
    {"baseline-1x1", 1, 1, 3, JCS_RGB, 90, 0, 0, 0, 0, 2, 2},
    {"baseline-17x13-444", 17, 13, 3, JCS_RGB, 75, 0, 0, 0, 0, 1, 1},
    {"baseline-33x9-422", 33, 9, 3, JCS_RGB, 60, 0, 0, 0, 0, 2, 1},
    {"baseline-8x40-q10", 8, 40, 3, JCS_RGB, 10, 0, 0, 0, 0, 2, 2},
    {"baseline-24x24-q100", 24, 24, 3, JCS_RGB, 100, 0, 0, 0, 0, 2, 2},
    {"gray-19x7", 19, 7, 1, JCS_GRAYSCALE, 80, 0, 0, 0, 0, 1, 1},
    {"gray-progressive-20x20", 20, 20, 1, JCS_GRAYSCALE, 80, 1, 0, 0, 0, 1, 1},
    {"progressive-32x24", 32, 24, 3, JCS_RGB, 80, 1, 0, 0, 0, 2, 2},
    {"progressive-9x31-444", 9, 31, 3, JCS_RGB, 50, 1, 0, 0, 0, 1, 1},
    {"arith-16x16", 16, 16, 3, JCS_RGB, 80, 0, 1, 0, 0, 2, 2},
    {"arith-progressive-16x16", 16, 16, 3, JCS_RGB, 80, 1, 1, 0, 0, 2, 2},
    {"optimized-24x16", 24, 16, 3, JCS_RGB, 70, 0, 0, 1, 0, 2, 2},
    {"restart-32x32", 32, 32, 3, JCS_RGB, 70, 0, 0, 0, 1, 2, 2},
    {"restart-progressive-32x32", 32, 32, 3, JCS_RGB, 70, 1, 0, 0, 1, 2, 2},
    {"cmyk-12x12", 12, 12, 4, JCS_CMYK, 80, 0, 0, 0, 0, 1, 1},
    {"ycbcr-passthrough-10x10", 10, 10, 3, JCS_YCbCr, 80, 0, 0, 0, 0, 1, 2},
};

static int write_seed(const char* dir, const struct seed* s) {
  struct jpeg_compress_struct cinfo;
  struct jpeg_error_mgr jerr;
  unsigned char* out = NULL;
  unsigned long out_size = 0;
  size_t row_bytes = (size_t)s->width * s->components;
  unsigned char* row = malloc(row_bytes);
  cinfo.err = jpeg_std_error(&jerr);
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &out, &out_size);
  cinfo.image_width = s->width;
  cinfo.image_height = s->height;
  cinfo.input_components = s->components;
  cinfo.in_color_space = s->space;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, s->quality, TRUE);
  if (s->components == 3) {
    cinfo.comp_info[0].h_samp_factor = s->h_samp;
    cinfo.comp_info[0].v_samp_factor = s->v_samp;
  }
  cinfo.arith_code = s->arith ? TRUE : FALSE;
  cinfo.optimize_coding = s->optimize ? TRUE : FALSE;
  cinfo.restart_in_rows = s->restart_rows;
  if (s->progressive) jpeg_simple_progression(&cinfo);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    for (size_t x = 0; x < row_bytes; ++x)
      row[x] = (unsigned char)(x * 7 + cinfo.next_scanline * 13 + (x % s->components) * 50);
    JSAMPROW rows[1] = {row};
    jpeg_write_scanlines(&cinfo, rows, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  free(row);
  char path[4096];
  snprintf(path, sizeof(path), "%s/seed-%s.jpg", dir, s->name);
  FILE* f = fopen(path, "wb");
  if (!f || fwrite(out, 1, out_size, f) != out_size || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", path);
    return 1;
  }
  free(out);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); ++i) {
    if (write_seed(argv[1], &seeds[i])) return 1;
  }
  return 0;
}
