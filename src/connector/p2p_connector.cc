#include "connector/p2p_connector.h"

#include <atomic>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "cache/pin_table.h"
#include "connector/control_messages.h"
#include "connector/copy_crew.h"
#include "ecx/cache/block_header.h"
#include "ecx/common/checksum.h"
#include "ecx/common/copy.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"

namespace ecx::connector {
namespace {

// Longest a producer holds a lookup open waiting for a not-ready entry.
constexpr int64_t kMaxLookupWaitMs = 2000;
// Longest one connect attempt to a producer waits for its handshake before dialling again.
constexpr int64_t kConnectAttemptMs = 2500;
// Longest a consumer spends connecting to a producer only to give its pins back.
constexpr int64_t kReleaseConnectMs = 2000;

// Pins one RELEASE notice carries at most (a coalesced batch is split beyond it).
constexpr size_t kMaxPinsPerNotice = 256;

// Producers remembered by the consumer (engine id -> metadata) before the map is reset.
constexpr size_t kMaxKnownProducers = 1024;

Result<transfer::Capability> params_capability(const EcTransferParams& p) {
  auto cap = transfer::Capability::parse_hex(p.capability);
  if (!cap.ok()) return cap.status().with_context("ec_transfer_params for " + p.mm_hash.str());
  return cap;
}

int64_t lookup_wait_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
  return std::min<int64_t>(left, kMaxLookupWaitMs);
}

std::string describe(const BlockLocation& loc, const std::string& producer) {
  return "region " + std::to_string(loc.region) + " offset " + std::to_string(loc.offset) +
         " on agent " + producer;
}

class P2pDriver final : public ConnectorDriver {
 public:
  explicit P2pDriver(ConnectorCore& core) : core_(core), copy_crew_(core.options().copy_threads) {}

  Status start();

  // ---------------- producer ----------------
  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override {
    auto ref = producer_pool_->reserve(mm_hash, meta, Deadline::after_ms(options().save_wait_ms));
    if (!ref.ok()) return ref.status();
    return SaveSlot{mm_hash, meta, {ref->payload(), meta.byte_size()}, ref->generation};
  }
  Result<EcTransferParams> commit_save(const SaveSlot& slot) override {
    ECX_RETURN_IF_ERROR(producer_pool_->commit(slot.mm_hash, slot.token));
    return params_for(slot.mm_hash);
  }
  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override {
    // Another request may be encoding this very item: wait for it rather than fail.
    ECX_RETURN_IF_ERROR(
        producer_pool_->wait_ready(mm_hash, Deadline::after_ms(options().load_timeout_ms))
            .status());
    return params_for(mm_hash);
  }
  void abort_save(const SaveSlot& slot) override {
    producer_pool_->abort(slot.mm_hash, slot.token);
  }
  Status wait_for_readers(Deadline deadline) override {
    return producer_pool_->wait_unpinned(deadline);
  }
  Status release_params(const EcTransferParams& params) override;
  bool holds(const MmHash& mm_hash) override {
    return producer_pool_ && producer_pool_->find(mm_hash).ok();
  }
  bool release_granted(uint64_t pin, const transfer::Capability& capability) override;

  // ---------------- consumer ----------------
  bool can_load(const LoadItem& item) override;
  void fetch(std::vector<FetchSlot*>& slots, Deadline deadline) override;
  void view(std::vector<FetchSlot*>& slots, Deadline deadline) override;
  std::vector<Status> renew(std::span<const FetchSlot* const> views, Deadline deadline) override;
  void release(std::span<const FinishedLoad> loads) override;
  void add_stats(ConnectorStats& s) const override;

 private:
  // An exchange of one control request for the pending items (their indices into the
  // group) with the producer, allowing it to wait `wait_ms` for not-ready entries.
  using Exchange =
      std::function<Result<std::string>(const std::vector<size_t>& pending, int64_t wait_ms)>;
  using Settle = std::function<void(size_t index, const ItemReply& reply)>;

  const ConnectorOptions& options() const { return core_.options(); }
  transfer::Agent* agent() const { return core_.agent(); }
  const std::string& name() const { return core_.name(); }

  // producer
  // Pins the item for its params: against the params' quota, or `quota_holder`'s.
  Result<EcTransferParams> params_for(const MmHash& mm_hash, const std::string& quota_holder = "");
  Result<std::string> handle_call(const transfer::Caller& caller, std::string_view body);
  Result<cache::Pin> entry_for(const transfer::Caller& caller, const MmHash& mm_hash,
                               const transfer::Capability& capability, Deadline wait);
  ItemsReply handle_lookup(const transfer::Caller& caller, const LookupRequest& req);
  Result<std::string> handle_load(const transfer::Caller& caller, const LoadBlocksRequest& req);
  ItemsReply handle_params(const transfer::Caller& caller, const ParamsRequest& req);
  ItemsReply handle_renew(const transfer::Caller& caller, const RenewRequest& req);

