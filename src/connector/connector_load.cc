// The loaders, and one request's load: plan (invalid, already cached, to fetch, to
// encode), fetch through the driver, settle, recompute or fail per the failure policy,
// publish the outcome, then give back what the request holds at producers.
#include <algorithm>
#include <numeric>

#include "connector/connector.h"
#include "ecx/common/log.h"

namespace ecx::connector {

void Connector::give_back(PendingRelease release) {
  const size_t slots = release.slots.size();
  const std::string id = release.request ? release.request->request_id : std::string();
  if (releases_->push(std::move(release))) return;
  spdlog::warn(
      "connector {}: shut down: what request {} holds at producers ({} items) is "
      "left to their lease",
      name(), id, slots);
}

// Loads only: what a load leaves held at producers is ReleaseBatcher's and HeldViews'
// (producer_holdings.h), each on a thread of its own.
void Connector::loader_loop() {
  while (true) {
    std::shared_ptr<RequestState> state;
    {
      MutexLock lock(&mu_);
      work_cv_.wait(&mu_, [this]() ECX_REQUIRES(mu_) {
        return stopping_ || next_load_locked() != queue_.end();
      });
      if (stopping_) return;  // what is still queued ends with stop()
      auto next = next_load_locked();
      state = std::move(*next);
      queue_.erase(next);
      if (state->offered) offered_running_++;
    }
    run_load(state);  // catches what its driver throws (fetch_guarded)
  }
}

// A request's load first: an offer's is a head start, never a wait for a request. Offers
// run on at most loader_threads - 1 loaders (one, with a single loader), so that one slow
// producer's offers cannot hold every loader while a request waits.
std::deque<std::shared_ptr<Connector::RequestState>>::iterator Connector::next_load_locked() {
  auto request =
      std::find_if(queue_.begin(), queue_.end(), [](const auto& s) { return !s->offered; });
  if (request != queue_.end()) return request;
  const int cap = std::max(1, core_.options().loader_threads - 1);
  return queue_.empty() || offered_running_ >= cap ? queue_.end() : queue_.begin();
}

Result<std::pair<cache::Pin, bool>> Connector::reserve_or_join(const LoadItem& item,
                                                               const std::string& holder,
                                                               Deadline deadline) {
  cache::EncoderCachePool* cache = core_.consumer_cache();
  while (true) {
    auto reserved = cache->reserve_pinned(item.mm_hash, item.meta, holder, deadline);
    if (reserved.ok()) return std::make_pair(*reserved, false);
    if (reserved.status().code() != StatusCode::kAlreadyExists) return reserved.status();
    // Someone else is writing (or wrote) it: wait for theirs instead of writing twice.
    auto ready = cache->wait_ready(item.mm_hash, deadline);
    if (ready.status().code() == StatusCode::kNotFound && !deadline.expired())
      continue;  // they gave up
    if (!ready.ok()) return ready.status();
    auto pin = cache->pin(item.mm_hash, holder);
    if (pin.status().code() == StatusCode::kNotFound && !deadline.expired()) continue;
    if (!pin.ok()) return pin.status();
    if (!(pin->ref.meta == item.meta)) {
      cache->unpin(pin->pin_id).ignore_error();
      return InvalidArgument("cached " + item.mm_hash.str() + " is " + pin->ref.meta.to_string() +
                             ", request says " + item.meta.to_string());
    }
    return std::make_pair(*pin, true);
  }
}

Deadline Connector::load_deadline(const RequestState& state) const {
  // The earlier of the connector's load timeout and the request's own deadline.
  Deadline deadline = Deadline::after_ms(core_.options().load_timeout_ms);
  if (state.request.deadline) deadline = Deadline::earliest(deadline, *state.request.deadline);
  return deadline;
}

void Connector::run_load(const std::shared_ptr<RequestState>& state) {
  const auto start = Clock::now();
  LoadJob job{.state = state,
              .deadline = load_deadline(*state),
              .holder = "request:" + state->request.request_id};
  plan(job);
  if (!job.to_view.empty()) view_or_reserve(job);
  if (!job.to_fetch.empty()) fetch_guarded(job.to_fetch, job.deadline);
  settle_fetched(job);
  if (state->offered) {  // nothing is encoded for an offer: its request decides
    finish_offered(job);
    return;
  }
  recompute_or_fail(job);
  report_settled_failures(job);
  job.outcome.load_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  finish(job);
}

// An item already here (an earlier request, or a concurrent one still loading it): pins
// it for the request. False when it is not (or not with this geometry).
bool Connector::take_local_hit(LoadJob& job, FetchSlot& slot) {
  cache::EncoderCachePool* cache = core_.consumer_cache();
  const LoadItem& item = *slot.item;
  auto existing = cache->find(item.mm_hash);
  if (!existing.ok() && existing.status().code() != StatusCode::kNotReady) return false;
  auto ready = cache->wait_ready(item.mm_hash, job.deadline);
  auto pin = ready.ok() ? cache->pin(item.mm_hash, job.holder) : Result<cache::Pin>(ready.status());
  if (!pin.ok()) return false;
  if (!(pin->ref.meta == item.meta)) {
    cache->unpin(pin->pin_id).ignore_error();
    return false;
  }
  hold_local_hit(job, slot, *pin);
  return true;
}

// `slot`'s item, pinned in the consumer cache for the request: done, a local hit.
void Connector::hold_local_hit(LoadJob& job, FetchSlot& slot, const cache::Pin& pin) {
  job.pins.push_back({slot.item->mm_hash, pin.pin_id});
  slot.block = pin.ref;
  slot.status = Status::Ok();
  slot.done = true;
  job.outcome.items.push_back(
      {.mm_hash = slot.item->mm_hash, .status = Status::Ok(), .local_hit = true});
  local_hits_++;
}

// Pins every item of the load in the consumer cache, if each is there, ready and of the
// request's geometry, and finishes the load with them: no wait, no fetch, no loader.
// False, with nothing held, when any item is not (a loader then runs the whole load).
bool Connector::load_if_all_here(const std::shared_ptr<RequestState>& state) {
  const auto start = Clock::now();
  cache::EncoderCachePool* cache = core_.consumer_cache();
  if (cache == nullptr || state->items.empty()) return false;
  LoadJob job{.state = state,
              .deadline = load_deadline(*state),
              .holder = "request:" + state->request.request_id};
  job.slots.resize(state->items.size());
  for (size_t k = 0; k < state->items.size(); ++k) {
    FetchSlot& slot = job.slots[k];
    slot.item = &state->request.items[state->items[k]];
    const LoadItem& item = *slot.item;
    auto pin = item.meta.validate().ok() ? cache->pin(item.mm_hash, job.holder)
                                         : Result<cache::Pin>(NotFound("invalid item"));
    if (pin.ok() && !(pin->ref.meta == item.meta)) {
      cache->unpin(pin->pin_id).ignore_error();
      pin = NotFound("another geometry");
    }
    if (!pin.ok()) {
      for (const ItemPin& p : job.pins) cache->unpin(p.pin_id).ignore_error();
      local_hits_ -= job.pins.size();  // not hits: the loader counts what it finds
      return false;
    }
    hold_local_hit(job, slot, *pin);
  }
  job.outcome.load_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  finish(job);
  return true;
}

// Sorts the request's items: invalid, already here, to fetch into a reserved block, or
// to encode (no driver can load it).
void Connector::plan(LoadJob& job) {
  const LoadRequest& request = job.state->request;
  job.slots.resize(job.state->items.size());
  for (size_t k = 0; k < job.state->items.size(); ++k) {
    FetchSlot& slot = job.slots[k];
    slot.item = &request.items[job.state->items[k]];
    const LoadItem& item = *slot.item;
    if (Status valid = item.meta.validate(); !valid.ok()) {
      slot.status = valid.with_context("item " + item.mm_hash.str());
      slot.done = true;
      continue;
    }
    if (take_local_hit(job, slot)) continue;
    if (!driver_->can_load(item)) {
      slot.status = NotFound("connector " + name() + " has no cache for " + item.mm_hash.str());
      job.to_encode.push_back(&slot);
      continue;
    }
    if (core_.options().zero_copy && !job.state->offered) {  // an offer is kept: copied
      job.to_view.push_back(&slot);
      continue;
    }
    reserve_for_fetch(job, slot);
  }
}

void Connector::reserve_for_fetch(LoadJob& job, FetchSlot& slot) {
  const LoadItem& item = *slot.item;
  auto reserved = reserve_or_join(item, job.holder, job.deadline);
  if (!reserved.ok()) {
    slot.status =
        reserved.status().with_context("reserve " + item.mm_hash.str() + " in the consumer cache");
    slot.done = true;
    return;
  }
  job.pins.push_back({item.mm_hash, reserved->first.pin_id});
  if (reserved->second) {  // another request brought it in meanwhile
    slot.status = Status::Ok();
    slot.done = true;
    job.outcome.items.push_back(
        {.mm_hash = item.mm_hash, .status = Status::Ok(), .local_hit = true});
    local_hits_++;
    return;
  }
  slot.block = reserved->first.ref;
  slot.pin_id = reserved->first.pin_id;
  job.to_fetch.push_back(&slot);
}

void Connector::view_or_reserve(LoadJob& job) {
  try {
    driver_->view(job.to_view, job.deadline);
  } catch (const std::exception& e) {
    for (FetchSlot* slot : job.to_view) {
      slot->viewed = false;
      slot->status = Internal("connector " + name() + " failed while viewing " +
                              slot->item->mm_hash.str() + ": " + e.what());
    }
  }
  for (FetchSlot* slot : job.to_view) {
    const LoadItem& item = *slot->item;
    if (slot->status.ok() && !slot->viewed) {
      reserve_for_fetch(job, *slot);  // not on this host: copied
      continue;
    }
    slot->done = true;
    if (!slot->status.ok()) {
      slot->viewed = false;
      count_nack(slot->status);
      job.to_encode.push_back(slot);
      continue;
    }
    items_viewed_++;
    count_loaded(job, item);
  }
}

void Connector::fetch_guarded(std::vector<FetchSlot*>& slots, Deadline deadline) {
  try {
    driver_->fetch(slots, deadline);
  } catch (const std::exception& e) {
    // A bug in a driver must not take the process down nor leave entries "writing".
    for (FetchSlot* slot : slots) {
      slot->status = Internal("connector " + name() + " failed while loading " +
                              slot->item->mm_hash.str() + ": " + e.what());
    }
  }
  // Success means committed: an entry still being written is a failure, and is dropped.
  for (FetchSlot* slot : slots) {
    if (slot->status.ok() && !core_.consumer_cache()->find(slot->item->mm_hash).ok()) {
      slot->status = Internal("connector " + name() + " reported " + slot->item->mm_hash.str() +
                              " loaded but did not commit it");
    }
  }
}

void Connector::settle_fetched(LoadJob& job) {
  for (FetchSlot* slot : job.to_fetch) {
    const LoadItem& item = *slot->item;
    if (!slot->status.ok()) {
      count_nack(slot->status);
      core_.consumer_cache()->abort(item.mm_hash, slot->block.generation);
      job.to_encode.push_back(slot);
      continue;
    }
    count_loaded(job, item);
  }
}

void Connector::count_nack(const Status& failure) {
  MutexLock lock(&nacks_mu_);
  nacks_[std::string(status_code_name(failure.code()))]++;
}

void Connector::count_loaded(LoadJob& job, const LoadItem& item) {
  items_loaded_++;
  bytes_loaded_ += item.meta.byte_size();
  job.outcome.bytes += item.meta.byte_size();
  job.outcome.items.push_back({.mm_hash = item.mm_hash, .status = Status::Ok()});
}

// Encodes `item` here into a block of the consumer cache (or joins the request that
// is already doing so).
Status Connector::recompute(LoadJob& job, const LoadItem& item, double* recompute_ms) {
  ECX_ASSIGN_OR_RETURN(auto reserved, reserve_or_join(item, job.holder, job.deadline));
  job.pins.push_back({item.mm_hash, reserved.first.pin_id});
  if (reserved.second) return Status::Ok();
  const cache::BlockRef& ref = reserved.first.ref;
  auto t_encode = Clock::now();
  Status s;
  try {
    s = core_.context().recompute(item.mm_hash, item.meta,
                                  std::span<std::byte>(ref.payload(), item.meta.byte_size()));
  } catch (const std::exception& e) {
    s = Internal(std::string("local encode threw: ") + e.what());
  }
  *recompute_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_encode).count();
  if (s.ok()) s = core_.consumer_cache()->commit(item.mm_hash, ref.generation);
  if (!s.ok()) core_.consumer_cache()->abort(item.mm_hash, ref.generation);
  return s;
}

