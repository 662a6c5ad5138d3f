// ReleaseBatcher and HeldViews: see producer_holdings.h.
#include "connector/producer_holdings.h"

#include <algorithm>

#include "ecx/common/log.h"

namespace ecx::connector {

// ---------------- ReleaseBatcher ----------------

ReleaseBatcher::ReleaseBatcher(std::string name, ConnectorDriver* driver)
    : name_(std::move(name)), driver_(driver), thread_([this] { run(); }) {}

ReleaseBatcher::~ReleaseBatcher() { stop(Deadline::after_ms(0)); }

bool ReleaseBatcher::push(PendingRelease release) {
  bool first = false;
  {
    MutexLock lock(&mu_);
    if (stopping_) return false;
    first = queued_.empty();
    if (first) due_ = Deadline::after_ms(kBatchMs);
    queued_.push_back(std::move(release));
  }
  if (first) cv_.notify_one();  // later ones join the batch without waking anyone
  return true;
}

void ReleaseBatcher::stop(Deadline drain_until) {
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      drain_until_ = drain_until;
    }
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

// A batch goes out once it is kBatchMs old (or at once when stopping), and everything
// queued goes out before the thread ends, until the drain deadline: a connector shutting
// down gives back the pins it holds at producers rather than leave them to the lease.
void ReleaseBatcher::run() {
  while (true) {
    std::vector<PendingRelease> batch;
    {
      MutexLock lock(&mu_);
      cv_.wait(&mu_, [this]() ECX_REQUIRES(mu_) { return stopping_ || !queued_.empty(); });
      if (queued_.empty()) return;  // stopping, all sent
      if (!stopping_ && !due_.expired()) {
        cv_.wait_until(&mu_, due_.time_point(), [this]() ECX_REQUIRES(mu_) { return stopping_; });
        continue;
      }
      if (stopping_ && drain_until_.expired()) {
        spdlog::warn(
            "connector {}: shutting down: {} queued releases dropped (their pins end "
            "by lease)",
            name_, queued_.size());
        queued_.clear();
        return;
      }
      batch.swap(queued_);
    }
    send(std::move(batch));
  }
}

// One driver call for the whole batch: p2p sends one RELEASE per producer for all of it.
void ReleaseBatcher::send(std::vector<PendingRelease> batch) {
  std::vector<FinishedLoad> loads;
  loads.reserve(batch.size());
  for (const auto& r : batch) loads.push_back({r.request.get(), &r.slots, r.views});
  try {
    driver_->release(loads);
  } catch (const std::exception& e) {
    spdlog::error("connector {}: releasing {} loads failed: {}", name_, batch.size(), e.what());
  }
}

// ---------------- HeldViews ----------------

HeldViews::HeldViews(std::string name, ConnectorDriver* driver, int64_t renew_period_ms)
    : name_(std::move(name)),
      driver_(driver),
      renew_period_ms_(std::max<int64_t>(1, renew_period_ms)),
      thread_([this] { run(); }) {}

HeldViews::~HeldViews() { stop(); }

// How soon a pin a view took over (LoadItem::own_pin_taken) is renewed: after the step's
// worker call, long before the shared pin's lease could end.
constexpr int64_t kTakeOverRenewMs = 250;

bool HeldViews::hold(std::shared_ptr<const LoadRequest> request, std::vector<FetchSlot>& views) {
  if (views.empty()) return true;
  bool wake = false;  // the renewer: its period starts, or it renews now
  {
    MutexLock lock(&mu_);
    if (stopping_ || held_.count(request->request_id)) return false;
    wake = views_ == 0;
    if (wake) renew_due_ = Deadline::after_ms(renew_period_ms_);
    // A view held by its params' pin alone (LoadItem::own_pin_taken) is renewed soon, off
    // the load's path and after the step that loaded it has started: the renewal makes
    // that pin this reader's (its quota, its death ends it) with the long lease a
    // lookup's pin has, not the bearer lease it was shared with.
    if (std::any_of(views.begin(), views.end(), [](const FetchSlot& v) {
          return v.producer_pin.pin == 0 && v.item->own_pin_taken.has_value();
        })) {
      renew_due_ = Deadline::earliest(
          renew_due_, Deadline::after_ms(std::min(renew_period_ms_, kTakeOverRenewMs)));
      wake = true;
    }
    views_ += views.size();
    const std::string id = request->request_id;
    held_[id] = {std::move(request), std::move(views)};
  }
  if (wake) cv_.notify_one();
  return true;
}

std::optional<FetchSlot> HeldViews::find(const std::string& request_id,
                                         const MmHash& mm_hash) const {
  MutexLock lock(&mu_);
  auto it = held_.find(request_id);
  if (it == held_.end()) return std::nullopt;
  for (const FetchSlot& v : it->second.views) {
    if (v.item->mm_hash == mm_hash) return v;
  }
  return std::nullopt;
}

PendingRelease HeldViews::take(const std::string& request_id) {
  MutexLock lock(&mu_);
  auto it = held_.find(request_id);
  if (it == held_.end()) return {.views = true};
  PendingRelease out{std::move(it->second.request), std::move(it->second.views), true};
  views_ -= out.slots.size();
  held_.erase(it);
  return out;
}

PendingRelease HeldViews::take(const std::string& request_id, const MmHash& mm_hash) {
  MutexLock lock(&mu_);
  auto it = held_.find(request_id);
  if (it == held_.end()) return {.views = true};
  auto& views = it->second.views;
  auto v = std::find_if(views.begin(), views.end(),
                        [&](const FetchSlot& s) { return s.item->mm_hash == mm_hash; });
  if (v == views.end()) return {.views = true};
  PendingRelease out{it->second.request, {std::move(*v)}, true};
  views.erase(v);
  views_ -= 1;
  if (views.empty()) held_.erase(it);
  return out;
}

std::vector<PendingRelease> HeldViews::stop() {
  std::vector<PendingRelease> out;
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, held] : held_)
      out.push_back({std::move(held.request), std::move(held.views), true});
    held_.clear();
    views_ = 0;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
  return out;
}