  // consumer
  Status trust(const LoadItem& item) const;
  Status connect_producer(const EcTransferParams& params, Deadline deadline);
  void call_until_ready(const std::string& producer, const std::vector<FetchSlot*>& group,
                        Deadline deadline, const char* what, const Exchange& exchange,
                        const Settle& settle);
  void lookup(const std::string& producer, std::vector<FetchSlot*>& group,
              std::vector<BlockLocation>& where, Deadline deadline);
  std::vector<BlockLocation> locate(const std::string& producer, std::vector<FetchSlot*>& group,
                                    bool force_lookup, Deadline deadline);
  void fetch_pull(const std::string& producer, std::vector<FetchSlot*>& group, Deadline deadline,
                  bool force_lookup);
  void read_through_view(const std::string& producer, std::vector<FetchSlot*>& moving,
                         std::vector<BlockLocation>& where);
  // A block this load copies out of a same-host producer's memory, through a view.
  struct ViewedBlock {
    FetchSlot* slot;
    transfer::RemoteView view;
    BlockLocation loc;
  };
  void copy_from_views(const std::string& producer, std::vector<ViewedBlock>& blocks);
  void read_batched(const std::string& producer, const std::vector<FetchSlot*>& moving,
                    const std::vector<BlockLocation>& where, Deadline deadline);
  void fetch_push(const std::string& producer, std::vector<FetchSlot*>& group, Deadline deadline);
  void per_producer(std::vector<FetchSlot*>& slots, Deadline deadline,
                    const std::function<void(const std::string&, std::vector<FetchSlot*>&)>& fn);
  void view_group(const std::string& producer, std::vector<FetchSlot*>& group, Deadline deadline);
  bool map_view(const std::string& producer, FetchSlot& slot, const BlockLocation& loc);
  void settle_view(const std::string& producer, FetchSlot& slot, const BlockLocation& named,
                   const BlockLocation& mine);
  // One renew CALL to `producer` for the pins of `group`'s views: per view, the
  // producer's answer for its own pin, or the call's failure.
  std::vector<Status> renew_pins(const std::string& producer,
                                 const std::vector<const FetchSlot*>& group, Deadline deadline);
  using PinsByProducer = std::map<std::string, std::vector<ReleasedPin>>;
  void collect_pins(const FinishedLoad& load, PinsByProducer& by_producer,
                    std::map<std::string, const EcTransferParams*>& params_of) const;

