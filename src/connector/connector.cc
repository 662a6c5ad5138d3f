// Connector: the one EcConnector class. It owns the agent and the consumer-side cache,
// runs the scheduler side (which items to load) and the loader threads, applies the
// failure policy, keeps the counters, and shuts down in one order: loaders, agent
// serving threads, driver, cache, agent. What varies per connector kind is its driver.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "connector/connector_driver.h"
#include "ecx/common/log.h"

namespace ecx::connector {

using Clock = std::chrono::steady_clock;

EcTransferParams ConnectorCore::keyed_params(const MmHash& mm_hash, const TensorMeta& meta) const {
  EcTransferParams p;
  p.connector = config_.connector;
  p.engine_id = options_.engine_id;
  p.compat_hash = options_.compat_hash;
  p.mm_hash = mm_hash;
  p.meta = meta;
  p.num_tokens = meta.shape.empty() ? 0 : static_cast<uint64_t>(meta.shape[0]);
  return p;
}

Status ConnectorCore::check_compat(const std::string& producer,
                                   const std::string& their_hash) const {
  if (their_hash.empty() || their_hash == options_.compat_hash) return Status::Ok();
  return Status(StatusCode::kIncompatible,
                "compatibility hash mismatch: producer '" + producer + "' has '" + their_hash +
                    "', consumer '" + options_.engine_id + "' has '" + options_.compat_hash + "'");
}

void ConnectorCore::note_not_ready(const MmHash& mm_hash) {
  not_ready_retries_++;
  if (context_.on_not_ready) context_.on_not_ready(mm_hash);
}

class Connector final : public EcConnector {
 public:
  Connector(std::string name, ConnectorConfig config, ConnectorOptions options,
            ConnectorContext context)
      : core_(std::move(name), std::move(config), std::move(options), std::move(context)) {}
  ~Connector() override;

  Status init(const ConnectorKind& kind);

  const std::string& name() const override { return core_.name(); }
  Role role() const override { return core_.config().role; }
  const std::string& compat_hash() const override { return core_.options().compat_hash; }
  FailurePolicy failure_policy() const override { return core_.options().failure_policy; }

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override;
  Result<EcTransferParams> commit_save(const SaveSlot& slot) override;
  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override;
  void abort_save(const SaveSlot& slot) override;
  Status wait_for_readers(Deadline deadline) override;
  Status release_params(const EcTransferParams& params) override;

  std::vector<bool> has_caches(const LoadRequest& request) override;
  Status update_state_after_alloc(const LoadRequest& request, size_t index) override;
  ConnectorMetadata build_connector_meta() override;
  Status start_load_caches(const ConnectorMetadata& metadata) override;
  LoadOutcome wait_for_load(const std::string& request_id, Deadline deadline) override;
  std::vector<std::string> get_finished() override;
  Result<cache::BlockRef> loaded(const std::string& request_id, const MmHash& mm_hash) override;
  void request_finished(const std::string& request_id) override;
  void discard(const LoadRequest& request) override;
  ConnectorStats stats() const override;

 private:
  struct RequestState {
    LoadRequest request;
    std::vector<size_t> items;
    std::vector<uint64_t> pins;  // consumer cache pins held for the request
    LoadOutcome outcome;
    bool done = false;
    bool abandoned = false;  // request_finished came before the load ended
  };
  // One load's working state, from planning to the outcome.
  struct LoadJob {
    std::shared_ptr<RequestState> state;
    Deadline deadline;
    std::string holder;  // of the consumer cache pins
    std::vector<FetchSlot> slots;
    std::vector<FetchSlot*> to_fetch, to_encode;
    std::vector<uint64_t> pins;
    LoadOutcome outcome;
  };

  Status producer_only(const char* what) const;
  void run_load(const std::shared_ptr<RequestState>& state);
  void plan(LoadJob& job);
  bool take_local_hit(LoadJob& job, FetchSlot& slot);
  // fetch(), with anything it throws turned into failed slots, and every slot that
  // claims success checked to be committed.
  void fetch_guarded(std::vector<FetchSlot*>& slots, Deadline deadline);
  void settle_fetched(LoadJob& job);
  Status recompute(LoadJob& job, const LoadItem& item, double* recompute_ms);
  void recompute_or_fail(LoadJob& job);
  void report_settled_failures(LoadJob& job);
  void finish(LoadJob& job);
  // A pinned block to write (second = false), or the entry another loader wrote
  // (second = true), for `item` in the consumer cache.
  Result<std::pair<cache::Pin, bool>> reserve_or_join(const LoadItem& item,
                                                      const std::string& holder, Deadline deadline);
  void queue_background(std::function<void()> task);
  void loader_loop();
  void stop();

