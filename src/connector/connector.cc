// Connector (connector.h): lifecycle, the producer and scheduler sides, stats, and
// what ConnectorCore gives drivers.
#include "connector/connector.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "connector/control_messages.h"
#include "ecx/common/copy.h"
#include "ecx/common/log.h"

namespace ecx::connector {
namespace {
// Readers of one shared block (share_loaded): tensor-parallel ranks, not an open count.
constexpr size_t kMaxShareReaders = 256;
// At shutdown, releases still queued after this long are dropped (their pins end by lease).
constexpr int64_t kReleaseDrainMs = 2000;
}  // namespace

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

EcTransferParams ConnectorCore::located_params(const cache::Pin& pin,
                                               std::optional<P2pMode> mode) const {
  EcTransferParams p = keyed_params(pin.ref.mm_hash, pin.ref.meta);
  p.connector = "p2p";
  p.mode = p2p_mode_name(mode.value_or(options_.mode));
  p.agent = agent_metadata_json();
  p.region = pin.ref.region;
  p.offset = pin.ref.offset;
  p.length = pin.ref.block_length;
  p.generation = pin.ref.generation;
  p.pin = pin.pin_id;
  p.capability = pin.capability.hex();
  p.sign(options_.auth_secret);
  return p;
}

const std::string& ConnectorCore::agent_metadata_json() const {
  std::call_once(metadata_once_, [this] { metadata_json_ = agent_->metadata().to_json(); });
  return metadata_json_;
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

Connector::~Connector() { stop(); }

Status Connector::init(const ConnectorKind& kind) {
  const ConnectorOptions& o = core_.options();
  transfer::AgentConfig ac;
  ac.name = o.engine_id;
  ac.compat_hash = o.compat_hash;
  ac.tcp_host = o.tcp_host;
  ac.tcp_port = o.tcp_port;
  ac.tcp_advertise_host = o.tcp_advertise_host;
  ac.transfer_timeout_ms = o.load_timeout_ms;
  ac.auth_secret = o.auth_secret;
  ac.max_connections = o.max_connections;
  ac.idle_timeout_ms = o.idle_timeout_ms;
  ac.ucx = o.ucx;
  ECX_ASSIGN_OR_RETURN(core_.agent_, transfer::Agent::create(ac));
  if (core_.is_consumer()) {
    cache::PoolConfig pc;
    pc.name = o.engine_id + "/cache";
    pc.capacity_bytes = o.pool_bytes;
    pc.lease = std::chrono::milliseconds(o.consumer_pin_ms);
    pc.max_pins_per_holder = static_cast<size_t>(o.max_pins_per_holder);
    pc.remote_write = kind.consumer_cache_remote_write;
    // No peer reads our cache; push producers write only into their grants.
    pc.require_grant = o.require_grants;
    ECX_ASSIGN_OR_RETURN(core_.consumer_cache_, cache::EncoderCachePool::create(core_.agent(), pc));
  }
  ECX_ASSIGN_OR_RETURN(driver_, kind.make_driver(core_));
  offers_ = std::make_unique<OfferSender>(name(), core_.agent());
  core_.agent()->set_notification_handler([this](transfer::Notification n) { on_notification(n); });
  if (core_.is_consumer()) {
    releases_ = std::make_unique<ReleaseBatcher>(name(), driver_.get());
    views_ = std::make_unique<HeldViews>(name(), driver_.get(), renew_period_ms());
    for (int i = 0; i < o.loader_threads; ++i) loaders_.emplace_back([this] { loader_loop(); });
  }
  return Status::Ok();
}

// Loaders first (they call the driver and queue releases), then the view renewals, then
// the releases (drained until kReleaseDrainMs after the stop began), then the agent's
// serving threads (its handlers call the driver), then the driver; the core's cache and
// agent go with the object.
void Connector::stop() {
  const Deadline drain_until = Deadline::after_ms(kReleaseDrainMs);
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  // The views still held go back at once, while the loaders finish (a load ending after
  // this gives its views back itself: hold() refuses them once stopped).
  if (views_) {
    for (PendingRelease& r : views_->stop()) give_back(std::move(r));
  }
  for (auto& t : loaders_) t.join();
  loaders_.clear();
  if (releases_) releases_->stop(drain_until);
  if (offers_) offers_->stop();
  if (core_.agent()) core_.agent()->shutdown();
  {
    MutexLock lock(&mu_);
    for (auto& [id, state] : requests_) {
      if (!state->done) {
        state->done = true;
        state->outcome.status = Unavailable("connector " + name() + " shut down");
      }
    }
  }
  done_cv_.notify_all();
  // Then the parts, each before what it uses: the driver (its producer pool is registered
  // with the agent), the consumer cache (likewise), the agent last.
  driver_.reset();
  core_.consumer_cache_.reset();
  core_.agent_.reset();
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

bool Connector::holds(const MmHash& mm_hash) {
  return core_.is_producer() && driver_->holds(mm_hash);
}

// Peers' notifications. RELEASEs: of pins the driver handed out (a producer's params), or
// of pins share_loaded took in our cache; a pin ends only with the capability it was
// granted with, so nobody ends another reader's pin. OFFERs: items to load now.
void Connector::on_notification(const transfer::Notification& n) {
  auto notice = parse_notification(n.message);
  if (!notice.ok()) {
    spdlog::warn("{}: ignored a notification from {}: {}", name(), n.from,
                 notice.status().message());
    return;
  }
  if (auto* offer = std::get_if<OfferNotice>(&*notice)) {
    accept_offer(n.from, std::move(*offer));
    return;
  }
  for (const auto& p : std::get<ReleaseNotice>(*notice).pins) {
    if (driver_->release_granted(p.pin, p.capability)) continue;
    if (core_.consumer_cache())
      core_.consumer_cache()->release_granted(p.pin, p.capability).ignore_error();
  }
}

Status Connector::offer(const std::string& address, const std::vector<EcTransferParams>& params) {
  ECX_ASSIGN_OR_RETURN(std::string to, parse_offer_address(address));
  if (offers_ == nullptr)
    return Status(StatusCode::kFailedPrecondition, "offer: connector " + name() + " has no agent");
  const auto& allowed = core_.options().offer_to;
  if (std::find(allowed.begin(), allowed.end(), to) == allowed.end()) {
    return PermissionDenied("offer: consumer " + to + " is not in offer_to (the consumers " +
                            name() + " may offer to: " + std::to_string(allowed.size()) + ")");
  }
  if (params.empty()) return Status::Ok();
  if (params.size() > kMaxOfferItems) {
    return InvalidArgument("offer: " + std::to_string(params.size()) + " items, more than " +
                           std::to_string(kMaxOfferItems));
  }
  if (!offers_->push(std::move(to), to_json(OfferNotice{params}))) {
    return Status(StatusCode::kResourceExhausted,
                  "offer: " + std::to_string(OfferSender::kMaxQueued) +
                      " offers queued already, or the connector stopped");
  }
  return Status::Ok();
}

// Runs on the offering peer's connection thread: checks and queues, nothing more. Only
// params this deployment signed are loaded (from the producer they name, as a request's
// would be); an item already here is skipped.
void Connector::accept_offer(const std::string& from, OfferNotice notice) {
  const size_t offered = notice.items.size();
  // In push mode the producer ends the params' pin once it wrote: the request's own.
  const char* refused = !core_.is_consumer()                     ? "not a consumer"
                        : !name().starts_with("p2p")             ? "not a p2p connector"
                        : core_.options().mode == P2pMode::kPush ? "push mode"
                        : !core_.options().keep_loaded           ? "keep_loaded is off"
                                                                 : nullptr;
  if (refused != nullptr) {
    offered_refused_ += offered;
    spdlog::warn("{}: refused an offer of {} items from {}: {}", name(), offered, from, refused);
    return;
  }
  auto state = std::make_shared<RequestState>();
  state->offered = true;
  for (EcTransferParams& p : notice.items) {
    LoadItem item{.mm_hash = p.mm_hash, .meta = p.meta, .params = std::move(p)};
    if (!driver_->can_load(item)) {  // it logged why
      offered_refused_++;
      continue;
    }
    if (core_.consumer_cache()->find(item.mm_hash).ok()) continue;
    state->items.push_back(state->request.items.size());
    state->request.items.push_back(std::move(item));
  }
  if (state->items.empty()) return;
  {
    MutexLock lock(&mu_);
    if (!stopping_ && offered_loads_ < kMaxOfferedLoads) {
      offered_loads_++;
      items_offered_ += state->items.size();
      state->request.request_id = "offer:" + std::to_string(next_offer_++);
      requests_[state->request.request_id] = state;
      queue_.push_back(state);
      state = nullptr;
    }
  }
  if (state == nullptr) {
    work_cv_.notify_one();
    return;
  }
  offered_refused_ += state->items.size();
  spdlog::warn("{}: refused an offer of {} items from {}: {} offered loads run already", name(),
               state->items.size(), from, kMaxOfferedLoads);
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
  MutexLock lock(&mu_);
  auto& entry = scheduled_[request.request_id];
  if (entry.request.request_id.empty()) entry.request = request;
  entry.items.push_back(index);
  return Status::Ok();
}

ConnectorMetadata Connector::build_connector_meta() {
  ConnectorMetadata meta;
  MutexLock lock(&mu_);
  for (auto& [id, entry] : scheduled_) meta.loads.push_back(std::move(entry));
  scheduled_.clear();
  return meta;
}

// ---------------- consumer, worker side ----------------

Status Connector::start_load_caches(const ConnectorMetadata& metadata) {
  if (!core_.is_consumer())
    return Status(StatusCode::kFailedPrecondition, "connector " + name() + " is not a consumer");
  std::vector<std::shared_ptr<RequestState>> states;
  {
    MutexLock lock(&mu_);
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
      states.push_back(std::move(state));
    }
  }
  // A load whose items are all here already (an offer's copies, an earlier request's)
  // ends now, on this thread: no loader hand-off, nothing to wait for. The rest queue.
  std::vector<std::shared_ptr<RequestState>> queued;
  for (auto& state : states) {
    if (!load_if_all_here(state)) queued.push_back(std::move(state));
  }
  if (queued.empty()) return Status::Ok();
  {
    MutexLock lock(&mu_);
    for (auto& state : queued) queue_.push_back(std::move(state));
  }
  work_cv_.notify_all();
  return Status::Ok();
}

std::vector<std::string> Connector::get_finished() {
  MutexLock lock(&mu_);
  std::vector<std::string> out;
  out.swap(finished_);
  return out;
}

Result<cache::BlockRef> Connector::loaded(const std::string& request_id, const MmHash& mm_hash) {
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->done) {
      return Status(StatusCode::kFailedPrecondition,
                    "request " + request_id + " has no finished load");
    }
    // A zero-copy view: read-only, held by the request's pin at the producer.
    if (auto v = views_->find(request_id, mm_hash))
      return v->status.ok() ? Result<cache::BlockRef>(v->block) : v->status;
  }
  // Pinned for the request, so it is still there.
  return core_.consumer_cache()->find(mm_hash);
}