size_t HeldViews::size() const {
  MutexLock lock(&mu_);
  return views_;
}

void HeldViews::run() {
  while (true) {
    {
      MutexLock lock(&mu_);
      auto due = [this]() ECX_REQUIRES(mu_) {
        return stopping_ || (views_ > 0 && renew_due_.expired());
      };
      if (views_ == 0) {
        cv_.wait(&mu_, [this]() ECX_REQUIRES(mu_) { return stopping_ || views_ > 0; });
      } else {
        cv_.wait_until(&mu_, renew_due_.time_point(), due);
      }
      if (stopping_) return;
      if (views_ == 0 || !renew_due_.expired()) continue;
      renew_due_ = Deadline::after_ms(renew_period_ms_);
    }
    renew();
  }
}

void HeldViews::renew() {
  struct Copy {
    std::shared_ptr<const LoadRequest> request;  // keeps what the view's item points into
    FetchSlot view;                              // the request may end meanwhile
  };
  std::vector<Copy> copies;
  {
    MutexLock lock(&mu_);
    for (const auto& [id, held] : held_) {
      for (const FetchSlot& v : held.views) {
        if (v.status.ok()) copies.push_back({held.request, v});
      }
    }
  }
  if (copies.empty()) return;
  std::vector<const FetchSlot*> ptrs;
  for (const Copy& c : copies) ptrs.push_back(&c.view);
  std::vector<Status> renewed;
  try {
    renewed = driver_->renew(ptrs, Deadline::after_ms(renew_period_ms_));
  } catch (const std::exception& e) {
    spdlog::error("connector {}: renewing {} views failed: {}", name_, copies.size(), e.what());
    return;
  }
  MutexLock lock(&mu_);
  for (size_t i = 0; i < copies.size() && i < renewed.size(); ++i) {
    if (renewed[i].ok()) continue;
    // One taken out meanwhile (item_finished, request_finished) had its pin ended on
    // purpose: no failure.
    auto it = held_.find(copies[i].request->request_id);
    if (it == held_.end() || it->second.request != copies[i].request) continue;
    bool held = false;
    for (FetchSlot& v : it->second.views) {
      if (v.item != copies[i].view.item) continue;
      v.status = renewed[i];
      held = true;
    }
    if (!held) continue;
    renewals_failed_++;
    spdlog::warn("connector {}: {}", name_, renewed[i].message());
  }
}

}  // namespace ecx::connector