  ConnectorCore core_;
  std::unique_ptr<ConnectorDriver> driver_;

  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  std::condition_variable work_cv_;
  std::map<std::string, ConnectorMetadata::Entry> scheduled_;      // guarded by mu_
  std::map<std::string, std::shared_ptr<RequestState>> requests_;  // guarded by mu_
  std::deque<std::shared_ptr<RequestState>> queue_;                // guarded by mu_
  std::deque<std::function<void()>> background_;  // releases and the like; guarded by mu_
  std::vector<std::string> finished_;             // guarded by mu_
  std::map<std::string, uint64_t> nacks_;         // guarded by mu_
  bool stopping_ = false;                         // guarded by mu_
  std::vector<std::thread> loaders_;

  std::atomic<uint64_t> saves_{0}, loads_ok_{0}, loads_failed_{0}, items_loaded_{0},
      items_recomputed_{0}, local_hits_{0}, bytes_loaded_{0}, load_us_total_{0};
};

Connector::~Connector() { stop(); }

Status Connector::init(const ConnectorKind& kind) {
  const ConnectorOptions& o = core_.options();
  transfer::AgentConfig ac;
  ac.name = o.engine_id;
  ac.compat_hash = o.compat_hash;
  ac.tcp_host = o.tcp_host;
  ac.tcp_port = o.tcp_port;
  ac.transfer_timeout_ms = o.load_timeout_ms;
  ac.auth_secret = o.auth_secret;
  ac.max_connections = o.max_connections;
  ac.idle_timeout_ms = o.idle_timeout_ms;
  ECX_ASSIGN_OR_RETURN(core_.agent_, transfer::Agent::create(ac));
  if (core_.is_consumer()) {
    cache::PoolConfig pc;
    pc.name = o.engine_id + "/cache";
    pc.capacity_bytes = o.pool_bytes;
    pc.lease = std::chrono::milliseconds(o.consumer_pin_ms);
    pc.remote_write = kind.consumer_cache_remote_write;
    // No peer reads our cache; push producers write only into their grants.
    pc.require_grant = o.require_grants;
    ECX_ASSIGN_OR_RETURN(core_.consumer_cache_, cache::EncoderCachePool::create(core_.agent(), pc));
  }
  ECX_ASSIGN_OR_RETURN(driver_, kind.make_driver(core_));
  if (core_.is_consumer()) {
    for (int i = 0; i < o.loader_threads; ++i) loaders_.emplace_back([this] { loader_loop(); });
  }
  return Status::Ok();
}

// Loaders first (they call the driver), then the agent's serving threads (its handlers
// call the driver), then the driver; the core's cache and agent go with the object.
void Connector::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : loaders_) t.join();
  loaders_.clear();
  if (core_.agent()) core_.agent()->shutdown();
  {
    std::lock_guard lock(mu_);
    for (auto& [id, state] : requests_) {
      if (!state->done) {
        state->done = true;
        state->outcome.status = Unavailable("connector " + name() + " shut down");
      }
    }
  }
  done_cv_.notify_all();
  driver_.reset();
}

// ---------------- producer ----------------

Status Connector::producer_only(const char* what) const {
  if (core_.is_producer()) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                std::string(what) + ": connector " + name() + " is not a producer");
}

Result<SaveSlot> Connector::begin_save(const MmHash& mm_hash, const TensorMeta& meta) {
  ECX_RETURN_IF_ERROR(producer_only("begin_save"));
  return driver_->begin_save(mm_hash, meta);
}

Result<EcTransferParams> Connector::commit_save(const SaveSlot& slot) {
  ECX_RETURN_IF_ERROR(producer_only("commit_save"));
  auto params = driver_->commit_save(slot);
  if (params.ok()) saves_++;
  return params;
}

Result<EcTransferParams> Connector::saved_params(const MmHash& mm_hash) {
  ECX_RETURN_IF_ERROR(producer_only("saved_params"));
  return driver_->saved_params(mm_hash);
}

void Connector::abort_save(const SaveSlot& slot) {
  if (core_.is_producer()) driver_->abort_save(slot);
}

Status Connector::wait_for_readers(Deadline deadline) {
  return core_.is_producer() ? driver_->wait_for_readers(deadline) : Status::Ok();
}

Status Connector::release_params(const EcTransferParams& params) {
  ECX_RETURN_IF_ERROR(producer_only("release_params"));
  return driver_->release_params(params);
}

// ---------------- consumer, scheduler side ----------------

