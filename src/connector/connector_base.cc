#include "connector/connector_base.h"

#include <algorithm>

#include "ecx/common/log.h"

namespace ecx::connector {

using nlohmann::json;

ConnectorBase::ConnectorBase(std::string name, ConnectorConfig config, ConnectorOptions options,
                             ConnectorContext context)
    : name_(std::move(name)),
      config_(std::move(config)),
      options_(std::move(options)),
      context_(std::move(context)) {}

ConnectorBase::~ConnectorBase() { shutdown_base(); }

Status ConnectorBase::init_base(bool consumer_cache_remote_write) {
  transfer::AgentConfig ac;
  ac.name = options_.engine_id;
  ac.compat_hash = options_.compat_hash;
  ac.tcp_host = options_.tcp_host;
  ac.tcp_port = options_.tcp_port;
  ac.transfer_timeout_ms = options_.load_timeout_ms;
  ac.auth_secret = options_.auth_secret;
  ac.max_connections = options_.max_connections;
  ac.idle_timeout_ms = options_.idle_timeout_ms;
  ECX_ASSIGN_OR_RETURN(agent_, transfer::Agent::create(ac));
  if (is_consumer()) {
    cache::PoolConfig pc;
    pc.name = options_.engine_id + "/cache";
    pc.capacity_bytes = options_.pool_bytes;
    pc.lease = std::chrono::milliseconds(options_.consumer_pin_ms);
    pc.remote_write = consumer_cache_remote_write;
    // No peer reads our cache; push producers write only into their grants.
    pc.require_grant = options_.require_grants;
    ECX_ASSIGN_OR_RETURN(consumer_cache_, cache::EncoderCachePool::create(agent_.get(), pc));
    for (int i = 0; i < options_.loader_threads; ++i)
      loaders_.emplace_back([this] { loader_loop(); });
  }
  return Status::Ok();
}

void ConnectorBase::shutdown_base() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : loaders_) t.join();
  loaders_.clear();
  if (agent_) agent_->shutdown();
  {
    std::lock_guard lock(mu_);
    for (auto& [id, state] : requests_) {
      if (!state->done) {
        state->done = true;
        state->outcome.status = Unavailable("connector " + name_ + " shut down");
      }
    }
  }
  done_cv_.notify_all();
}

EcTransferParams ConnectorBase::keyed_params(const MmHash& mm_hash, const TensorMeta& meta) const {
  EcTransferParams p;
  p.connector = config_.connector;
  p.engine_id = options_.engine_id;
  p.compat_hash = options_.compat_hash;
  p.mm_hash = mm_hash;
  p.meta = meta;
  p.num_tokens = meta.shape.empty() ? 0 : static_cast<uint64_t>(meta.shape[0]);
  return p;
}

Status ConnectorBase::check_compat(const std::string& producer,
                                   const std::string& their_hash) const {
  if (their_hash.empty() || their_hash == options_.compat_hash) return Status::Ok();
  return Status(StatusCode::kIncompatible,
                "compatibility hash mismatch: producer '" + producer + "' has '" + their_hash +
                    "', consumer '" + options_.engine_id + "' has '" + options_.compat_hash + "'");
}

void ConnectorBase::note_not_ready(const MmHash& mm_hash) {
  not_ready_retries_++;
  if (context_.on_not_ready) context_.on_not_ready(mm_hash);
}

void ConnectorBase::count_nack(const Status& status) {
  std::lock_guard lock(mu_);
  nacks_[std::string(status_code_name(status.code()))]++;
}

std::vector<bool> ConnectorBase::has_caches(const LoadRequest& request) {
  std::vector<bool> out;
  out.reserve(request.items.size());
  for (const auto& item : request.items) out.push_back(is_consumer() && can_load(item));
  return out;
}

Status ConnectorBase::update_state_after_alloc(const LoadRequest& request, size_t index) {
  if (!is_consumer())
    return Status(StatusCode::kFailedPrecondition, "connector " + name_ + " is not a consumer");
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

ConnectorMetadata ConnectorBase::build_connector_meta() {
  ConnectorMetadata meta;
  std::lock_guard lock(mu_);
  for (auto& [id, entry] : scheduled_) meta.loads.push_back(std::move(entry));
  scheduled_.clear();
  return meta;
}

Status ConnectorBase::start_load_caches(const ConnectorMetadata& metadata) {
  std::lock_guard lock(mu_);
  if (stopping_) return Unavailable("connector " + name_ + " shut down");
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

void ConnectorBase::loader_loop() {
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
          spdlog::error("connector {}: background task failed: {}", name_, e.what());
        }
        continue;
      }
      state = std::move(queue_.front());
      queue_.pop_front();
    }
    run_load(state);  // catches what its connector throws (fetch_guarded)
  }
}

