// ReleaseBatcher and HeldViews (src/connector/producer_holdings.h), each on its own thread
// and lock: releases coalesce and drain at stop, a release its producer is slow to take
// blocks neither new releases nor the view renewals, and a refused renewal marks its view.
#include "connector/producer_holdings.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

namespace ecx::connector {
namespace {

// Records the release and renew calls; a release can be held until the test lets it go.
class RecordingDriver final : public ConnectorDriver {
 public:
  Result<SaveSlot> begin_save(const MmHash&, const TensorMeta&) override {
    return Unavailable("not a producer");
  }
  Result<EcTransferParams> commit_save(const SaveSlot&) override {
    return Unavailable("not a producer");
  }
  Result<EcTransferParams> saved_params(const MmHash&) override {
    return Unavailable("not a producer");
  }
  void abort_save(const SaveSlot&) override {}
  bool can_load(const LoadItem&) override { return false; }
  void fetch(std::vector<FetchSlot*>&, Deadline) override {}

  void release(std::span<const FinishedLoad> loads) override {
    std::unique_lock lock(mu_);
    std::vector<std::string> ids;
    for (const FinishedLoad& l : loads) ids.push_back(l.request->request_id);
    batches_.push_back(std::move(ids));
    cv_.notify_all();
    cv_.wait_for(lock, std::chrono::seconds(10), [this] { return !hold_releases_; });
  }
  std::vector<Status> renew(std::span<const FetchSlot* const> views, Deadline) override {
    std::lock_guard lock(mu_);
    renewals_++;
    std::vector<Status> out;
    for (const FetchSlot* v : views) {
      out.push_back(v->item->mm_hash == refused_ ? Status(StatusCode::kNotFound, "pin ended")
                                                 : Status::Ok());
    }
    cv_.notify_all();
    return out;
  }

  void hold_releases(bool hold) {
    std::lock_guard lock(mu_);
    hold_releases_ = hold;
    cv_.notify_all();
  }
  void refuse(const MmHash& h) {
    std::lock_guard lock(mu_);
    refused_ = h;
  }
  // Waits (10 s at most) until `ready` holds under the driver's lock.
  template <typename Pred>
  bool wait(Pred ready) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return ready(*this); });
  }
  std::vector<std::vector<std::string>> batches_;  // under mu_
  int renewals_ = 0;                               // under mu_

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool hold_releases_ = false;
  MmHash refused_;
};

std::shared_ptr<const LoadRequest> request(const std::string& id,
                                           std::vector<std::string> items = {}) {
  auto r = std::make_shared<LoadRequest>();
  r->request_id = id;
  for (const auto& name : items) r->items.push_back({.mm_hash = MmHash::sha256_of({"t", name})});
  return r;
}

std::vector<FetchSlot> views_of(const LoadRequest& r) {
  std::vector<FetchSlot> out;
  for (const LoadItem& item : r.items) out.push_back({.item = &item, .viewed = true});
  return out;
}

TEST(ReleaseBatcherTest, ReleasesQueuedTogetherGoOutInOneCallAndStopDrainsTheRest) {
  RecordingDriver driver;
  ReleaseBatcher releases("test", &driver);
  driver.hold_releases(true);
  ASSERT_TRUE(releases.push({request("a"), {}}));
  ASSERT_TRUE(driver.wait([](auto& d) { return d.batches_.size() == 1; }));
  // The first batch is with the driver, held: these queue behind it, and push does not
  // wait for it.
  ASSERT_TRUE(releases.push({request("b"), {}}));
  ASSERT_TRUE(releases.push({request("c"), {}}));
  driver.hold_releases(false);
  releases.stop(Deadline::after_ms(5000));
  ASSERT_EQ(driver.batches_.size(), 2u);
  EXPECT_EQ(driver.batches_[0], std::vector<std::string>{"a"});
  EXPECT_EQ(driver.batches_[1], (std::vector<std::string>{"b", "c"}));
  EXPECT_FALSE(releases.push({request("d"), {}})) << "a release after stop is dropped";
}

TEST(ReleaseBatcherTest, WhatIsQueuedPastTheDrainDeadlineIsDropped) {
  RecordingDriver driver;
  ReleaseBatcher releases("test", &driver);
  driver.hold_releases(true);
  ASSERT_TRUE(releases.push({request("sent"), {}}));
  ASSERT_TRUE(driver.wait([](auto& d) { return d.batches_.size() == 1; }));
  ASSERT_TRUE(releases.push({request("queued"), {}}));  // behind the held batch
  // The driver lets go once stop() has begun (a push is refused from then on); stop()
  // waits for that batch, and by then its drain deadline has passed.
  std::thread releaser([&] {
    const Deadline bound = Deadline::after_ms(10000);
    while (!bound.expired() && releases.push({request("probe"), {}})) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    driver.hold_releases(false);
  });
  releases.stop(Deadline::after_ms(0));
  releaser.join();
  ASSERT_EQ(driver.batches_.size(), 1u) << "what was queued past the deadline is dropped";
  EXPECT_EQ(driver.batches_[0], std::vector<std::string>{"sent"});
  EXPECT_FALSE(releases.push({request("late"), {}}));
}

TEST(HeldViewsTest, ViewsAreRenewedWhileAReleaseIsStuckAndARefusalMarksItsView) {
  RecordingDriver driver;
  ReleaseBatcher releases("test", &driver);
  HeldViews held("test", &driver, /*renew_period_ms=*/5);
  auto r = request("r1", {"x", "y"});
  driver.refuse(r->items[1].mm_hash);
  auto views = views_of(*r);
  ASSERT_TRUE(held.hold(r, views));
  EXPECT_EQ(held.size(), 2u);
  // A release the driver does not let go of blocks neither the renewals nor the holder.
  driver.hold_releases(true);
  ASSERT_TRUE(releases.push({request("stuck"), {}}));
  ASSERT_TRUE(driver.wait([](auto& d) { return d.batches_.size() == 1 && d.renewals_ >= 3; }));
  auto x = held.find("r1", r->items[0].mm_hash);
  auto y = held.find("r1", r->items[1].mm_hash);
  ASSERT_TRUE(x && y);
  EXPECT_TRUE(x->status.ok());
  EXPECT_EQ(y->status.code(), StatusCode::kNotFound) << y->status.to_string();
  EXPECT_EQ(held.renewals_failed(), 1u) << "a refused view is not renewed again";

  PendingRelease one = held.take("r1", r->items[0].mm_hash);
  ASSERT_EQ(one.slots.size(), 1u);
  EXPECT_EQ(one.request, r);
  EXPECT_TRUE(one.views);
  EXPECT_EQ(held.size(), 1u);
  EXPECT_FALSE(held.find("r1", r->items[0].mm_hash));

  auto again = views_of(*r);
  EXPECT_FALSE(held.hold(r, again)) << "a request holds its views once";
  EXPECT_EQ(again.size(), 2u) << "refused views stay the caller's to release";

  std::vector<PendingRelease> left = held.stop();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].slots.size(), 1u);
  EXPECT_EQ(held.size(), 0u);
  EXPECT_TRUE(held.take("r1").slots.empty());
  driver.hold_releases(false);
  releases.stop(Deadline::after_ms(5000));
}

}  // namespace
}  // namespace ecx::connector
