#include "ecx/common/subprocess.h"

#include <gtest/gtest.h>
#include <signal.h>

namespace ecx {
namespace {

TEST(Subprocess, ReadsLinesAndExitCode) {
  auto p = Subprocess::spawn({"/bin/sh", "-c", "echo first; echo second; exit 3"});
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(*p->read_line(Deadline::after_ms(10000)), "first");
  EXPECT_EQ(*p->read_line(Deadline::after_ms(10000)), "second");
  auto code = p->wait(Deadline::after_ms(10000));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 3);
}

TEST(Subprocess, ReadLineHonoursItsDeadline) {
  // `cat` waits on its stdin and prints nothing.
  auto p = Subprocess::spawn({"/bin/cat"});
  ASSERT_TRUE(p.ok());
  auto line = p->read_line(Deadline::after_ms(50));
  ASSERT_FALSE(line.ok());
  EXPECT_EQ(line.status().code(), StatusCode::kDeadlineExceeded);
  p->close_stdin();  // cat exits on EOF
  EXPECT_EQ(*p->wait(Deadline::after_ms(10000)), 0);
}

TEST(Subprocess, KilledChildReportsTheSignal) {
  auto p = Subprocess::spawn({"/bin/cat"});
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->kill(SIGKILL).ok());
  EXPECT_EQ(*p->wait(Deadline::after_ms(10000)), 128 + SIGKILL);
}

TEST(Subprocess, MissingBinaryIsAnError) {
  auto p = Subprocess::spawn({"/nonexistent/binary"});
  EXPECT_FALSE(p.ok());
}

}  // namespace
}  // namespace ecx