Status Connector::view_intact(const std::string& request_id, const MmHash& mm_hash) {
  MutexLock lock(&mu_);
  auto it = requests_.find(request_id);
  if (it == requests_.end() || !it->second->done) {
    return Status(StatusCode::kFailedPrecondition,
                  "view_intact: request " + request_id + " has no finished load");
  }
  if (auto found = views_->find(request_id, mm_hash)) {
    const FetchSlot& v = *found;
    if (!v.status.ok()) return v.status;  // a renewal the producer refused
    // A producer reuses a block only once no pin holds it, and rewrites its header first.
    std::atomic_thread_fence(std::memory_order_acquire);
    Status header = cache::verify_block(
        v.block.block, v.block.block_length,
        {mm_hash, v.item->meta, v.block.generation, "a view of " + mm_hash.str(),
         /*verify_payload=*/false});
    if (header.ok()) return header;
    return Status(StatusCode::kEvicted,
                  "the view of " + mm_hash.str() + " lost its block: " + header.message());
  }
  return Status(StatusCode::kFailedPrecondition,
                "view_intact: request " + request_id + " holds " + mm_hash.str() + " as a copy");
}

void Connector::request_finished(const std::string& request_id) {
  std::shared_ptr<RequestState> state;
  PendingRelease views;
  {
    MutexLock lock(&mu_);
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
    views = views_->take(request_id);
  }
  // Views end here: what the cache keeps is copied while their pins still hold them.
  if (!views.slots.empty()) {
    if (core_.options().keep_loaded) keep_views(views.slots);
    give_back(std::move(views));
  }
  unpin_all(state->pins);
  driver_->on_request_finished(state->request);
}

