#include "ecx/common/bytes.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

TEST(Bytes, ParsesTheSizesOfTheBenchmarks) {
  EXPECT_EQ(*parse_bytes("64KiB"), 64 * kKiB);
  EXPECT_EQ(*parse_bytes("1600KiB"), 1600 * kKiB);
  EXPECT_EQ(*parse_bytes("8MiB"), 8 * kMiB);
  EXPECT_EQ(*parse_bytes("8mib"), 8 * kMiB);
  EXPECT_EQ(*parse_bytes("1.5GiB"), 3 * kGiB / 2);
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("100B"), 100u);
  EXPECT_EQ(*parse_bytes(" 2 MB "), 2'000'000u);
}

TEST(Bytes, RejectsMalformedSizesWithTheText) {
  for (const char* bad : {"", "KiB", "-1MiB", "12XB", "1.2.3MiB", "0.5B", "99999999999TiB"}) {
    auto r = parse_bytes(bad);
    EXPECT_FALSE(r.ok()) << bad;
  }
  EXPECT_NE(parse_bytes("12XB").status().message().find("'12XB'"), std::string::npos);
}

TEST(Bytes, ParsesListsAndFormatsBack) {
  auto list = parse_byte_list("64KiB,1600KiB,8MiB");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ(format_bytes((*list)[0]), "64KiB");
  EXPECT_EQ(format_bytes((*list)[1]), "1600KiB");
  EXPECT_EQ(format_bytes((*list)[2]), "8MiB");
  EXPECT_EQ(format_bytes(1000), "1000B");
  EXPECT_FALSE(parse_byte_list("64KiB,,8MiB").ok());
}

}  // namespace
}  // namespace ecx
