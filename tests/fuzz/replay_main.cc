// The main() of a fuzz target in a build without libFuzzer: runs LLVMFuzzerTestOneInput
// once over every file named on the command line, or over every file in a named
// directory (in name order, so a failure reproduces the same way). This is how every
// default build (gcc, ECX_FUZZ=OFF) keeps the checked-in corpus, crash regressions
// included, passing under CTest.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

namespace {

bool read_file(const std::filesystem::path& path, std::vector<uint8_t>* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->assign(std::istreambuf_iterator<char>(in), {});
  return !in.bad();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  std::vector<std::filesystem::path> inputs;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg, ec)) {
        if (entry.is_regular_file()) inputs.push_back(entry.path());
      }
      if (ec) {
        std::fprintf(stderr, "cannot list %s: %s\n", argv[i], ec.message().c_str());
        return 2;
      }
    } else {
      inputs.push_back(arg);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "no inputs found in the arguments\n");
    return 2;
  }
  std::vector<uint8_t> data;
  for (const auto& path : inputs) {
    if (!read_file(path, &data)) {
      std::fprintf(stderr, "cannot read %s\n", path.c_str());
      return 2;
    }
    // A heap block of exactly the input's size (as libFuzzer passes it), so that under
    // ASan a read one byte past the end is reported.
    std::unique_ptr<uint8_t[]> exact(new uint8_t[data.size()]);
    std::copy(data.begin(), data.end(), exact.get());
    LLVMFuzzerTestOneInput(exact.get(), data.size());
  }
  std::printf("replayed %zu inputs\n", inputs.size());
  return 0;
}