Result<std::pair<cache::Pin, bool>> ConnectorBase::reserve_or_join(const LoadItem& item,
                                                                   const std::string& holder,
                                                                   Deadline deadline) {
  while (true) {
    auto reserved = consumer_cache_->reserve_pinned(item.mm_hash, item.meta, holder, deadline);
    if (reserved.ok()) return std::make_pair(*reserved, false);
    if (reserved.status().code() != StatusCode::kAlreadyExists) return reserved.status();
    // Someone else is writing (or wrote) it: wait for theirs instead of writing twice.
    auto ready = consumer_cache_->wait_ready(item.mm_hash, deadline);
    if (ready.status().code() == StatusCode::kNotFound && !deadline.expired())
      continue;  // they gave up
    if (!ready.ok()) return ready.status();
    auto pin = consumer_cache_->pin(item.mm_hash, holder);
    if (pin.status().code() == StatusCode::kNotFound && !deadline.expired()) continue;
    if (!pin.ok()) return pin.status();
    if (!(pin->ref.meta == item.meta)) {
      consumer_cache_->unpin(pin->pin_id).ignore_error();
      return InvalidArgument("cached " + item.mm_hash.str() + " is " + pin->ref.meta.to_string() +
                             ", request says " + item.meta.to_string());
    }
    return std::make_pair(*pin, true);
  }
}

void ConnectorBase::fetch_guarded(const LoadRequest& request, std::vector<FetchSlot*>& slots,
                                  Deadline deadline) {
  try {
    fetch(request, slots, deadline);
  } catch (const std::exception& e) {
    // A bug in a connector must not take the process down nor leave entries "writing".
    for (FetchSlot* slot : slots) {
      slot->status = Internal("connector " + name_ + " failed while loading " +
                              slot->item->mm_hash.str() + ": " + e.what());
    }
  }
  // Success means committed: an entry still being written is a failure, and is dropped.
  for (FetchSlot* slot : slots) {
    if (slot->status.ok() && !consumer_cache_->find(slot->item->mm_hash).ok()) {
      slot->status = Internal("connector " + name_ + " reported " + slot->item->mm_hash.str() +
                              " loaded but did not commit it");
    }
  }
}

void ConnectorBase::run_load(const std::shared_ptr<RequestState>& state) {
  const auto start = Clock::now();
  const LoadRequest& request = state->request;
  // The earlier of the connector's load timeout and the request's own deadline.
  Deadline deadline = Deadline::after_ms(options_.load_timeout_ms);
  if (request.deadline) deadline = Deadline::earliest(deadline, *request.deadline);
  const std::string holder = "request:" + request.request_id;
  LoadOutcome outcome;
  std::vector<FetchSlot> slots(state->items.size());
  std::vector<FetchSlot*> to_fetch, to_encode;
  std::vector<uint64_t> pins;

  for (size_t k = 0; k < state->items.size(); ++k) {
    const LoadItem& item = request.items[state->items[k]];
    FetchSlot& slot = slots[k];
    slot.item = &item;
    if (Status valid = item.meta.validate(); !valid.ok()) {
      slot.status = valid.with_context("item " + item.mm_hash.str());
      slot.done = true;
      continue;
    }
    // Already here (an earlier request, or a concurrent one still loading it)?
    auto existing = consumer_cache_->find(item.mm_hash);
    if (existing.ok() || existing.status().code() == StatusCode::kNotReady) {
      auto ready = consumer_cache_->wait_ready(item.mm_hash, deadline);
      auto pin = ready.ok() ? consumer_cache_->pin(item.mm_hash, holder)
                            : Result<cache::Pin>(ready.status());
      if (pin.ok() && pin->ref.meta == item.meta) {
        pins.push_back(pin->pin_id);
        slot.block = pin->ref;
        slot.status = Status::Ok();
        slot.done = true;
        outcome.items.push_back({item.mm_hash, Status::Ok(), false, true});
        local_hits_++;
        if (item.params) on_unused_params(item);
        continue;
      }
      if (pin.ok()) consumer_cache_->unpin(pin->pin_id).ignore_error();
    }
    if (!can_load(item)) {
      slot.status = NotFound("connector " + name_ + " has no cache for " + item.mm_hash.str());
      to_encode.push_back(&slot);
      continue;
    }
    auto reserved = reserve_or_join(item, holder, deadline);
    if (!reserved.ok()) {
      slot.status = reserved.status().with_context("reserve " + item.mm_hash.str() +
                                                   " in the consumer cache");
      slot.done = true;
      continue;
    }
    if (reserved->second) {  // another request brought it in meanwhile
      pins.push_back(reserved->first.pin_id);
      slot.status = Status::Ok();
      slot.done = true;
      outcome.items.push_back({item.mm_hash, Status::Ok(), false, true});
      local_hits_++;
      if (item.params) on_unused_params(item);
      continue;
    }
    slot.block = reserved->first.ref;
    slot.pin_id = reserved->first.pin_id;
    pins.push_back(reserved->first.pin_id);
    to_fetch.push_back(&slot);
  }

  if (!to_fetch.empty()) fetch_guarded(request, to_fetch, deadline);

  for (FetchSlot* slot : to_fetch) {
    if (!slot->status.ok()) {
      count_nack(slot->status);
      consumer_cache_->abort(slot->item->mm_hash, slot->block.generation);
      to_encode.push_back(slot);
    } else {
      items_loaded_++;
      bytes_loaded_ += slot->item->meta.byte_size();
      outcome.bytes += slot->item->meta.byte_size();
      outcome.items.push_back({slot->item->mm_hash, Status::Ok(), false, false});
    }
  }
  // Failures: encode locally if allowed and possible, else fail the request clearly.
  for (FetchSlot* slot : to_encode) {
    const LoadItem& item = *slot->item;
    Status failure = slot->status;
    if (options_.failure_policy == FailurePolicy::kRecompute && context_.recompute) {
      auto reserved = reserve_or_join(item, holder, deadline);
      Status s = reserved.ok() ? Status::Ok() : reserved.status();
      if (s.ok()) pins.push_back(reserved->first.pin_id);
      double recompute_ms = 0;
      if (s.ok() && !reserved->second) {
        const cache::BlockRef& ref = reserved->first.ref;
        auto t_encode = Clock::now();
        try {
          s = context_.recompute(item.mm_hash, item.meta,
                                 std::span<std::byte>(ref.payload(), item.meta.byte_size()));
        } catch (const std::exception& e) {
          s = Internal(std::string("local encode threw: ") + e.what());
        }
        recompute_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_encode).count();
        if (s.ok()) s = consumer_cache_->commit(item.mm_hash, ref.generation);
        if (!s.ok()) consumer_cache_->abort(item.mm_hash, ref.generation);
      }
      if (s.ok()) {
        items_recomputed_++;
        outcome.items.push_back({item.mm_hash, Status::Ok(), true, false, recompute_ms});
        continue;
      }
      failure = s.with_context("recompute after '" + failure.message() + "'");
    }
    outcome.items.push_back({item.mm_hash, failure, false, false});
    if (outcome.status.ok()) {
      outcome.status =
          failure.with_context("request " + request.request_id + ": item " + item.mm_hash.str());
    }
  }
  for (const auto& slot : slots) {  // validation / reserve failures
    if (slot.done && !slot.status.ok() && slot.item != nullptr) {
      bool reported = false;
      for (const auto& o : outcome.items) reported |= (o.mm_hash == slot.item->mm_hash);
      if (!reported) {
        outcome.items.push_back({slot.item->mm_hash, slot.status, false, false});
        if (outcome.status.ok())
          outcome.status = slot.status.with_context("request " + request.request_id);
      }
    }
  }
  outcome.load_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  load_us_total_ += static_cast<uint64_t>(outcome.load_ms * 1000);
  (outcome.status.ok() ? loads_ok_ : loads_failed_)++;
  bool abandoned = false;
  {
    std::lock_guard lock(mu_);
    state->outcome = outcome;
    state->pins = std::move(pins);
    state->done = true;
    finished_.push_back(request.request_id);
    abandoned = state->abandoned;
    if (abandoned) requests_.erase(request.request_id);
  }
  done_cv_.notify_all();
  if (abandoned) {
    for (uint64_t pin : state->pins) consumer_cache_->unpin(pin).ignore_error();
    on_request_finished(state->request);
  }
  // Releases and the like leave the critical path: a loader thread sends them.
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      background_.push_back([this, state] { after_load(state->request, {}); });
    }
  }
  work_cv_.notify_one();
}