  ConnectorCore& core_;
  std::unique_ptr<cache::EncoderCachePool> producer_pool_;
  Mutex producers_mu_;
  // engine_id -> agent JSON
  std::map<std::string, std::string> known_producers_ ECX_GUARDED_BY(producers_mu_);
  std::atomic<uint64_t> releases_sent_{0}, releases_received_{0}, renewals_received_{0};
  mutable std::atomic<uint64_t> params_rejected_{0};
  // Same-host copies, split over copy_threads. Its helpers go with the driver, which the
  // connector drops only after its loaders are joined and no caller is left in a load.
  CopyCrew copy_crew_;
};

Status P2pDriver::start() {
  if (!core_.is_producer()) return Status::Ok();
  cache::PoolConfig pc;
  pc.name = options().engine_id;
  pc.capacity_bytes = options().pool_bytes;
  pc.lease = std::chrono::milliseconds(options().lease_ms);
  pc.max_pins_per_holder = static_cast<size_t>(options().max_pins_per_holder);
  pc.require_grant = options().require_grants;  // peers read only what they were handed
  ECX_ASSIGN_OR_RETURN(producer_pool_, cache::EncoderCachePool::create(agent(), pc));
  agent()->set_call_handler([this](const transfer::Caller& caller, std::string_view body) {
    return handle_call(caller, body);
  });
  // Pins are held by the caller's authenticated identity, so only its own end here.
  agent()->set_peer_gone_handler([this](const std::string& holder) {
    size_t n = producer_pool_->release_holder(holder);
    if (n) spdlog::info("{}: consumer {} went away, released {} pins", name(), holder, n);
  });
  return Status::Ok();
}

// ---------------- producer ----------------

Status P2pDriver::release_params(const EcTransferParams& p) {
  if (p.connector != "p2p" || p.engine_id != options().engine_id) {
    return InvalidArgument("ec_transfer_params for " + p.mm_hash.str() + " are from '" +
                           p.engine_id + "', not this encoder ('" + options().engine_id + "')");
  }
  ECX_RETURN_IF_ERROR(p.verify(options().auth_secret));
  if (p.pin == 0) return Status::Ok();
  ECX_ASSIGN_OR_RETURN(transfer::Capability cap, params_capability(p));
  // A pin already ended (read and released, or expired) needs nothing more.
  if (producer_pool_->release_granted(p.pin, cap).ok()) releases_received_++;
  return Status::Ok();
}

// An entry that is already cached is not written again: E can skip the encoder.
Result<EcTransferParams> P2pDriver::params_for(const MmHash& mm_hash,
                                               const std::string& quota_holder) {
  // The pin keeps the block in place until the consumer's RELEASE or the lease ends;
  // its capability is the only way in for whoever the proxy hands the params to.
  ECX_ASSIGN_OR_RETURN(cache::Pin pin, quota_holder.empty()
                                           ? producer_pool_->pin_for_peer(mm_hash, "")
                                           : producer_pool_->pin_for_bearer(mm_hash, quota_holder));
  return core_.located_params(pin);
}

Result<std::string> P2pDriver::handle_call(const transfer::Caller& caller, std::string_view body) {
  auto request = parse_control_request(body);
  if (!request.ok()) return request.status().with_context(name() + " from " + caller.name);
  try {  // nothing below throws by design; this keeps a bug from killing the server thread
    if (auto* lookup = std::get_if<LookupRequest>(&*request)) {
      return to_json(handle_lookup(caller, *lookup));
    }
    if (auto* params = std::get_if<ParamsRequest>(&*request))
      return to_json(handle_params(caller, *params));
    if (auto* renew = std::get_if<RenewRequest>(&*request))
      return to_json(handle_renew(caller, *renew));
    return handle_load(caller, std::get<LoadBlocksRequest>(*request));
  } catch (const std::exception& e) {
    return Internal(name() + ": request from " + caller.name + " failed: " + e.what());
  }
}

// The entry a consumer asks for, pinned for that consumer alone. With a capability, the
// consumer proves it was handed the entry (the params' pin must still be live); without
// one it is a lookup by key: knowing the mm_hash (a SHA-256 of the image) is the proof,
// and only authenticated agents of the deployment get this far.
Result<cache::Pin> P2pDriver::entry_for(const transfer::Caller& caller, const MmHash& mm_hash,
                                        const transfer::Capability& capability, Deadline wait) {
  if (!capability.empty()) {
    ECX_RETURN_IF_ERROR(producer_pool_->pin_of_capability(mm_hash, capability).status());
  }
  ECX_RETURN_IF_ERROR(producer_pool_->wait_ready(mm_hash, wait).status());
  return producer_pool_->pin_for_peer(mm_hash, caller.holder);  // ends by RELEASE or death
}

ItemsReply P2pDriver::handle_lookup(const transfer::Caller& caller, const LookupRequest& req) {
  Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
  ItemsReply reply;
  for (const auto& item : req.items) {
    ItemReply out{.mm_hash = item.mm_hash};
    auto pin = entry_for(caller, item.mm_hash, item.capability, wait);
    if (pin.ok()) {
      out.where = {pin->ref.region,     pin->ref.offset, pin->ref.block_length,
                   pin->ref.generation, pin->pin_id,     pin->capability};
    }
    out.status = pin.status();
    reply.items.push_back(std::move(out));
  }
  return reply;
}

// push: writes each block the consumer asks for (entry_for) into the window the consumer
// granted us for it, then ends the pins: ours, and the params' it names.
Result<std::string> P2pDriver::handle_load(const transfer::Caller& caller,
                                           const LoadBlocksRequest& req) {
  const std::string& peer = caller.name;
  ECX_ASSIGN_OR_RETURN(auto consumer, transfer::AgentMetadata::parse(req.consumer));
  if (consumer.name != peer)
    return InvalidArgument("load: consumer metadata names '" + consumer.name + "', not the caller");
  ECX_RETURN_IF_ERROR(agent()->connect(consumer, {.backend = req.backend}).status());
  Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
  std::vector<transfer::TransferDescriptor> descs;
  std::vector<size_t> moving;  // reply index of each descriptor
  std::vector<uint64_t> our_pins;
  ItemsReply reply;
  for (const auto& item : req.items) {
    ItemReply out{.mm_hash = item.mm_hash};
    auto pin = entry_for(caller, item.mm_hash, item.capability, wait);
    Status s = pin.status();
    if (pin.ok()) our_pins.push_back(pin->pin_id);
    if (s.ok() && item.generation != 0 && item.generation != pin->ref.generation) {
      s = Status(StatusCode::kEvicted, "mm_hash " + item.mm_hash.str() + ": generation " +
                                           std::to_string(pin->ref.generation) + " != expected " +
                                           std::to_string(item.generation) + " (evicted)");
    } else if (s.ok() && item.dst_length != pin->ref.block_length) {
      s = InvalidArgument("load: destination of " + std::to_string(item.dst_length) +
                          " bytes for a block of " + std::to_string(pin->ref.block_length));
    }
    if (s.ok()) {
      descs.push_back({pin->ref.block, item.dst_region, item.dst_offset, pin->ref.block_length,
                       item.dst_capability});
      moving.push_back(reply.items.size());
    }
    out.status = s;
    reply.items.push_back(std::move(out));
  }
  if (!descs.empty()) {
    auto handle = agent()->write(peer, descs);
    Status s =
        handle.ok() ? handle->wait(Deadline::after_ms(options().load_timeout_ms)) : handle.status();
    if (!s.ok()) {
      for (size_t i : moving) reply.items[i].status = s;
    }
  }
  for (uint64_t pin : our_pins) producer_pool_->unpin(pin).ignore_error();
  for (const auto& item : req.items) {
    if (item.pin != 0) producer_pool_->release_granted(item.pin, item.capability).ignore_error();
  }
  return to_json(reply);
}

// A RELEASE for a pin of our pool: only with the capability it was granted with, so
// nobody ends another reader's pin.
bool P2pDriver::release_granted(uint64_t pin, const transfer::Capability& capability) {
  if (!producer_pool_ || !producer_pool_->release_granted(pin, capability).ok()) return false;
  releases_received_++;
  return true;
}

// The params pins a caller holds count against a quota of its own (the params' 16 x
// max_pins_per_holder), not against those E issues itself, so no caller can keep E, or
// another caller, from params; an item asked for twice in one call is pinned once, and
// both answers carry that pin.
ItemsReply P2pDriver::handle_params(const transfer::Caller& caller, const ParamsRequest& req) {
  Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
  const std::string quota_holder = std::string(cache::PinTable::kParamsOpPrefix) + caller.holder;
  std::map<MmHash, size_t> answered;  // mm_hash -> its first reply
  ItemsReply reply;
  for (const auto& mm_hash : req.items) {
    if (auto seen = answered.find(mm_hash); seen != answered.end()) {
      ItemReply again = reply.items[seen->second];
      reply.items.push_back(std::move(again));
      continue;
    }
    answered.emplace(mm_hash, reply.items.size());
    ItemReply out{.mm_hash = mm_hash};
    out.status = producer_pool_->wait_ready(mm_hash, wait).status();
    if (out.status.ok()) {
      auto params = params_for(mm_hash, quota_holder);
      out.status = params.status();
      if (params.ok()) out.params = std::move(*params);
    }
    reply.items.push_back(std::move(out));
  }
  return reply;
}

// A consumer keeps reading through zero-copy views: each pin it proves it holds (the
// capability, for this very item) gets another lease and becomes the caller's, within
// its quota; its death ends them (peer-gone handler).
ItemsReply P2pDriver::handle_renew(const transfer::Caller& caller, const RenewRequest& req) {
  ItemsReply reply;
  for (const auto& item : req.items) {
    ItemReply out{.mm_hash = item.mm_hash};
    auto pin = producer_pool_->pin_of_capability(item.mm_hash, item.capability);
    if (pin.ok() && pin->pin_id != item.pin) {
      out.status = NotFound("pin " + std::to_string(item.pin) + " of " + item.mm_hash.str() +
                            ": not held with that capability");
    } else if (!pin.ok()) {
      out.status = pin.status();
    } else {
      out.status = producer_pool_->renew_granted(item.pin, item.capability, caller.holder);
      if (out.status.ok()) renewals_received_++;
    }
    reply.items.push_back(std::move(out));
  }
  return reply;
}

// ---------------- consumer ----------------

// Only params an encoder of this deployment issued, for this very item: anything else (a
// client's forgery, a mix-up) is ignored, and the item is computed here.
Status P2pDriver::trust(const LoadItem& item) const {
  const auto& p = item.params;
  if (!p || p->connector != "p2p" || p->agent.empty()) {
    return InvalidArgument("no p2p ec_transfer_params for " + item.mm_hash.str());
  }
  if (!(p->mm_hash == item.mm_hash)) {
    return PermissionDenied("ec_transfer_params name mm_hash " + p->mm_hash.str() + ", not " +
                            item.mm_hash.str());
  }
  return p->verify(options().auth_secret);
}

bool P2pDriver::can_load(const LoadItem& item) {
  Status trusted = trust(item);
  if (trusted.code() == StatusCode::kPermissionDenied) {
    params_rejected_++;
    spdlog::warn("{}: ignoring ec_transfer_params: {}", name(), trusted.message());
  }
  return trusted.ok();
}

// Groups `slots` by producer (one connection, one batch, one release per producer),
// connects to each, and hands each connected group to `fn`; a group whose producer cannot
// be reached fails.
void P2pDriver::per_producer(
    std::vector<FetchSlot*>& slots, Deadline deadline,
    const std::function<void(const std::string&, std::vector<FetchSlot*>&)>& fn) {
  std::map<std::string, std::vector<FetchSlot*>> by_producer;
  for (FetchSlot* slot : slots) by_producer[slot->item->params->engine_id].push_back(slot);
  for (auto& [producer, group] : by_producer) {
    Status ready = connect_producer(*group.front()->item->params, deadline);
    if (!ready.ok()) {
      for (FetchSlot* s : group) s->status = ready;
      continue;
    }
    fn(producer, group);
  }
}

void P2pDriver::fetch(std::vector<FetchSlot*>& slots, Deadline deadline) {
  per_producer(slots, deadline, [&](const std::string& producer, std::vector<FetchSlot*>& group) {
    switch (options().mode) {
      case P2pMode::kPush:
        fetch_push(producer, group, deadline);
        break;
      case P2pMode::kPull2Step:
        for (FetchSlot* s : group) {
          std::vector<FetchSlot*> one{s};
          fetch_pull(producer, one, deadline, /*force_lookup=*/true);
        }
        break;
      case P2pMode::kPull:
        fetch_pull(producer, group, deadline, /*force_lookup=*/false);
        break;
    }
  });
}

Status P2pDriver::connect_producer(const EcTransferParams& params, Deadline deadline) {
  ECX_RETURN_IF_ERROR(core_.check_compat(params.engine_id, params.compat_hash));
  {
    // Same producer, same metadata as last time: already parsed and connected.
    MutexLock lock(&producers_mu_);
    auto it = known_producers_.find(params.engine_id);
    if (it != known_producers_.end() && it->second == params.agent &&
        agent()->peer_backend(params.engine_id).ok()) {
      return Status::Ok();
    }
  }
  ECX_ASSIGN_OR_RETURN(auto meta, transfer::AgentMetadata::parse(params.agent));
  if (meta.name != params.engine_id) {
    return InvalidArgument("ec_transfer_params: engine_id '" + params.engine_id + "' but agent '" +
                           meta.name + "'");
  }
  // A handshake that gets no answer is given up after kConnectAttemptMs and dialled
  // again, on a new connection, until the load's deadline: one lost connection (seen
  // once, under heavy load on two cores) does not cost the whole load.
  Status connected;
  for (int attempt = 1;; ++attempt) {
    Deadline try_until = Deadline::earliest(deadline, Deadline::after_ms(kConnectAttemptMs));
    connected =
        agent()->connect(meta, {.backend = options().backend, .deadline = try_until}).status();
    if (connected.ok() || connected.code() != StatusCode::kDeadlineExceeded || deadline.expired()) {
      break;
    }
    if (agent()->peer_backend(meta.name).ok()) {
      connected = Status::Ok();  // another load's connect to it, which we waited on, succeeded
      break;
    }
    spdlog::warn("{}: connect to producer {} (attempt {}) got no answer in {} ms: {}; again",
                 name(), meta.name, attempt, kConnectAttemptMs, connected.message());
    agent()->disconnect(meta.name);
  }
  ECX_RETURN_IF_ERROR(connected);
  MutexLock lock(&producers_mu_);
  if (known_producers_.size() >= kMaxKnownProducers) known_producers_.clear();
  known_producers_[params.engine_id] = params.agent;
  return Status::Ok();
}

// Exchanges control requests with the producer until every item of `group` is settled:
// items it reports not ready are asked again (each retry waiting at the producer) until
// the deadline. A failed exchange fails every pending item.
void P2pDriver::call_until_ready(const std::string& producer, const std::vector<FetchSlot*>& group,
                                 Deadline deadline, const char* what, const Exchange& exchange,
                                 const Settle& settle) {
  std::vector<size_t> pending(group.size());
  std::iota(pending.begin(), pending.end(), 0);
  int64_t wait_ms = 0;
  while (!pending.empty()) {
    auto answer = exchange(pending, wait_ms);
    Result<ItemsReply> reply = answer.ok() ? parse_items_reply(*answer, pending.size())
                                           : Result<ItemsReply>(answer.status());
    if (!reply.ok()) {
      for (size_t i : pending) {
        group[i]->status = reply.status().with_context(std::string(what) + " at " + producer);
      }
      return;
    }
    std::vector<size_t> again;
    for (size_t k = 0; k < pending.size(); ++k) {
      const ItemReply& item = reply->items[k];
      if (item.status.code() == StatusCode::kNotReady && !deadline.expired()) {
        core_.note_not_ready(group[pending[k]]->item->mm_hash);
        again.push_back(pending[k]);
        continue;
      }
      settle(pending[k], item);
    }
    pending.swap(again);
    wait_ms = lookup_wait_ms(deadline);
  }
}

// Asks the producer where the blocks are (and pins them for us), proving with each item's
// params capability.
void P2pDriver::lookup(const std::string& producer, std::vector<FetchSlot*>& group,
                       std::vector<BlockLocation>& where, Deadline deadline) {
  auto exchange = [&](const std::vector<size_t>& pending, int64_t wait_ms) {
    LookupRequest req{.wait_ms = wait_ms};
    for (size_t i : pending) {
      auto cap = params_capability(*group[i]->item->params);
      req.items.push_back({group[i]->item->mm_hash, cap.ok() ? *cap : transfer::Capability{}});
    }
    return agent()->call(producer, to_json(req), deadline);
  };
  call_until_ready(producer, group, deadline, "lookup", exchange,
                   [&](size_t i, const ItemReply& reply) {
                     group[i]->status = reply.status;
                     if (reply.status.ok()) where[i] = reply.where;
                   });
}

// Where each block of `group` is at the producer: from its params, or looked up.
std::vector<BlockLocation> P2pDriver::locate(const std::string& producer,
                                             std::vector<FetchSlot*>& group, bool force_lookup,
                                             Deadline deadline) {
  std::vector<BlockLocation> where(group.size());
  std::vector<FetchSlot*> need_lookup;
  std::vector<size_t> lookup_index;
  for (size_t i = 0; i < group.size(); ++i) {
    const auto& p = *group[i]->item->params;
    group[i]->status = Status::Ok();
    if (force_lookup || !p.has_location()) {
      need_lookup.push_back(group[i]);
      lookup_index.push_back(i);
      continue;
    }
    auto cap = params_capability(p);
    if (!cap.ok()) {
      group[i]->status = cap.status();
      continue;
    }
    where[i] = {p.region, p.offset, p.length, p.generation, p.pin, *cap};
  }
  if (need_lookup.empty()) return where;
  std::vector<BlockLocation> found(need_lookup.size());
  lookup(producer, need_lookup, found, deadline);
  for (size_t k = 0; k < need_lookup.size(); ++k) {
    where[lookup_index[k]] = found[k];
    // The lookup pinned the block for us: the release gives that pin back too.
    if (found[k].pin != 0) need_lookup[k]->producer_pin = {found[k].pin, found[k].capability};
  }
  return where;
}

void P2pDriver::fetch_pull(const std::string& producer, std::vector<FetchSlot*>& group,
                           Deadline deadline, bool force_lookup) {
  std::vector<BlockLocation> where = locate(producer, group, force_lookup, deadline);
  // Every block (header + payload) straight into our cache, in one batch.
  std::vector<FetchSlot*> moving;
  std::vector<BlockLocation> moving_where;
  for (size_t i = 0; i < group.size(); ++i) {
    FetchSlot* slot = group[i];
    if (!slot->status.ok()) continue;
    const BlockLocation& loc = where[i];
    if (loc.length != slot->block.block_length) {
      slot->status = InvalidArgument(
          "ec_transfer_params for " + slot->item->mm_hash.str() + ": length " +
          std::to_string(loc.length) + " does not match " + slot->item->meta.to_string() + " (" +
          std::to_string(slot->block.block_length) + " bytes with header)");
      continue;
    }
    moving.push_back(slot);
    moving_where.push_back(loc);
  }
  // Zero-copy where the backend maps the producer's memory; a batched READ otherwise.
  read_through_view(producer, moving, moving_where);
  if (!moving.empty()) read_batched(producer, moving, moving_where, deadline);
  // A grant the producer no longer holds: its pin ended (released, expired), so the block
  // may be gone. That is the "evicted" NACK, not an error of ours.
  for (FetchSlot* slot : group) {
    if (slot->status.code() == StatusCode::kPermissionDenied) {
      slot->status = Status(StatusCode::kEvicted,
                            slot->status.message() + " (the producer no longer grants it)");
    }
  }
}

// zero_copy, pull: views each block where it lies in the producer's memory (same host),
// then takes a pin of our own on it: a lookup with the params' capability, which proves
// the params' pin still holds the block and pins it for this consumer alone (its quota;
// its death ends it; nobody else can release it). Only then is the header checked: with
// our pin live, the block cannot be reused under the view. Blocks that cannot be viewed
// (another host), and views beyond our pin quota, are left to fetch.
void P2pDriver::view(std::vector<FetchSlot*>& slots, Deadline deadline) {
  if (options().mode != P2pMode::kPull) return;  // push and 2-step copy what they move
  per_producer(slots, deadline, [&](const std::string& producer, std::vector<FetchSlot*>& group) {
    view_group(producer, group, deadline);
  });
}

void P2pDriver::view_group(const std::string& producer, std::vector<FetchSlot*>& group,
                           Deadline deadline) {
  std::vector<BlockLocation> where = locate(producer, group, /*force_lookup=*/false, deadline);
  std::vector<FetchSlot*> mapped;
  std::vector<BlockLocation> mapped_where;
  for (size_t i = 0; i < group.size(); ++i) {
    if (map_view(producer, *group[i], where[i])) {
      mapped.push_back(group[i]);
      mapped_where.push_back(where[i]);
    }
  }
  if (mapped.empty()) return;
  // Our own pins: those a lookup by key took already (locate), and the others' now.
  std::vector<BlockLocation> ours = mapped_where;
  std::vector<FetchSlot*> to_pin;
  std::vector<size_t> to_pin_index;
  for (size_t k = 0; k < mapped.size(); ++k) {
    if (mapped[k]->producer_pin.pin != 0) continue;
    to_pin.push_back(mapped[k]);
    to_pin_index.push_back(k);
  }
  if (!to_pin.empty()) {
    std::vector<BlockLocation> found(to_pin.size());
    lookup(producer, to_pin, found, deadline);
    for (size_t j = 0; j < to_pin.size(); ++j) ours[to_pin_index[j]] = found[j];
  }
  for (size_t k = 0; k < mapped.size(); ++k) {
    settle_view(producer, *mapped[k], mapped_where[k], ours[k]);
  }
}

// Maps `slot`'s block, as the params name it at `loc`; false if it is not viewed (failed,
// or left to fetch: the backend maps nothing of that producer).
bool P2pDriver::map_view(const std::string& producer, FetchSlot& slot, const BlockLocation& loc) {
  if (!slot.status.ok()) return false;
  if (loc.length != cache::kBlockHeaderBytes + slot.item->meta.byte_size()) {
    slot.status = InvalidArgument("ec_transfer_params for " + slot.item->mm_hash.str() +
                                  ": length " + std::to_string(loc.length) + " does not match " +
                                  slot.item->meta.to_string());
    return false;
  }
  auto view = agent()->view(producer, loc.region, loc.offset, loc.length, loc.capability);
  if (!view.ok() && view.status().code() == StatusCode::kFailedPrecondition) return false;
  if (!view.ok()) {
    slot.status = view.status().code() == StatusCode::kPermissionDenied
                      ? Status(StatusCode::kEvicted,
                               view.status().message() + " (the producer no longer grants it)")
                      : view.status();
    return false;
  }
  slot.block = cache::BlockRef{.mm_hash = slot.item->mm_hash,
                               .meta = slot.item->meta,
                               .region = loc.region,
                               .offset = loc.offset,
                               .block_length = loc.length,
                               .generation = loc.generation,
                               .block = const_cast<std::byte*>(view->data)};  // read-only
  slot.keepalive = view->keepalive;
  return true;
}

// A mapped view, once the lookup answered for our own pin (`mine`): viewed if the pin is
// on the block the params named and its header is the item's; copied instead if the
// producer pins no more for us; failed otherwise.
void P2pDriver::settle_view(const std::string& producer, FetchSlot& slot,
                            const BlockLocation& named, const BlockLocation& mine) {
  if (mine.pin != 0) slot.producer_pin = {mine.pin, mine.capability};  // released at the end
  Status s = slot.status;
  if (s.code() == StatusCode::kResourceExhausted || s.code() == StatusCode::kFailedPrecondition) {
    // We hold all the pins this producer lets one reader keep, or the block's owner
    // pins nothing for readers (a consumer cache shared by share_loaded): copy it.
    slot.block = {};
    slot.keepalive.reset();
    slot.status = Status::Ok();
    return;
  }
  if (s.ok() && (mine.region != named.region || mine.offset != named.offset ||
                 (named.generation != 0 && mine.generation != named.generation))) {
    s = Status(StatusCode::kEvicted, "block of " + slot.item->mm_hash.str() + " at " +
                                         describe(named, producer) + " was reused");
  }
  if (s.ok()) {
    s = cache::verify_block(
        slot.block.block, slot.block.block_length,
        {slot.item->mm_hash, slot.item->meta, slot.block.generation, describe(named, producer),
         options().verify_checksum(/*crossed=*/false)});
  } else if (s.code() == StatusCode::kNotFound) {
    s = Status(StatusCode::kEvicted, s.message() + " (its pin at " + producer + " ended)");
  }
  slot.status = s;
  slot.viewed = s.ok();
  if (!s.ok()) {
    slot.block = {};
    slot.keepalive.reset();
  }
}

std::vector<Status> P2pDriver::renew_pins(const std::string& producer,
                                          const std::vector<const FetchSlot*>& group,
                                          Deadline deadline) {
  // Each view's own pin first (its answer is the view's), then the params' pins the
  // views' requests hold too: no pin of a live view ends by lease.
  RenewRequest req;
  for (const FetchSlot* slot : group) {
    req.items.push_back(
        {slot->item->mm_hash, slot->producer_pin.pin, slot->producer_pin.capability});
  }
  for (const FetchSlot* slot : group) {
    const auto& p = *slot->item->params;
    auto cap = params_capability(p);
    if (p.pin != 0 && cap.ok()) req.items.push_back({p.mm_hash, p.pin, *cap});
  }
  auto answer = agent()->call(producer, to_json(req), deadline);
  auto reply = answer.ok() ? parse_items_reply(*answer, req.items.size())
                           : Result<ItemsReply>(answer.status());
  std::vector<Status> out;
  for (size_t i = 0; i < group.size(); ++i) {
    out.push_back(reply.ok() ? reply->items[i].status
                             : reply.status().with_context("renew at " + producer));
  }
  return out;
}

// The pins of views still in use get another lease: one renew call per producer.
std::vector<Status> P2pDriver::renew(std::span<const FetchSlot* const> views, Deadline deadline) {
  std::map<std::string, std::vector<size_t>> by_producer;
  for (size_t i = 0; i < views.size(); ++i) {
    by_producer[views[i]->item->params->engine_id].push_back(i);
  }
  std::vector<Status> out(views.size());
  for (const auto& [producer, indices] : by_producer) {
    std::vector<const FetchSlot*> group;
    for (size_t i : indices) group.push_back(views[i]);
    std::vector<Status> answers = renew_pins(producer, group, deadline);
    for (size_t k = 0; k < indices.size(); ++k) {
      // The producer's refusal ends the view; a call that failed (the producer is busy or
      // gone) does not: the pin still runs its lease, and the mapping stays ours.
      const Status& s = answers[k];
      const bool refused = s.code() == StatusCode::kNotFound ||
                           s.code() == StatusCode::kResourceExhausted ||
                           s.code() == StatusCode::kPermissionDenied;
      if (refused) {
        out[indices[k]] =
            Status(StatusCode::kEvicted, "the view of " + views[indices[k]]->item->mm_hash.str() +
                                             " lost its pin: " + s.message());
      } else if (!s.ok()) {
        spdlog::warn("{}: renewing {} pins at {} failed: {} (their leases still run)", name(),
                     indices.size(), producer, s.message());
        break;
      }
    }
  }
  return out;
}

// Reads through a zero-copy view of the producer's arena where the backend has one (shm:
// same host; our pin keeps the block in place). The blocks it could not view because the
// backend maps nothing (or not that memory) stay in `moving` for a READ; the others leave
// it, done or failed.
void P2pDriver::read_through_view(const std::string& producer, std::vector<FetchSlot*>& moving,
                                  std::vector<BlockLocation>& where) {
  std::vector<FetchSlot*> to_read;
  std::vector<BlockLocation> to_read_where;
  std::vector<ViewedBlock> viewed;
  for (size_t k = 0; k < moving.size(); ++k) {
    FetchSlot* slot = moving[k];
    const BlockLocation& loc = where[k];
    auto view = agent()->view(producer, loc.region, loc.offset, loc.length, loc.capability);
    if (!view.ok() && view.status().code() == StatusCode::kFailedPrecondition) {
      to_read.push_back(slot);
      to_read_where.push_back(loc);
      continue;
    }
    if (view.ok()) {
      viewed.push_back({slot, std::move(*view), loc});
    } else {
      slot->status = view.status();
    }
  }
  if (!viewed.empty()) copy_from_views(producer, viewed);
  moving.swap(to_read);
  where.swap(to_read_where);
}

// Copies blocks out of the producer's memory and commits them. Each header is read before
// the payloads and compared after them: the producer clears a block's magic before it can
// be reused (and a reused block gets a new generation), so an unchanged header proves the
// payload copied in between untorn, should our pin have ended meanwhile (lease). The
// payloads' xxh3 is checked besides when the checksum option says so (off by default here:
// nothing crossed a wire); otherwise the payloads are copied by the copy crew, split over
// copy_threads.
void P2pDriver::copy_from_views(const std::string& producer, std::vector<ViewedBlock>& blocks) {
  const bool verify = options().verify_checksum(/*crossed=*/false);
  std::vector<std::optional<uint64_t>> sums(blocks.size());
  std::vector<CopyCrew::Range> payloads;
  for (size_t k = 0; k < blocks.size(); ++k) {
    FetchSlot& slot = *blocks[k].slot;
    const std::byte* block = blocks[k].view.data;
    std::memcpy(slot.block.block, block, cache::kBlockHeaderBytes);
    const uint64_t payload = blocks[k].loc.length - cache::kBlockHeaderBytes;
    if (verify) {
      sums[k] = copy_with_checksum(slot.block.payload(), block + cache::kBlockHeaderBytes, payload);
    } else {
      // A large block of our cache is rarely in cache: streaming stores skip reading it.
      payloads.push_back({slot.block.payload(), block + cache::kBlockHeaderBytes, payload});
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);  // the headers' loads before the payloads'
  copy_crew_.copy(payloads);
  std::atomic_thread_fence(std::memory_order_acquire);  // the payloads' loads before these
  for (size_t k = 0; k < blocks.size(); ++k) {
    FetchSlot& slot = *blocks[k].slot;
    const BlockLocation& loc = blocks[k].loc;
    if (std::memcmp(slot.block.block, blocks[k].view.data, cache::kBlockHeaderBytes) != 0) {
      slot.status = Status(StatusCode::kEvicted, "block at " + describe(loc, producer) +
                                                     " was evicted and reused while it was read");
      continue;
    }
    slot.status = core_.consumer_cache()->commit_received(
        slot.item->mm_hash, slot.block.generation,
        {slot.item->mm_hash, slot.item->meta, loc.generation, describe(loc, producer), verify},
        sums[k]);
  }
}

// One batched READ of every block. Where the payload is checked, the backend hashes it as
// it lands when it can (tcp): commit_received then compares that digest, with no second
// pass over the payload.
void P2pDriver::read_batched(const std::string& producer, const std::vector<FetchSlot*>& moving,
                             const std::vector<BlockLocation>& where, Deadline deadline) {
  const bool verify = options().verify_checksum(/*crossed=*/true);
  std::vector<transfer::TransferDescriptor> descs;
  for (size_t k = 0; k < moving.size(); ++k) {
    const BlockLocation& loc = where[k];
    descs.push_back({moving[k]->block.block, loc.region, loc.offset, loc.length, loc.capability});
    const uint64_t payload = moving[k]->item->meta.byte_size();
    if (verify && loc.length >= cache::kBlockHeaderBytes &&
        payload <= loc.length - cache::kBlockHeaderBytes) {
      descs.back().digest_from = cache::kBlockHeaderBytes;
      descs.back().digest_length = payload;
    }
  }
  auto handle = agent()->read(producer, descs, deadline);
  Status s = handle.ok() ? handle->wait(deadline) : handle.status();
  for (size_t k = 0; k < moving.size(); ++k) {
    FetchSlot* slot = moving[k];
    std::optional<uint64_t> landed_sum;
    if (s.ok() && verify && descs[k].digest_length != 0) landed_sum = handle->digest(k);
    slot->status = s.ok() ? core_.consumer_cache()->commit_received(
                                slot->item->mm_hash, slot->block.generation,
                                {slot->item->mm_hash, slot->item->meta, where[k].generation,
                                 describe(where[k], producer), verify},
                                landed_sum)
                          : s;
  }
}

// push: asks the producer to write each block into the window we grant it in our cache.
void P2pDriver::fetch_push(const std::string& producer, std::vector<FetchSlot*>& group,
                           Deadline deadline) {
  auto exchange = [&](const std::vector<size_t>& pending, int64_t wait_ms) {
    LoadBlocksRequest req{.consumer = agent()->metadata().to_json(),
                          .backend = options().backend,
                          .wait_ms = wait_ms};
    // The producer may write our reserved blocks, and nothing else, until the call ends.
    std::vector<transfer::Capability> grants;
    for (size_t i : pending) {
      FetchSlot* slot = group[i];
      const auto& p = *slot->item->params;
      auto cap = params_capability(p);
      auto window = agent()->grant(core_.consumer_cache()->region_id(), slot->block.offset,
                                   slot->block.block_length, /*write=*/true, producer);
      if (window.ok()) grants.push_back(*window);
      req.items.push_back({.mm_hash = slot->item->mm_hash,
                           .capability = cap.ok() ? *cap : transfer::Capability{},
                           .dst_region = core_.consumer_cache()->region_id(),
                           .dst_offset = slot->block.offset,
                           .dst_length = slot->block.block_length,
                           .dst_capability = window.ok() ? *window : transfer::Capability{},
                           .generation = p.generation,
                           .pin = p.pin});
    }
    auto answer = agent()->call(producer, to_json(req), deadline);
    for (const auto& g : grants) agent()->revoke(g);
    return answer;
  };
  call_until_ready(
      producer, group, deadline, "load", exchange, [&](size_t i, const ItemReply& reply) {
        FetchSlot* slot = group[i];
        // The producer ends the params' pin once it has written (or failed).
        slot->params_pin_released = true;
        Status s = reply.status;
        if (s.ok()) {
          s = core_.consumer_cache()->commit_received(
              slot->item->mm_hash, slot->block.generation,
              {slot->item->mm_hash, slot->item->meta, slot->item->params->generation,
               "our cache offset " + std::to_string(slot->block.offset) + " written by " + producer,
               options().verify_checksum(/*crossed=*/true)});
        }
        slot->status = s;
      });
}

// The pins `load` holds at producers: each trusted item's params pin (unless the
// producer ended it itself), and the pins lookups took.
void P2pDriver::collect_pins(const FinishedLoad& load, PinsByProducer& by_producer,
                             std::map<std::string, const EcTransferParams*>& params_of) const {
  std::set<const LoadItem*> kept;   // ended by the producer, or (at the load's end) viewed
  std::set<const LoadItem*> views;  // of a views release: only these items
  for (const auto& slot : *load.slots) {
    if (slot.params_pin_released || (slot.viewed && !load.views)) kept.insert(slot.item);
    if (load.views) views.insert(slot.item);
    // A view's pins go with the views, at the request's end; the others' at the load's.
    if (slot.producer_pin.pin != 0 && slot.viewed == load.views) {
      by_producer[slot.item->params->engine_id].push_back(slot.producer_pin);
    }
  }
  for (const auto& item : load.request->items) {
    if (load.views && !views.count(&item)) continue;
    if (kept.count(&item) || !trust(item).ok() || item.params->pin == 0) continue;
    auto cap = params_capability(*item.params);
    if (!cap.ok()) continue;
    by_producer[item.params->engine_id].push_back({item.params->pin, *cap});
    params_of[item.params->engine_id] = &*item.params;
  }
}

// Gives back what `loads` hold at producers: one notice per producer for all of them
// (split past kMaxPinsPerNotice).
void P2pDriver::release(std::span<const FinishedLoad> loads) {
  PinsByProducer by_producer;
  std::map<std::string, const EcTransferParams*> params_of;  // to connect, if need be
  for (const FinishedLoad& load : loads) collect_pins(load, by_producer, params_of);
  for (auto& [producer, pins] : by_producer) {
    // A request that never loaded (discarded) may name a producer we never connected to.
    if (!agent()->peer_backend(producer).ok() && params_of.count(producer)) {
      connect_producer(*params_of[producer], Deadline::after_ms(kReleaseConnectMs)).ignore_error();
    }
    for (size_t first = 0; first < pins.size(); first += kMaxPinsPerNotice) {
      size_t n = std::min(kMaxPinsPerNotice, pins.size() - first);
      std::vector<ReleasedPin> part(pins.begin() + first, pins.begin() + first + n);
      if (agent()->notify(producer, to_json(ReleaseNotice{std::move(part)})).ok()) {
        releases_sent_ += n;
      }
    }
  }
}

void P2pDriver::add_stats(ConnectorStats& s) const {
  s.releases_sent = releases_sent_.load();
  s.releases_received = releases_received_.load();
  s.renewals_received = renewals_received_.load();
  s.params_rejected = params_rejected_.load();
  if (agent() != nullptr) {
    transfer::AgentStats a = agent()->stats();
    s.transfer_connects = a.connects_by_backend;
    s.peer_failures = a.peer_failures;
  }
  if (producer_pool_) s.producer_pool = producer_pool_->stats();
}

}  // namespace

Result<std::unique_ptr<EcConnector>> create_p2p_connector(ConnectorConfig config,
                                                          ConnectorOptions options,
                                                          ConnectorContext context) {
  auto kind =
      driver_kind<P2pDriver>("p2p:" + std::string(p2p_mode_name(options.mode)),
                             /*consumer_cache_remote_write=*/options.mode == P2pMode::kPush);
  return make_connector(std::move(kind), std::move(config), std::move(options), std::move(context));
}

}  // namespace ecx::connector
