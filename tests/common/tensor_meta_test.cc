#include "ecx/common/tensor_meta.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "ecx/common/checksum.h"

namespace ecx {
namespace {

TEST(TensorMeta, SeedItemGeometry) {
  TensorMeta m{DType::kBF16, {400, 2048}};
  ASSERT_TRUE(m.validate().ok());
  EXPECT_EQ(m.byte_size(), 1'638'400u);
  EXPECT_EQ(m.to_string(), "bf16[400, 2048]");
}

TEST(TensorMeta, JsonRoundTrip) {
  TensorMeta m{DType::kF32, {3, 4, 5}};
  auto back = TensorMeta::from_json(m.to_json());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, m);
}

TEST(TensorMeta, RejectsBadInput) {
  using nlohmann::json;
  EXPECT_FALSE(TensorMeta::from_json(json::array()).ok());
  EXPECT_FALSE(TensorMeta::from_json(json{{"dtype", "Q7"}, {"shape", {1}}}).ok());
  EXPECT_FALSE(TensorMeta::from_json(json{{"dtype", "BF16"}, {"shape", {-1}}}).ok());
  EXPECT_FALSE(TensorMeta::from_json(json{{"dtype", "BF16"}, {"shape", {"a"}}}).ok());
  EXPECT_FALSE(
      TensorMeta::from_json(json{{"dtype", "BF16"}, {"shape", {1, 2, 3, 4, 5, 6, 7, 8, 9}}}).ok());
  auto huge = TensorMeta::from_json(json{{"dtype", "BF16"}, {"shape", {1LL << 40, 1LL << 20}}});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(dtype_from_wire(0).ok());
  EXPECT_EQ(*dtype_from_wire(1), DType::kBF16);
}

TEST(Checksum, DetectsASingleFlippedByte) {
  std::vector<unsigned char> a(1 << 16), b;
  fill_pattern(a.data(), a.size(), 7);
  b = a;
  EXPECT_EQ(checksum64(a.data(), a.size()), checksum64(b.data(), b.size()));
  b[12345] ^= 1;
  EXPECT_NE(checksum64(a.data(), a.size()), checksum64(b.data(), b.size()));
  std::vector<unsigned char> c(a.size());
  fill_pattern(c.data(), c.size(), 8);
  EXPECT_NE(a, c);  // different seeds differ
}

}  // namespace
}  // namespace ecx