// Failures: encode locally if allowed and possible, else fail the request clearly.
void Connector::recompute_or_fail(LoadJob& job) {
  const bool may_encode = core_.options().failure_policy == FailurePolicy::kRecompute &&
                          core_.context().recompute != nullptr;
  for (FetchSlot* slot : job.to_encode) {
    const LoadItem& item = *slot->item;
    Status failure = slot->status;
    if (may_encode) {
      double recompute_ms = 0;
      Status s = recompute(job, item, &recompute_ms);
      if (s.ok()) {
        items_recomputed_++;
        job.outcome.items.push_back({.mm_hash = item.mm_hash,
                                     .status = Status::Ok(),
                                     .recomputed = true,
                                     .recompute_ms = recompute_ms});
        continue;
      }
      failure = s.with_context("recompute after '" + failure.message() + "'");
    }
    job.outcome.items.push_back({.mm_hash = item.mm_hash, .status = failure});
    if (job.outcome.status.ok()) {
      job.outcome.status = failure.with_context("request " + job.state->request.request_id +
                                                ": item " + item.mm_hash.str());
    }
  }
}

// Items that failed before any fetch (validation, reserve) and are not reported yet.
void Connector::report_settled_failures(LoadJob& job) {
  for (const auto& slot : job.slots) {
    if (!slot.done || slot.status.ok() || slot.item == nullptr) continue;
    bool reported = false;
    for (const auto& o : job.outcome.items) reported |= (o.mm_hash == slot.item->mm_hash);
    if (reported) continue;
    job.outcome.items.push_back({.mm_hash = slot.item->mm_hash, .status = slot.status});
    if (job.outcome.status.ok())
      job.outcome.status = slot.status.with_context("request " + job.state->request.request_id);
  }
}

