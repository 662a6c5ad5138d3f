#include "ecx/common/mm_hash.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

TEST(MmHash, Sha256IsStableAndLengthPrefixed) {
  MmHash a = MmHash::sha256_of({"model", "cfg", "pixels"});
  MmHash b = MmHash::sha256_of({"model", "cfg", "pixels"});
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.str().size(), 64u);
  // Length prefixes: moving a byte across a part boundary changes the hash.
  EXPECT_NE(MmHash::sha256_of({"ab", "c"}), MmHash::sha256_of({"a", "bc"}));
  EXPECT_TRUE(MmHash::parse(a.str()).ok());
}

TEST(MmHash, ParseRejectsUnsafeIdentifiers) {
  EXPECT_TRUE(MmHash::parse("img-0001_v2.png:3").ok());
  for (const char* bad : {"", "../etc/passwd", "a/b", ".hidden", "with space", "semi;colon"}) {
    EXPECT_FALSE(MmHash::parse(bad).ok()) << bad;
  }
  EXPECT_FALSE(MmHash::parse(std::string(129, 'a')).ok());
}

}  // namespace
}  // namespace ecx