// One item of a finished load ends before its request: its view (whose pins at the
// producer are given back, batched with the other releases) or its consumer cache pins.
// The request's other items stay held, and its end gives back what is left.
Status Connector::item_finished(const std::string& request_id, const MmHash& mm_hash) {
  PendingRelease view;
  std::vector<ItemPin> pins;
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->done) {
      return Status(StatusCode::kFailedPrecondition,
                    "item_finished: request " + request_id + " has no finished load");
    }
    RequestState& state = *it->second;
    view = views_->take(request_id, mm_hash);  // no longer renewed from here
    auto held = std::stable_partition(state.pins.begin(), state.pins.end(),
                                      [&](const ItemPin& p) { return !(p.mm_hash == mm_hash); });
    pins.assign(held, state.pins.end());
    state.pins.erase(held, state.pins.end());
  }
  if (view.slots.empty() && pins.empty()) {
    return Status(StatusCode::kFailedPrecondition,
                  "item_finished: request " + request_id + " holds no " + mm_hash.str());
  }
  if (!view.slots.empty()) {
    // Copied (keep_loaded) while its pins still hold it, then released.
    if (core_.options().keep_loaded) keep_views(view.slots);
    give_back(std::move(view));
  }
  unpin_all(pins);
  return Status::Ok();
}