// Publishes the outcome, then gives back, off the critical path, what the request
// holds at producers (and its cache pins, if the caller already gave up on it).
void Connector::finish(LoadJob& job) {
  const auto& state = job.state;
  load_us_total_ += static_cast<uint64_t>(job.outcome.load_ms * 1000);
  (job.outcome.status.ok() ? loads_ok_ : loads_failed_)++;
  bool abandoned = false;
  std::vector<FetchSlot> views;
  for (const FetchSlot& slot : job.slots) {
    if (slot.viewed) views.push_back(slot);
  }
  {
    MutexLock lock(&mu_);
    state->outcome = job.outcome;
    state->pins = std::move(job.pins);
    state->done = true;
    finished_.push_back(state->request.request_id);
    abandoned = state->abandoned;
    if (abandoned) requests_.erase(state->request.request_id);
    // Queued with the outcome, not after it: a caller that sees the load done and shuts
    // the connector down still has this release sent (stop() joins the loaders before it
    // drains the releases; a load run on a caller's thread that ends after that is
    // dropped, logged). Views stay held, and renewed, until the request finishes;
    // request_finished takes them once it sees `done`.
    give_back({request_of(state), std::move(job.slots)});
    if (!views.empty() && (abandoned || !views_->hold(request_of(state), views)))
      give_back({request_of(state), std::move(views), /*views=*/true});
  }
  done_cv_.notify_all();
  if (abandoned) {
    for (const ItemPin& p : state->pins) core_.consumer_cache()->unpin(p.pin_id).ignore_error();
    driver_->on_request_finished(state->request);
  }
}

