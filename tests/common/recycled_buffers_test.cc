#include "ecx/common/recycled_buffers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <new>
#include <thread>
#include <vector>

#include "ecx/common/bytes.h"

namespace ecx {
namespace {

TEST(RecycledBuffers, ABufferGivenBackServesTheNextTakeOfItsSize) {
  auto pool = RecycledBuffers::create(64 * kMiB);
  std::byte* first = nullptr;
  {
    auto a = pool->take(1600 * kKiB);
    ASSERT_NE(a, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % 64, 0u);
    first = a.get();
    a.get()[1600 * kKiB - 1] = std::byte{7};  // the whole length is writable
  }
  EXPECT_EQ(pool->stats().idle_bytes, RecycledBuffers::size_class(1600 * kKiB));
  auto b = pool->take(1600 * kKiB - 100);  // a nearby size: the same class
  EXPECT_EQ(b.get(), first);
  auto c = pool->take(1600 * kKiB);  // the one idle buffer is taken: a new one
  EXPECT_NE(c.get(), first);
  auto s = pool->stats();
  EXPECT_EQ(s.reused, 1u);
  EXPECT_EQ(s.allocated, 2u);
  EXPECT_EQ(s.idle_bytes, 0u);
}

TEST(RecycledBuffers, SizeClassesWasteAtMostAnEighthOrAPage) {
  for (uint64_t n : {uint64_t{1}, uint64_t{4095}, uint64_t{4097}, 100 * kKiB, 1600 * kKiB,
                     1600 * kKiB + 1, 3 * kMiB - 1, 48 * kMiB + 12345}) {
    const uint64_t size = RecycledBuffers::size_class(n);
    EXPECT_GE(size, n) << n;
    EXPECT_LE(size, n + std::max<uint64_t>(4095, n / 8)) << n;
    EXPECT_EQ(size % 4096, 0u) << n;
  }
  EXPECT_NE(RecycledBuffers::size_class(1 * kMiB), RecycledBuffers::size_class(2 * kMiB));
  EXPECT_EQ(RecycledBuffers::create(kMiB)->take(0), nullptr);
}

TEST(RecycledBuffers, NoMoreThanTheIdleCapIsKept) {
  auto pool = RecycledBuffers::create(2 * kMiB);
  {
    auto a = pool->take(1 * kMiB);
    auto b = pool->take(1 * kMiB);
    auto c = pool->take(1 * kMiB);
  }
  auto s = pool->stats();
  EXPECT_EQ(s.idle_bytes, 2 * kMiB);
  EXPECT_EQ(s.released, 1u);
  auto none = RecycledBuffers::create(0);
  { auto a = none->take(4096); }
  EXPECT_EQ(none->stats().idle_bytes, 0u);
  EXPECT_EQ(none->stats().released, 1u);
}

TEST(RecycledBuffers, TheLongestIdleMakeRoomForSizesAskedForNow) {
  auto pool = RecycledBuffers::create(2 * kMiB);
  pool->take(1 * kMiB).reset();  // a size no longer asked for
  pool->take(2 * kMiB).reset();  // it leaves, this one stays
  auto s = pool->stats();
  EXPECT_EQ(s.idle_bytes, 2 * kMiB);
  EXPECT_EQ(s.released, 1u);
  auto big = pool->take(2 * kMiB);
  EXPECT_EQ(pool->stats().reused, 1u);
  pool->take(3 * kMiB).reset();  // more than the cap: never kept
  EXPECT_EQ(pool->stats().idle_bytes, 0u);
  EXPECT_EQ(pool->stats().released, 2u);
  EXPECT_THROW(pool->take(uint64_t{1} << 63), std::bad_alloc);  // no size class wraps
}

TEST(RecycledBuffers, ABufferOutlivesItsPoolAndComesBackFromAnyThread) {
  auto pool = RecycledBuffers::create(64 * kMiB);
  auto kept = pool->take(1 * kMiB);
  std::vector<std::shared_ptr<std::byte>> taken;
  for (int i = 0; i < 8; ++i) taken.push_back(pool->take(256 * kKiB));
  std::vector<std::thread> threads;
  for (auto& t : taken) threads.emplace_back([t = std::move(t)]() mutable { t.reset(); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool->stats().idle_bytes, 8 * RecycledBuffers::size_class(256 * kKiB));
  pool.reset();  // the idle ones are freed; `kept` is freed by its own end (ASan checks both)
  kept.get()[0] = std::byte{1};
  kept.reset();
}

}  // namespace
}  // namespace ecx