void Connector::unpin_all(const std::vector<ItemPin>& pins) {
  for (const ItemPin& p : pins) core_.consumer_cache()->unpin(p.pin_id).ignore_error();
  if (core_.options().keep_loaded) return;
  // Entries still pinned (another request, a reader of share_loaded) stay.
  for (const ItemPin& p : pins) core_.consumer_cache()->erase(p.mm_hash).ignore_error();
}

// A copy of each view in the consumer cache, for later requests (keep_loaded): off the
// load's critical path, before the view's pin goes. An item already here, or with no room
// for it, is not copied.
void Connector::keep_views(const std::vector<FetchSlot>& views) {
  cache::EncoderCachePool* cache = core_.consumer_cache();
  for (const FetchSlot& v : views) {
    if (!v.status.ok()) continue;
    const MmHash& h = v.item->mm_hash;
    auto ref = cache->reserve(h, v.item->meta, Deadline::after_ms(0));
    if (!ref.ok()) continue;
    copy_streaming(ref->block, v.block.block, v.block.block_length);
    // As a same-host copy is checked (P2pDriver::copy_from_view): the header again after
    // the payload, should the view's pins have lapsed (renewals that never arrived).
    std::atomic_thread_fence(std::memory_order_acquire);
    Status kept;
    if (std::memcmp(ref->block, v.block.block, cache::kBlockHeaderBytes) != 0) {
      cache->abort(h, ref->generation);
      kept = Status(StatusCode::kEvicted, "the view of " + h.str() + " was reused while copied");
    } else {  // a failed commit drops the entry itself
      kept = cache->commit_received(
          h, ref->generation,
          {h, v.item->meta, v.block.generation, "a view of " + h.str(), /*verify_payload=*/false});
    }
    if (!kept.ok()) {
      spdlog::warn("connector {}: keeping the view of {} failed: {}", name(), h.str(),
                   kept.message());
    }
  }
}

Result<std::vector<EcTransferParams>> Connector::share_loaded(const std::string& request_id,
                                                              const MmHash& mm_hash,
                                                              size_t readers) {
  if (!core_.is_consumer())
    return Status(StatusCode::kFailedPrecondition, "connector " + name() + " is not a consumer");
  if (readers == 0 || readers > kMaxShareReaders) {
    return InvalidArgument("share_loaded: " + std::to_string(readers) + " readers, 1 to " +
                           std::to_string(kMaxShareReaders));
  }
  {
    MutexLock lock(&mu_);
    auto it = requests_.find(request_id);
    if (it == requests_.end() || !it->second->done) {
      return Status(StatusCode::kFailedPrecondition,
                    "share_loaded: request " + request_id + " has no finished load");
    }
    const auto& items = it->second->outcome.items;
    bool loaded = std::any_of(items.begin(), items.end(), [&](const ItemOutcome& o) {
      return o.mm_hash == mm_hash && o.status.ok();
    });
    if (!loaded) {
      return Status(StatusCode::kFailedPrecondition,
                    "share_loaded: request " + request_id + " did not load " + mm_hash.str());
    }
    if (auto v = views_->find(request_id, mm_hash)) return share_view(request_id, *v, readers);
  }
  // Each reader's pin counts against the request's own quota of live pins ("share:<id>",
  // max_pins_per_holder): pins readers gave back, or whose lease ended, free it again.
  // They are not ended at request_finished: a step already scheduled may share this load
  // for another request, and its workers read it after this request ends.
  std::vector<EcTransferParams> out;
  std::vector<uint64_t> taken;
  auto lease = std::chrono::milliseconds(core_.options().lease_ms);
  const std::string quota_holder = "share:" + request_id;
  for (size_t i = 0; i < readers; ++i) {
    auto pin = core_.consumer_cache()->pin_for_bearer(mm_hash, quota_holder, lease);
    if (!pin.ok()) {
      for (uint64_t p : taken) core_.consumer_cache()->unpin(p).ignore_error();
      return pin.status().with_context("share_loaded " + mm_hash.str());
    }
    taken.push_back(pin->pin_id);
    out.push_back(core_.located_params(*pin, P2pMode::kPull));
  }
  return out;
}