// An offer's load ends: its copies stay in the cache, unpinned (keep_loaded), for the
// request to come; the params' pins at the producers are that request's to give back
// (the lookups' own pins go now).
void Connector::finish_offered(LoadJob& job) {
  const auto& state = job.state;
  for (FetchSlot& slot : job.slots) slot.params_pin_left = true;
  {
    MutexLock lock(&mu_);
    requests_.erase(state->request.request_id);
    offered_loads_--;
    offered_running_--;
    give_back({request_of(state), std::move(job.slots)});
  }
  work_cv_.notify_one();  // a loader may take the next offer now
  unpin_all(job.pins);
}

LoadOutcome Connector::wait_for_load(const std::string& request_id, Deadline deadline) {
  MutexLock lock(&mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    LoadOutcome out;
    out.status = NotFound("no load started for request " + request_id);
    return out;
  }
  auto state = it->second;
  // Not picked up by a loader yet: run it on this thread instead of waiting for one
  // (saves two thread hand-offs on the critical path), when this caller waits for the
  // whole load anyway. A shorter wait (vLLM's scheduler looking in for a moment) only
  // waits: run here, the load would hold it for as long as the load may take.
  auto queued = std::find(queue_.begin(), queue_.end(), state);
  if (queued != queue_.end() && deadline.time_point() >= load_deadline(*state).time_point()) {
    queue_.erase(queued);
    lock.unlock();
    run_load(state);
    lock.lock();
  }
  if (!done_cv_.wait_until(&mu_, deadline.time_point(), [&state] { return state->done; })) {
    LoadOutcome out;
    out.status = DeadlineExceeded("request " + request_id + ": load still running at the deadline");
    return out;
  }
  return state->outcome;
}

LoadOutcome Connector::load(const LoadRequest& request, Deadline deadline) {
  auto state = std::make_shared<RequestState>();
  state->request = request;
  // The load gives up by the earlier of the connector's load timeout and this deadline.
  auto& own = state->request.deadline;
  own = own ? Deadline::earliest(*own, deadline) : deadline;
  state->items.resize(request.items.size());
  std::iota(state->items.begin(), state->items.end(), size_t{0});
  LoadOutcome refused;
  {
    MutexLock lock(&mu_);
    if (!core_.is_consumer()) {
      refused.status =
          Status(StatusCode::kFailedPrecondition, "connector " + name() + " is not a consumer");
    } else if (stopping_) {
      refused.status = Unavailable("connector " + name() + " shut down");
    } else if (!requests_.emplace(request.request_id, state).second) {
      refused.status = Status(StatusCode::kAlreadyExists,
                              "request " + request.request_id + " is already loading");
    }
  }
  if (!refused.status.ok()) return refused;
  run_load(state);
  MutexLock lock(&mu_);
  return state->outcome;
}

}  // namespace ecx::connector
