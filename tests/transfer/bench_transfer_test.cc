// `ecx bench transfer --backends ucx`: the ucx rows run over UCX's tcp transport and over
// shared memory, their bytes are verified, and each has ucx_perftest's baseline (or the
// reason it could not run) in the same JSON.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ecx/common/subprocess.h"

namespace ecx {
namespace {

using nlohmann::json;

bool ucx_perftest_installed() {
  return ::access("/usr/bin/ucx_perftest", X_OK) == 0;  // Debian's ucx-utils
}

TEST(BenchTransferTest, UcxRowsOverTcpAndSharedMemoryAreVerifiedAgainstUcxPerftest) {
  auto json_path = std::filesystem::path(::testing::TempDir()) /
                   ("bench_transfer_ucx_" + std::to_string(::getpid()) + ".json");
  auto bench = Subprocess::spawn({ECX_BINARY, "bench", "transfer", "--backends", "ucx", "--modes",
                                  "pull", "--sizes", "64KiB", "--batch", "1", "--iters", "3",
                                  "--json", json_path.string()});
  ASSERT_TRUE(bench.ok()) << bench.status().to_string();
  std::string output;
  while (true) {
    auto line = bench->read_line(Deadline::after_ms(120000));
    if (!line.ok()) break;
    output += *line + "\n";
  }
  ASSERT_EQ(*bench->wait(Deadline::after_ms(60000)), 0) << output;

  std::ifstream in(json_path);
  json j = json::parse(in, nullptr, false);
  std::filesystem::remove(json_path);
  ASSERT_TRUE(j.is_object()) << output;
  // The chart beside the JSON: a PNG (gnuplot is installed by scripts/deps).
  auto png = std::filesystem::path(json_path).replace_extension(".png");
  std::ifstream png_in(png, std::ios::binary);
  char magic[8] = {};
  png_in.read(magic, sizeof(magic));
  EXPECT_EQ(std::string(magic + 1, 3), "PNG") << output;
  std::filesystem::remove(png);
  for (const auto& [tls, mode, label] :
       {std::tuple{"tcp", "peer", "ucx-tcp"}, std::tuple{"posix,cma", "none", "ucx-shm"}}) {
    SCOPED_TRACE(tls);
    int rows = 0;
    for (const auto& r : j["results"]) {
      if (r["backend"] != "ucx" || r["ucx_tls"] != tls) continue;
      rows++;
      EXPECT_EQ(r["label"], label);
      EXPECT_EQ(r["ucx_error_mode"], mode);
      EXPECT_EQ(r["verified_bytes"], 64 * 1024);
      EXPECT_GT(r["gbps"].get<double>(), 0.0);
      if (ucx_perftest_installed()) {
        EXPECT_TRUE(r.contains("vs_ucx_perftest")) << r.dump();
      }
    }
    EXPECT_EQ(rows, 1);
    int baselines = 0;
    for (const auto& b : j["baselines"]) {
      if (b["name"] != "ucx_perftest" || b["ucx_tls"] != tls) continue;
      baselines++;
      EXPECT_EQ(b["size_bytes"], 64 * 1024);
      EXPECT_EQ(b["error_mode"], mode);
      if (ucx_perftest_installed()) {
        EXPECT_FALSE(b.contains("error")) << b.dump();
        EXPECT_GT(b["gbps"].get<double>(), 0.0);
      }
    }
    EXPECT_EQ(baselines, 1);
  }
}

}  // namespace
}  // namespace ecx