std::vector<bool> Connector::has_caches(const LoadRequest& request) {
  std::vector<bool> out;
  out.reserve(request.items.size());
  for (const auto& item : request.items)
    out.push_back(core_.is_consumer() && driver_->can_load(item));
  return out;
}

Status Connector::update_state_after_alloc(const LoadRequest& request, size_t index) {
  if (!core_.is_consumer())
    return Status(StatusCode::kFailedPrecondition, "connector " + name() + " is not a consumer");
  if (index >= request.items.size()) {
    return OutOfRange("item " + std::to_string(index) + " of request " + request.request_id +
                      " with " + std::to_string(request.items.size()) + " items");
  }
  std::lock_guard lock(mu_);
  auto& entry = scheduled_[request.request_id];
  if (entry.request.request_id.empty()) entry.request = request;
  entry.items.push_back(index);
  return Status::Ok();
}

ConnectorMetadata Connector::build_connector_meta() {
  ConnectorMetadata meta;
  std::lock_guard lock(mu_);
  for (auto& [id, entry] : scheduled_) meta.loads.push_back(std::move(entry));
  scheduled_.clear();
  return meta;
}

// ---------------- consumer, worker side ----------------

Status Connector::start_load_caches(const ConnectorMetadata& metadata) {
  if (!core_.is_consumer())
    return Status(StatusCode::kFailedPrecondition, "connector " + name() + " is not a consumer");
  std::lock_guard lock(mu_);
  if (stopping_) return Unavailable("connector " + name() + " shut down");
  for (const auto& entry : metadata.loads) {
    if (requests_.count(entry.request.request_id)) {
      return Status(StatusCode::kAlreadyExists,
                    "request " + entry.request.request_id + " is already loading");
    }
  }
  for (const auto& entry : metadata.loads) {
    auto state = std::make_shared<RequestState>();
    state->request = entry.request;
    state->items = entry.items;
    requests_[entry.request.request_id] = state;
    queue_.push_back(state);
  }
  work_cv_.notify_all();
  return Status::Ok();
}

void Connector::queue_background(std::function<void()> task) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    background_.push_back(std::move(task));
  }
  work_cv_.notify_one();
}

void Connector::loader_loop() {
  while (true) {
    std::shared_ptr<RequestState> state;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !background_.empty(); });
      if (stopping_) return;
      if (!background_.empty()) {
        auto task = std::move(background_.front());
        background_.pop_front();
        lock.unlock();
        try {
          task();
        } catch (const std::exception& e) {
          spdlog::error("connector {}: background task failed: {}", name(), e.what());
        }
        continue;
      }
      state = std::move(queue_.front());
      queue_.pop_front();
    }
    run_load(state);  // catches what its driver throws (fetch_guarded)
  }
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

void Connector::run_load(const std::shared_ptr<RequestState>& state) {
  const auto start = Clock::now();
  LoadJob job{.state = state,
              // The earlier of the connector's load timeout and the request's own deadline.
              .deadline = Deadline::after_ms(core_.options().load_timeout_ms),
              .holder = "request:" + state->request.request_id};
  if (state->request.deadline)
    job.deadline = Deadline::earliest(job.deadline, *state->request.deadline);
  plan(job);
  if (!job.to_fetch.empty()) fetch_guarded(job.to_fetch, job.deadline);
  settle_fetched(job);
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
  job.pins.push_back(pin->pin_id);
  slot.block = pin->ref;
  slot.status = Status::Ok();
  slot.done = true;
  job.outcome.items.push_back({.mm_hash = item.mm_hash, .status = Status::Ok(), .local_hit = true});
  local_hits_++;
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
    auto reserved = reserve_or_join(item, job.holder, job.deadline);
    if (!reserved.ok()) {
      slot.status = reserved.status().with_context("reserve " + item.mm_hash.str() +
                                                   " in the consumer cache");
      slot.done = true;
      continue;
    }
    job.pins.push_back(reserved->first.pin_id);
    if (reserved->second) {  // another request brought it in meanwhile
      slot.status = Status::Ok();
      slot.done = true;
      job.outcome.items.push_back(
          {.mm_hash = item.mm_hash, .status = Status::Ok(), .local_hit = true});
      local_hits_++;
      continue;
    }
    slot.block = reserved->first.ref;
    slot.pin_id = reserved->first.pin_id;
    job.to_fetch.push_back(&slot);
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
      {
        std::lock_guard lock(mu_);
        nacks_[std::string(status_code_name(slot->status.code()))]++;
      }
      core_.consumer_cache()->abort(item.mm_hash, slot->block.generation);
      job.to_encode.push_back(slot);
      continue;
    }
    items_loaded_++;
    bytes_loaded_ += item.meta.byte_size();
    job.outcome.bytes += item.meta.byte_size();
    job.outcome.items.push_back({.mm_hash = item.mm_hash, .status = Status::Ok()});
  }
}