// An item the request holds as a view of its producer's block: the readers read that
// block too, where it lies, with the producer's own params (its bearer capability, whose
// pin this request holds and renews) re-signed without the pin, so that no reader ends
// it. A reader on the producer's host views it and takes a pin of its own; another reads
// it. The bytes move once, producer to reader, and never through this cache.
Result<std::vector<EcTransferParams>> Connector::share_view(const std::string& request_id,
                                                            const FetchSlot& view,
                                                            size_t readers) const {
  if (!view.status.ok())
    return view.status.with_context("share_loaded " + view.item->mm_hash.str());
  const EcTransferParams& original = *view.item->params;
  if (!original.has_location() || original.capability.empty() || original.pin == 0) {
    return Status(StatusCode::kFailedPrecondition,
                  "share_loaded: request " + request_id + " views " + view.item->mm_hash.str() +
                      " through a pin of its own (its params named no block): nothing to share");
  }
  EcTransferParams shared = original;
  shared.mode = std::string(p2p_mode_name(P2pMode::kPull));
  shared.pin = 0;
  shared.sign(core_.options().auth_secret);
  return std::vector<EcTransferParams>(readers, shared);
}

Result<std::vector<Result<EcTransferParams>>> Connector::remote_saved_params(
    const std::string& producer, const std::vector<MmHash>& hashes, Deadline deadline) {
  if (core_.config().connector != "p2p") {
    return Status(StatusCode::kFailedPrecondition,
                  "remote_saved_params: connector " + name() + " is not p2p");
  }
  if (hashes.size() > kMaxMessageItems) {
    return InvalidArgument("remote_saved_params: " + std::to_string(hashes.size()) +
                           " items, at most " + std::to_string(kMaxMessageItems));
  }
  ECX_ASSIGN_OR_RETURN(auto meta, transfer::AgentMetadata::parse(producer));
  ECX_RETURN_IF_ERROR(
      core_.agent()
          ->connect(meta, {.backend = core_.options().backend, .deadline = deadline})
          .status());
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
  // The producer waits for items still being written at most half the time left, so its
  // answer (and the pins it took for us) arrives while we still wait for it.
  ParamsRequest req{.items = hashes, .wait_ms = std::max<int64_t>(0, left / 2)};
  ECX_ASSIGN_OR_RETURN(std::string answer, core_.agent()->call(meta.name, to_json(req), deadline));
  ECX_ASSIGN_OR_RETURN(ItemsReply reply, parse_items_reply(answer, hashes.size()));
  std::vector<Result<EcTransferParams>> out;
  for (size_t i = 0; i < hashes.size(); ++i) {
    ItemReply& item = reply.items[i];
    if (!item.status.ok()) {
      out.push_back(item.status.with_context("params of " + hashes[i].str() + " at " + meta.name));
    } else if (!item.params || !(item.params->mm_hash == hashes[i]) ||
               item.params->engine_id != meta.name) {
      out.push_back(InvalidArgument("params reply from " + meta.name + " for " + hashes[i].str() +
                                    " names another item or producer"));
    } else if (Status signed_ok = item.params->verify(core_.options().auth_secret);
               !signed_ok.ok()) {
      out.push_back(signed_ok);
    } else {
      out.push_back(std::move(*item.params));
    }
  }
  return out;
}

void Connector::discard(const LoadRequest& request) {
  if (!core_.is_consumer()) return;
  give_back({std::make_shared<const LoadRequest>(request), {}});
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
    MutexLock lock(&nacks_mu_);
    s.nacks = nacks_;
  }
  if (views_) {
    s.views_held = views_->size();
    s.view_renewals_failed = views_->renewals_failed();
  }
  s.items_viewed = items_viewed_.load();
  s.items_offered = items_offered_.load();
  s.offered_refused = offered_refused_.load();
  if (offers_) {
    s.offers_sent = offers_->sent();
    s.offers_failed = offers_->failed();
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
