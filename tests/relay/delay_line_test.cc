// The relay's delay logic: what scripts/hosts' RTT rests on (docs/HOSTS.md).
#include "delay_line.h"

#include <gtest/gtest.h>

#include <string>

namespace ecx::relay {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

std::span<const std::byte> bytes_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

std::string text_of(std::span<const std::byte> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

const Clock::time_point t0 = Clock::time_point() + std::chrono::hours(1);

TEST(DelayLineTest, BytesAreHeldForTheDelayThenReleased) {
  DelayLine line(milliseconds(5), 1 << 20);
  line.push(bytes_of("hello"), t0);
  EXPECT_TRUE(line.due_bytes(t0).empty());
  EXPECT_TRUE(line.due_bytes(t0 + microseconds(4999)).empty());
  EXPECT_EQ(line.next_due(), t0 + milliseconds(5));
  EXPECT_EQ(text_of(line.due_bytes(t0 + milliseconds(5))), "hello");
}

TEST(DelayLineTest, EachChunkKeepsItsOwnArrivalTime) {
  DelayLine line(milliseconds(5), 1 << 20);
  line.push(bytes_of("first"), t0);
  line.push(bytes_of("second"), t0 + milliseconds(3));
  Clock::time_point now = t0 + milliseconds(6);
  EXPECT_EQ(text_of(line.due_bytes(now)), "first");
  line.consume(5);
  // The second chunk arrived 3 ms later: not due until 8 ms.
  EXPECT_TRUE(line.due_bytes(now).empty());
  EXPECT_EQ(line.next_due(), t0 + milliseconds(8));
  EXPECT_EQ(text_of(line.due_bytes(t0 + milliseconds(8))), "second");
}

TEST(DelayLineTest, PartialWritesResumeWhereTheyStopped) {
  DelayLine line(milliseconds(0), 1 << 20);
  line.push(bytes_of("abcdef"), t0);
  line.consume(2);
  EXPECT_EQ(text_of(line.due_bytes(t0)), "cdef");
  EXPECT_EQ(line.queued_bytes(), 4u);
  line.consume(4);
  EXPECT_TRUE(line.empty());
  EXPECT_FALSE(line.next_due().has_value());
}

TEST(DelayLineTest, ZeroDelayReleasesAtOnce) {
  DelayLine line(milliseconds(0), 1 << 20);
  line.push(bytes_of("now"), t0);
  EXPECT_EQ(text_of(line.due_bytes(t0)), "now");
}

TEST(DelayLineTest, EofWaitsBehindTheBytesSentBeforeIt) {
  DelayLine line(milliseconds(5), 1 << 20);
  line.push(bytes_of("last words"), t0);
  line.push_eof(t0 + milliseconds(1));
  EXPECT_TRUE(line.eof_pushed());
  // Due, but the bytes go first.
  EXPECT_FALSE(line.eof_due(t0 + milliseconds(10)));
  line.consume(10);
  EXPECT_FALSE(line.eof_due(t0 + milliseconds(5)));  // the EOF's own delay: due at 6 ms
  EXPECT_TRUE(line.eof_due(t0 + milliseconds(6)));
  line.pop_eof();
  EXPECT_TRUE(line.empty());
}

TEST(DelayLineTest, BytesAfterEofAreIgnored) {
  DelayLine line(milliseconds(0), 1 << 20);
  line.push_eof(t0);
  line.push(bytes_of("late"), t0);
  EXPECT_EQ(line.queued_bytes(), 0u);
  EXPECT_TRUE(line.eof_due(t0));
}

TEST(DelayLineTest, CapacityStopsReadingUntilBytesAreWritten) {
  DelayLine line(milliseconds(1), 8);
  EXPECT_TRUE(line.has_room());
  line.push(bytes_of("12345678"), t0);
  EXPECT_FALSE(line.has_room());
  line.consume(1);  // as the relay does once the byte was written
  EXPECT_TRUE(line.has_room());
}

}  // namespace
}  // namespace ecx::relay