// Encodes `item` here into a block of the consumer cache (or joins the request that
// is already doing so).
Status Connector::recompute(LoadJob& job, const LoadItem& item, double* recompute_ms) {
  ECX_ASSIGN_OR_RETURN(auto reserved, reserve_or_join(item, job.holder, job.deadline));
  job.pins.push_back(reserved.first.pin_id);
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
  {
    std::lock_guard lock(mu_);
    state->outcome = job.outcome;
    state->pins = std::move(job.pins);
    state->done = true;
    finished_.push_back(state->request.request_id);
    abandoned = state->abandoned;
    if (abandoned) requests_.erase(state->request.request_id);
  }
  done_cv_.notify_all();
  if (abandoned) {
    for (uint64_t pin : state->pins) core_.consumer_cache()->unpin(pin).ignore_error();
    driver_->on_request_finished(state->request);
  }
  queue_background(
      [this, state, slots = std::move(job.slots)] { driver_->release(state->request, slots); });
}

LoadOutcome Connector::wait_for_load(const std::string& request_id, Deadline deadline) {
  std::unique_lock lock(mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end()) {
    LoadOutcome out;
    out.status = NotFound("no load started for request " + request_id);
    return out;
  }
  auto state = it->second;
  // Not picked up by a loader yet: run it on this thread instead of waiting for one
  // (saves two thread hand-offs on the critical path).
  auto queued = std::find(queue_.begin(), queue_.end(), state);
  if (queued != queue_.end()) {
    queue_.erase(queued);
    lock.unlock();
    run_load(state);
    lock.lock();
  }
  if (!done_cv_.wait_until(lock, deadline.time_point(), [&] { return state->done; })) {
    LoadOutcome out;
    out.status = DeadlineExceeded("request " + request_id + ": load still running at the deadline");
    return out;
  }
  return state->outcome;
}

std::vector<std::string> Connector::get_finished() {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  out.swap(finished_);
  return out;
}

Result<cache::BlockRef> Connector::loaded(const std::string& request_id, const MmHash& mm_hash) {
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->done) {
      return Status(StatusCode::kFailedPrecondition,
                    "request " + request_id + " has no finished load");
    }
  }
  // Pinned for the request, so it is still there.
  return core_.consumer_cache()->find(mm_hash);
}

void Connector::request_finished(const std::string& request_id) {
  std::shared_ptr<RequestState> state;
  {
    std::lock_guard lock(mu_);
    scheduled_.erase(request_id);
    auto it = requests_.find(request_id);
    if (it == requests_.end()) return;
    if (!it->second->done) {
      // Still loading (the caller gave up waiting): the loader releases it when done.
      it->second->abandoned = true;
      return;
    }
    state = it->second;
    requests_.erase(it);
  }
  for (uint64_t pin : state->pins) core_.consumer_cache()->unpin(pin).ignore_error();
  driver_->on_request_finished(state->request);
}

void Connector::discard(const LoadRequest& request) {
  if (!core_.is_consumer()) return;
  queue_background([this, request] { driver_->release(request, {}); });
}

ConnectorStats Connector::stats() const {
  ConnectorStats s{.connector = name(),
                   .engine_id = core_.options().engine_id,
                   .role = role(),
                   .saves = saves_.load(),
                   .loads_ok = loads_ok_.load(),
                   .loads_failed = loads_failed_.load(),
                   .items_loaded = items_loaded_.load(),
                   .items_recomputed = items_recomputed_.load(),
                   .local_hits = local_hits_.load(),
                   .bytes_loaded = bytes_loaded_.load(),
                   .not_ready_retries = core_.not_ready_retries(),
                   .load_seconds_total = static_cast<double>(load_us_total_.load()) / 1e6};
  {
    std::lock_guard lock(mu_);
    s.nacks = nacks_;
  }
  if (core_.consumer_cache()) s.consumer_cache = core_.consumer_cache()->stats();
  if (driver_) driver_->add_stats(s);
  return s;
}

Result<std::unique_ptr<EcConnector>> make_connector(ConnectorKind kind, ConnectorConfig config,
                                                    ConnectorOptions options,
                                                    ConnectorContext context) {
  auto c = std::make_unique<Connector>(kind.name, std::move(config), std::move(options),
                                       std::move(context));
  ECX_RETURN_IF_ERROR(c->init(kind));
  return std::unique_ptr<EcConnector>(std::move(c));
}

}  // namespace ecx::connector
