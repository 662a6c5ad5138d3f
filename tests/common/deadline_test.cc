#include "ecx/common/deadline.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

TEST(Deadline, NeverAndPast) {
  Deadline never = Deadline::never();
  EXPECT_TRUE(never.is_never());
  EXPECT_FALSE(never.expired());
  EXPECT_EQ(never.poll_timeout_ms(), -1);
  Deadline past = Deadline::after_ms(-5);
  EXPECT_TRUE(past.expired());
  EXPECT_EQ(past.remaining().count(), 0);
  EXPECT_EQ(past.poll_timeout_ms(), 0);
  EXPECT_EQ(Deadline::earliest(never, past).time_point(), past.time_point());
}

TEST(Deadline, PollTimeoutRoundsUp) {
  Deadline d = Deadline::after(std::chrono::microseconds(1500));
  int ms = d.poll_timeout_ms();
  EXPECT_GE(ms, 1);
  EXPECT_LE(ms, 2);
}

}  // namespace
}  // namespace ecx
