// CopyCrew: a same-host load's copies split between the loading thread and helpers.
#include "connector/copy_crew.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "ecx/common/checksum.h"

namespace ecx::connector {
namespace {

// Ranges of odd sizes at odd offsets in one source and one destination buffer, some under
// a piece, some many pieces long, together over CopyCrew::kSplitMin.
struct Layout {
  std::vector<std::byte> src, dst;
  std::vector<CopyCrew::Range> ranges;
};

Layout make_layout(uint64_t seed) {
  Layout l;
  std::mt19937_64 rng(seed);
  std::vector<std::pair<size_t, size_t>> spans;  // offset, length
  size_t at = 0;
  for (size_t length : {size_t{1}, size_t{63}, size_t{4097}, CopyCrew::kPieceBytes + 1,
                        3 * CopyCrew::kPieceBytes + 77, size_t{1600} << 10}) {
    at += 1 + rng() % 200;  // unaligned on purpose
    spans.push_back({at, length});
    at += length;
  }
  l.src.resize(at + 64);
  l.dst.resize(at + 64);
  fill_pattern(l.src.data(), l.src.size(), seed);
  for (auto [offset, length] : spans) {
    l.ranges.push_back({l.dst.data() + offset, l.src.data() + offset, length});
  }
  return l;
}

// Every byte of every range lands; nothing between the ranges is written.
void expect_copied(const Layout& l) {
  std::vector<bool> inside(l.dst.size(), false);
  for (const auto& r : l.ranges) {
    const size_t offset = r.dst - l.dst.data();
    ASSERT_EQ(std::memcmp(r.dst, r.src, r.length), 0) << "range at " << offset;
    std::fill(inside.begin() + offset, inside.begin() + offset + r.length, true);
  }
  for (size_t i = 0; i < l.dst.size(); ++i) {
    if (!inside[i]) {
      ASSERT_EQ(l.dst[i], std::byte{0}) << "byte " << i << " outside every range";
    }
  }
}

TEST(CopyCrew, EveryRangeLandsWholeAndNothingElseIsWritten) {
  for (int threads : {1, 2, 4}) {
    CopyCrew crew(threads);
    for (uint64_t round = 0; round < 5; ++round) {
      Layout l = make_layout(100 * threads + round);
      crew.copy(l.ranges);
      expect_copied(l);
    }
  }
}

TEST(CopyCrew, ConcurrentLoadsEachGetTheirOwnBytes) {
  CopyCrew crew(2);
  std::atomic<int> failures{0};
  std::vector<std::thread> loads;
  for (int t = 0; t < 4; ++t) {
    loads.emplace_back([&, t] {
      for (int round = 0; round < 10; ++round) {
        Layout l = make_layout(1000 * t + round);
        crew.copy(l.ranges);  // some find the helpers busy and copy alone
        for (const auto& r : l.ranges) {
          if (std::memcmp(r.dst, r.src, r.length) != 0) failures++;
        }
      }
    });
  }
  for (auto& t : loads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(CopyCrew, NothingToCopyReturnsAtOnce) {
  CopyCrew crew(2);
  crew.copy({});
  std::vector<CopyCrew::Range> empty_ranges{{nullptr, nullptr, 0}};
  crew.copy(empty_ranges);
}

}  // namespace
}  // namespace ecx::connector