LoadOutcome ConnectorBase::wait_for_load(const std::string& request_id, Deadline deadline) {
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

std::vector<std::string> ConnectorBase::get_finished() {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  out.swap(finished_);
  return out;
}

Result<cache::BlockRef> ConnectorBase::loaded(const std::string& request_id,
                                              const MmHash& mm_hash) {
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->done) {
      return Status(StatusCode::kFailedPrecondition,
                    "request " + request_id + " has no finished load");
    }
  }
  // Pinned for the request, so it is still there.
  return consumer_cache_->find(mm_hash);
}

void ConnectorBase::request_finished(const std::string& request_id) {
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
  for (uint64_t pin : state->pins) consumer_cache_->unpin(pin).ignore_error();
  on_request_finished(state->request);
}

json ConnectorBase::stats() const {
  json j = {{"connector", name_},
            {"engine_id", options_.engine_id},
            {"role", std::string(role_name(config_.role))},
            {"saves", saves_.load()},
            {"loads_ok", loads_ok_.load()},
            {"loads_failed", loads_failed_.load()},
            {"items_loaded", items_loaded_.load()},
            {"items_recomputed", items_recomputed_.load()},
            {"local_hits", local_hits_.load()},
            {"bytes_loaded", bytes_loaded_.load()},
            {"load_seconds_total", static_cast<double>(load_us_total_.load()) / 1e6},
            {"not_ready_retries", not_ready_retries_.load()}};
  {
    std::lock_guard lock(mu_);
    j["nacks"] = nacks_;
  }
  if (consumer_cache_) {
    auto s = consumer_cache_->stats();
    j["consumer_cache"] = {{"capacity_bytes", s.capacity_bytes},
                           {"used_bytes", s.used_bytes},
                           {"entries", s.entries},
                           {"pins", s.pins},
                           {"evictions", s.evictions}};
  }
  add_stats(j);
  return j;
}

}  // namespace ecx::connector
