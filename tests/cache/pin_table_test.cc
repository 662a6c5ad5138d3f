#include "cache/pin_table.h"

#include <gtest/gtest.h>

#include <chrono>

namespace ecx::cache {
namespace {

using std::chrono::seconds;

MmHash hash_of(int i) { return MmHash::sha256_of({"pin-table", std::to_string(i)}); }

transfer::Capability cap_of(uint8_t b) {
  transfer::Capability c;
  c.bytes.fill(b);
  return c;
}

TEST(PinTableTest, EveryIndexFollowsAPinFromAddToEnd) {
  PinTable pins("p", 8);
  const auto t0 = Clock::now();
  uint64_t a = pins.add(hash_of(1), "peer-a", t0 + seconds(5), cap_of(7));
  uint64_t b = pins.add(hash_of(1), "peer-b", t0 + seconds(2));
  EXPECT_NE(a, b);
  EXPECT_EQ(pins.size(), 2u);
  EXPECT_EQ(pins.pins_of(hash_of(1)), 2);
  EXPECT_EQ(pins.pinned_entries(), 1u);
  EXPECT_EQ(pins.next_expiry(), t0 + seconds(2));
  ASSERT_NE(pins.find_by_capability(cap_of(7)), nullptr);
  EXPECT_EQ(pins.find_by_capability(cap_of(7))->id, a);
  EXPECT_EQ(pins.find_by_capability(cap_of(8)), nullptr);

  std::optional<PinRecord> ended = pins.end(a);
  ASSERT_TRUE(ended.has_value());
  EXPECT_EQ(ended->holder, "peer-a");
  EXPECT_EQ(ended->capability, cap_of(7));
  EXPECT_FALSE(pins.end(a).has_value()) << "a pin ends once";
  EXPECT_EQ(pins.find_by_capability(cap_of(7)), nullptr);
  EXPECT_EQ(pins.pins_of(hash_of(1)), 1);
  EXPECT_TRUE(pins.end(b).has_value());
  EXPECT_TRUE(pins.empty());
  EXPECT_EQ(pins.pinned_entries(), 0u);
  EXPECT_FALSE(pins.next_expiry().has_value());
}

TEST(PinTableTest, LeasesEndInExpiryOrderAndOnlyThoseDue) {
  PinTable pins("p", 8);
  const auto t0 = Clock::now();
  pins.add(hash_of(1), "h", t0 + seconds(3));
  pins.add(hash_of(2), "h", t0 + seconds(1));
  pins.add(hash_of(3), "h", t0 + seconds(2));
  std::vector<PinRecord> due = pins.end_expired(t0 + seconds(2));
  ASSERT_EQ(due.size(), 2u);
  EXPECT_EQ(due[0].mm_hash, hash_of(2));
  EXPECT_EQ(due[1].mm_hash, hash_of(3));
  EXPECT_EQ(pins.size(), 1u);
  EXPECT_EQ(pins.next_expiry(), t0 + seconds(3));
}

TEST(PinTableTest, AHolderPastItsQuotaIsRefusedAndParamsMayHoldSixteenTimesMore) {
  PinTable pins("p", 2);
  const auto later = Clock::now() + seconds(30);
  pins.add(hash_of(1), "peer", later);
  EXPECT_TRUE(pins.check_quota("peer").ok());
  pins.add(hash_of(2), "peer", later);
  Status refused = pins.check_quota("peer");
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("already holds 2 pins"), std::string::npos) << refused.message();
  EXPECT_TRUE(pins.check_quota("other").ok()) << "quotas are per holder";
  for (int i = 0; i < 31; ++i)
    pins.add(hash_of(100 + i), std::string(PinTable::kParamsHolder), later);
  EXPECT_TRUE(pins.check_quota(PinTable::kParamsHolder).ok());
  pins.add(hash_of(200), std::string(PinTable::kParamsHolder), later);
  EXPECT_FALSE(pins.check_quota(PinTable::kParamsHolder).ok());
  pins.end_holder("peer");
  EXPECT_TRUE(pins.check_quota("peer").ok()) << "ending pins gives the quota back";
}

TEST(PinTableTest, ARenewedPinLastsLongerAndCountsTowardItsNewHoldersQuota) {
  PinTable pins("p", 1);
  const auto t0 = Clock::now();
  uint64_t params = pins.add(hash_of(1), std::string(PinTable::kParamsHolder), t0 + seconds(1));
  uint64_t other = pins.add(hash_of(2), std::string(PinTable::kParamsHolder), t0 + seconds(2));
  ASSERT_TRUE(pins.renew(params, "reader", t0 + seconds(10)).ok());
  EXPECT_EQ(pins.find(params)->holder, "reader");
  EXPECT_EQ(pins.next_expiry(), t0 + seconds(2)) << "the renewed lease moved past the other";
  EXPECT_TRUE(pins.end_expired(t0 + seconds(5)).size() == 1 && pins.find(params) != nullptr);
  // The reader's quota (1) is full: a second pin is not renewed, and keeps its lease.
  other = pins.add(hash_of(2), std::string(PinTable::kParamsHolder), t0 + seconds(2));
  Status refused = pins.renew(other, "reader", t0 + seconds(10));
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.to_string();
  EXPECT_EQ(pins.find(other)->holder, PinTable::kParamsHolder);
  EXPECT_EQ(pins.find(other)->expiry, t0 + seconds(2));
  // Ending the reader ends its renewed pin.
  EXPECT_EQ(pins.end_holder("reader").size(), 1u);
  EXPECT_EQ(pins.renew(params, "reader", t0 + seconds(10)).code(), StatusCode::kNotFound);
}

TEST(PinTableTest, EndingAHolderOrAnEntryEndsExactlyItsPins) {
  PinTable pins("p", 8);
  const auto later = Clock::now() + seconds(30);
  pins.add(hash_of(1), "a", later, cap_of(1));
  pins.add(hash_of(2), "a", later);
  pins.add(hash_of(1), "b", later, cap_of(2));
  pins.add(hash_of(3), "b", later);
  std::vector<PinRecord> of_a = pins.end_holder("a");
  EXPECT_EQ(of_a.size(), 2u);
  EXPECT_EQ(pins.pins_of(hash_of(1)), 1);
  EXPECT_EQ(pins.pins_of(hash_of(2)), 0);
  EXPECT_EQ(pins.find_by_capability(cap_of(1)), nullptr);
  std::vector<PinRecord> of_1 = pins.end_entry(hash_of(1));
  ASSERT_EQ(of_1.size(), 1u);
  EXPECT_EQ(of_1[0].holder, "b");
  EXPECT_EQ(of_1[0].capability, cap_of(2));
  EXPECT_EQ(pins.size(), 1u);
  EXPECT_TRUE(pins.end_holder("nobody").empty());
  EXPECT_TRUE(pins.end_entry(hash_of(9)).empty());
}

}  // namespace
}  // namespace ecx::cache
