#include "cache/arena_allocator.h"

#include <gtest/gtest.h>

#include <random>

namespace ecx::cache {
namespace {

TEST(ArenaAllocator, ExactFitAlignedNoPowerOfTwoRounding) {
  ArenaAllocator a(10 << 20, 64);
  auto x = a.allocate(1'638'656);  // a seed item's block: not rounded to 2 MiB
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(*x % 64, 0u);
  EXPECT_EQ(a.used(), 1'638'656u);
  auto y = a.allocate(100);
  ASSERT_TRUE(y.has_value());
  EXPECT_EQ(*y % 64, 0u);
  EXPECT_EQ(a.used(), 1'638'656u + 128);
}

TEST(ArenaAllocator, FreeRangesCoalesce) {
  ArenaAllocator a(1 << 20, 64);
  auto p = a.allocate(256 << 10), q = a.allocate(256 << 10), r = a.allocate(256 << 10);
  ASSERT_TRUE(p && q && r);
  EXPECT_FALSE(a.allocate(512 << 10).has_value());  // only 256 KiB left
  a.free(*p, 256 << 10);
  a.free(*r, 256 << 10);
  EXPECT_FALSE(a.allocate(768 << 10).has_value());  // q splits the free space
  a.free(*q, 256 << 10);
  EXPECT_EQ(a.free_ranges(), 1u);
  EXPECT_EQ(a.largest_free(), 1u << 20);
  EXPECT_TRUE(a.allocate(1 << 20).has_value());
}

TEST(ArenaAllocator, RandomWorkloadNeverOverlapsAndReturnsToOneRange) {
  ArenaAllocator a(8 << 20, 64);
  std::mt19937_64 rng(1);
  std::map<uint64_t, uint64_t> live;
  for (int i = 0; i < 5000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      uint64_t size = 1 + rng() % (300 << 10);
      auto off = a.allocate(size);
      if (!off) continue;
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + a.round_up(size), next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + a.round_up(prev->second), *off);
      }
      live[*off] = size;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      a.free(it->first, it->second);
      live.erase(it);
    }
  }
  for (auto [off, size] : live) a.free(off, size);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.free_ranges(), 1u);
}

}  // namespace
}  // namespace ecx::cache
