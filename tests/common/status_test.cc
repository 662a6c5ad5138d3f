#include "ecx/common/status.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

Result<int> half(int v) {
  if (v % 2 != 0) return InvalidArgument("odd value " + std::to_string(v));
  return v / 2;
}

Result<int> quarter(int v) {
  ECX_ASSIGN_OR_RETURN(int h, half(v));
  ECX_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

TEST(Status, OkAndErrorCarryCodeAndMessage) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = NotFound("mm_hash abc on agent e-0");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.to_string(), "missing: mm_hash abc on agent e-0");
  EXPECT_EQ(s.with_context("load").message(), "load: mm_hash abc on agent e-0");
}

TEST(Status, CodeNamesRoundTrip) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    auto code = static_cast<StatusCode>(c);
    auto back = status_code_from_name(status_code_name(code));
    ASSERT_TRUE(back.has_value()) << status_code_name(code);
    EXPECT_EQ(*back, code);
  }
  EXPECT_FALSE(status_code_from_name("nope").has_value());
}

TEST(Result, PropagatesErrorsThroughMacros) {
  auto ok = quarter(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 2);
  auto bad = quarter(6);  // 6/2 = 3 is odd
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "odd value 3");
}

}  // namespace
}  // namespace ecx
