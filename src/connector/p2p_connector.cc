#include "connector/p2p_connector.h"

#include <cstring>
#include <map>

#include "connector/control_messages.h"
#include "ecx/common/checksum.h"
#include "ecx/common/log.h"

namespace ecx::connector {
namespace {

using nlohmann::json;

// Longest a producer holds a lookup open waiting for a not-ready entry.
constexpr int64_t kMaxLookupWaitMs = 2000;

// A block's location at the producer, from params or a lookup.
using Location = BlockLocation;

// Producers remembered by the consumer (engine id -> metadata) before the map is reset.
constexpr size_t kMaxKnownProducers = 1024;

class P2pConnector final : public ConnectorBase {
 public:
  P2pConnector(ConnectorConfig config, ConnectorOptions options, ConnectorContext context)
      : ConnectorBase("p2p:" + std::string(p2p_mode_name(options.mode)), std::move(config), options,
                      std::move(context)) {}

  ~P2pConnector() override {
    shutdown_base();
    producer_pool_.reset();
  }

  Status init() {
    ECX_RETURN_IF_ERROR(
        init_base(/*consumer_cache_remote_write=*/options().mode == P2pMode::kPush));
    if (is_producer()) {
      cache::PoolConfig pc;
      pc.name = options().engine_id;
      pc.capacity_bytes = options().pool_bytes;
      pc.lease = std::chrono::milliseconds(options().lease_ms);
      pc.require_grant = options().require_grants;  // peers read only what they were handed
      ECX_ASSIGN_OR_RETURN(producer_pool_, cache::EncoderCachePool::create(agent(), pc));
      agent()->set_call_handler([this](const std::string& peer, std::string_view body) {
        return handle_call(peer, body);
      });
      agent()->set_notification_handler(
          [this](transfer::Notification n) { handle_notification(n); });
      agent()->set_peer_gone_handler([this](const std::string& peer) {
        size_t n = producer_pool_->release_holder(peer);
        if (n) spdlog::info("{}: consumer {} went away, released {} pins", name(), peer, n);
      });
    }
    return Status::Ok();
  }

  // ---------------- producer ----------------

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override {
    if (!producer_pool_)
      return Status(StatusCode::kFailedPrecondition, name() + " is not a producer");
    auto ref = producer_pool_->reserve(mm_hash, meta, Deadline::after_ms(options().save_wait_ms));
    if (!ref.ok()) return ref.status();
    return SaveSlot{mm_hash, meta, {ref->payload(), meta.byte_size()}, ref->generation};
  }

  Result<EcTransferParams> commit_save(const SaveSlot& slot) override {
    if (!producer_pool_)
      return Status(StatusCode::kFailedPrecondition, name() + " is not a producer");
    ECX_RETURN_IF_ERROR(producer_pool_->commit(slot.mm_hash, slot.token));
    saves_++;
    return params_for(slot.mm_hash);
  }

  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override {
    if (!producer_pool_)
      return Status(StatusCode::kFailedPrecondition, name() + " is not a producer");
    // Another request may be encoding this very item: wait for it rather than fail.
    ECX_RETURN_IF_ERROR(
        producer_pool_->wait_ready(mm_hash, Deadline::after_ms(options().load_timeout_ms))
            .status());
    return params_for(mm_hash);
  }

  void abort_save(const SaveSlot& slot) override {
    if (producer_pool_) producer_pool_->abort(slot.mm_hash, slot.token);
  }

  Status wait_for_readers(Deadline deadline) override {
    return producer_pool_ ? producer_pool_->wait_unpinned(deadline) : Status::Ok();
  }

  // An entry that is already cached is not written again: E can skip the encoder.
  Result<EcTransferParams> params_for(const MmHash& mm_hash) {
    // The pin keeps the block in place until the consumer's RELEASE or the lease ends;
    // its capability is the only way in for whoever the proxy hands the params to.
    ECX_ASSIGN_OR_RETURN(cache::Pin pin, producer_pool_->pin_for_peer(mm_hash, ""));
    EcTransferParams p;
    p.connector = "p2p";
    p.mode = p2p_mode_name(options().mode);
    p.engine_id = options().engine_id;
    p.agent = agent_metadata();
    p.compat_hash = options().compat_hash;
    p.mm_hash = mm_hash;
    p.meta = pin.ref.meta;
    p.num_tokens = pin.ref.meta.shape.empty() ? 0 : static_cast<uint64_t>(pin.ref.meta.shape[0]);
    p.region = pin.ref.region;
    p.offset = pin.ref.offset;
    p.length = pin.ref.block_length;
    p.generation = pin.ref.generation;
    p.pin = pin.pin_id;
    p.capability = pin.capability.hex();
    p.sign(options().auth_secret);
    return p;
  }

  std::string agent_metadata() {
    std::lock_guard lock(meta_mu_);
    if (metadata_json_.empty()) metadata_json_ = agent()->metadata().to_json();
    return metadata_json_;
  }

  Result<std::string> handle_call(const std::string& peer, std::string_view body) {
    auto request = parse_control_request(body);
    if (!request.ok()) return request.status().with_context(name() + " from " + peer);
    try {  // nothing below throws by design; this keeps a bug from killing the server thread
      if (auto* lookup = std::get_if<LookupRequest>(&*request)) {
        return to_json(handle_lookup(peer, *lookup));
      }
      return handle_load(peer, std::get<LoadBlocksRequest>(*request));
    } catch (const std::exception& e) {
      return Internal(name() + ": request from " + peer + " failed: " + e.what());
    }
  }

  // The entry a consumer asks for, pinned for that consumer alone. With a capability,
  // the consumer proves it was handed the entry (the params' pin must still be live);
  // without one it is a lookup by key: knowing the mm_hash (a SHA-256 of the image) is
  // the proof, and only authenticated agents of the deployment get this far.
  Result<cache::Pin> entry_for(const std::string& peer, const MmHash& mm_hash,
                               const transfer::Capability& capability, Deadline wait) {
    if (!capability.empty()) {
      ECX_RETURN_IF_ERROR(producer_pool_->pin_of_capability(mm_hash, capability).status());
    }
    ECX_RETURN_IF_ERROR(producer_pool_->wait_ready(mm_hash, wait).status());
    return producer_pool_->pin_for_peer(mm_hash, peer);  // ends by RELEASE or peer death
  }

  ItemsReply handle_lookup(const std::string& peer, const LookupRequest& req) {
    Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
    ItemsReply reply;
    for (const auto& item : req.items) {
      ItemReply out{.mm_hash = item.mm_hash};
      auto pin = entry_for(peer, item.mm_hash, item.capability, wait);
      if (pin.ok()) {
        out.where = {pin->ref.region,     pin->ref.offset, pin->ref.block_length,
                     pin->ref.generation, pin->pin_id,     pin->capability};
      }
      out.status = pin.status();
      reply.items.push_back(std::move(out));
    }
    return reply;
  }

  // push: writes each block the consumer asks for (entry_for) into the window the
  // consumer granted us for it, then ends the pins: ours, and the params' it names.
  Result<std::string> handle_load(const std::string& peer, const LoadBlocksRequest& req) {
    ECX_ASSIGN_OR_RETURN(auto consumer, transfer::AgentMetadata::parse(req.consumer));
    if (consumer.name != peer)
      return InvalidArgument("load: consumer metadata names '" + consumer.name +
                             "', not the caller");
    ECX_RETURN_IF_ERROR(agent()->connect(consumer, {.backend = req.backend}).status());
    Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
    std::vector<transfer::TransferDescriptor> descs;
    std::vector<size_t> moving;  // reply index of each descriptor
    std::vector<uint64_t> our_pins;
    ItemsReply reply;
    for (const auto& item : req.items) {
      ItemReply out{.mm_hash = item.mm_hash};
      auto pin = entry_for(peer, item.mm_hash, item.capability, wait);
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
      Status s = handle.ok() ? handle->wait(Deadline::after_ms(options().load_timeout_ms))
                             : handle.status();
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

  void handle_notification(const transfer::Notification& n) {
    auto notice = parse_release_notice(n.message);
    if (!notice.ok()) {
      spdlog::warn("{}: ignored a notification from {}: {}", name(), n.from,
                   notice.status().message());
      return;
    }
    // Only pins whose capability the sender holds: nobody ends another reader's pin.
    for (const auto& p : notice->pins) {
      if (producer_pool_->release_granted(p.pin, p.capability).ok()) releases_received_++;
    }
  }

  // ---------------- consumer ----------------

  bool can_load(const LoadItem& item) override {
    if (!item.params || item.params->connector != "p2p" || item.params->agent.empty()) {
      return false;
    }
    // Only params an encoder of this deployment issued, for this very item: anything
    // else (a client's forgery, a mix-up) is ignored, and the item is computed here.
    Status trusted =
        item.params->mm_hash == item.mm_hash
            ? item.params->verify(options().auth_secret)
            : PermissionDenied("ec_transfer_params name mm_hash " + item.params->mm_hash.str() +
                               ", not " + item.mm_hash.str());
    if (!trusted.ok()) {
      params_rejected_++;
      spdlog::warn("{}: ignoring ec_transfer_params: {}", name(), trusted.message());
      return false;
    }
    return true;
  }

  void on_unused_params(const LoadItem& item) override {
    const EcTransferParams& p = *item.params;
    if (p.connector != "p2p" || p.pin == 0 || !(p.mm_hash == item.mm_hash) ||
        !p.verify(options().auth_secret).ok()) {
      return;
    }
    auto cap = params_capability(p);
    if (cap.ok()) queue_release(p.engine_id, {{p.pin, *cap}});
  }

  void fetch(const LoadRequest& request, std::vector<FetchSlot*>& slots,
             Deadline deadline) override {
    // Group by producer: one connection, one batch, one release per producer.
    std::map<std::string, std::vector<FetchSlot*>> by_producer;
    for (FetchSlot* slot : slots) by_producer[slot->item->params->engine_id].push_back(slot);
    for (auto& [producer, group] : by_producer) {
      Status ready = connect_producer(*group.front()->item->params, deadline);
      if (!ready.ok()) {
        for (FetchSlot* s : group) s->status = ready;
        continue;
      }
      if (options().mode == P2pMode::kPush) {
        fetch_push(producer, group, deadline);
      } else if (options().mode == P2pMode::kPull2Step) {
        for (FetchSlot* s : group) {
          std::vector<FetchSlot*> one{s};
          fetch_pull(producer, one, deadline, /*force_lookup=*/true);
        }
      } else {
        fetch_pull(producer, group, deadline, /*force_lookup=*/false);
      }
    }
    (void)request;
  }

  Status connect_producer(const EcTransferParams& params, Deadline deadline) {
    ECX_RETURN_IF_ERROR(check_compat(params.engine_id, params.compat_hash));
    {
      // Same producer, same metadata as last time: already parsed and connected.
      std::lock_guard lock(producers_mu_);
      auto it = known_producers_.find(params.engine_id);
      if (it != known_producers_.end() && it->second == params.agent &&
          agent()->peer_backend(params.engine_id).ok()) {
        return Status::Ok();
      }
    }
    ECX_ASSIGN_OR_RETURN(auto meta, transfer::AgentMetadata::parse(params.agent));
    if (meta.name != params.engine_id) {
      return InvalidArgument("ec_transfer_params: engine_id '" + params.engine_id +
                             "' but agent '" + meta.name + "'");
    }
    ECX_RETURN_IF_ERROR(
        agent()->connect(meta, {.backend = options().backend, .deadline = deadline}).status());
    std::lock_guard lock(producers_mu_);
    if (known_producers_.size() >= kMaxKnownProducers) known_producers_.clear();
    known_producers_[params.engine_id] = params.agent;
    return Status::Ok();
  }

  // Asks the producer where the blocks are (and pins them for us), proving with each
  // item's params capability. Retries not-ready items, each retry waiting at the
  // producer, until the deadline.
  void lookup(const std::string& producer, std::vector<FetchSlot*>& group,
              std::vector<Location>& where, Deadline deadline) {
    std::vector<size_t> pending;
    for (size_t i = 0; i < group.size(); ++i) pending.push_back(i);
    int64_t wait_ms = 0;
    while (!pending.empty()) {
      LookupRequest req{.wait_ms = wait_ms};
      for (size_t i : pending) {
        auto cap = params_capability(*group[i]->item->params);
        req.items.push_back({group[i]->item->mm_hash, cap.ok() ? *cap : transfer::Capability{}});
      }
      auto answer = agent()->call(producer, to_json(req), deadline);
      Result<ItemsReply> reply = answer.ok() ? parse_items_reply(*answer, pending.size())
                                             : Result<ItemsReply>(answer.status());
      if (!reply.ok()) {
        for (size_t i : pending) {
          group[i]->status = reply.status().with_context("lookup at " + producer);
        }
        return;
      }
      std::vector<size_t> again;
      for (size_t k = 0; k < pending.size(); ++k) {
        const ItemReply& it = reply->items[k];
        FetchSlot* slot = group[pending[k]];
        if (it.status.code() == StatusCode::kNotReady && !deadline.expired()) {
          note_not_ready(slot->item->mm_hash);
          again.push_back(pending[k]);
          continue;
        }
        slot->status = it.status;
        if (!it.status.ok()) continue;
        where[pending[k]] = it.where;
      }
      pending.swap(again);
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
      wait_ms = std::min<int64_t>(left, kMaxLookupWaitMs);
    }
  }

  static Result<transfer::Capability> params_capability(const EcTransferParams& p) {
    auto cap = transfer::Capability::parse_hex(p.capability);
    if (!cap.ok()) return cap.status().with_context("ec_transfer_params for " + p.mm_hash.str());
    return cap;
  }

  void fetch_pull(const std::string& producer, std::vector<FetchSlot*>& group, Deadline deadline,
                  bool force_lookup) {
    std::vector<Location> where(group.size());
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
    if (!need_lookup.empty()) {
      std::vector<Location> found(need_lookup.size());
      lookup(producer, need_lookup, found, deadline);
      for (size_t k = 0; k < need_lookup.size(); ++k) where[lookup_index[k]] = found[k];
    }
    // One batched READ of every block (header + payload) straight into our cache.
    std::vector<transfer::TransferDescriptor> descs;
    std::vector<FetchSlot*> moving;
    std::vector<Location> moving_where;
    for (size_t i = 0; i < group.size(); ++i) {
      FetchSlot* slot = group[i];
      if (!slot->status.ok()) continue;
      const Location& loc = where[i];
      if (loc.length != slot->block.block_length) {
        slot->status = InvalidArgument(
            "ec_transfer_params for " + slot->item->mm_hash.str() + ": length " +
            std::to_string(loc.length) + " does not match " + slot->item->meta.to_string() + " (" +
            std::to_string(slot->block.block_length) + " bytes with header)");
        continue;
      }
      descs.push_back({slot->block.block, loc.region, loc.offset, loc.length, loc.capability});
      moving.push_back(slot);
      moving_where.push_back(loc);
    }
    auto backend = agent()->peer_backend(producer);
    if (!descs.empty() && backend.ok() && *backend == transfer::Backend::kShm) {
      // Same host: read through the zero-copy view of the producer's arena (our pin
      // keeps the block in place) and checksum each chunk while it is in cache.
      for (size_t k = 0; k < moving.size(); ++k) {
        FetchSlot* slot = moving[k];
        const Location& loc = moving_where[k];
        auto view = agent()->view(producer, loc.region, loc.offset, loc.length, loc.capability);
        if (!view.ok()) {
          slot->status = view.status();
          continue;
        }
        std::memcpy(slot->block.block, view->data, cache::kBlockHeaderBytes);
        uint64_t sum =
            copy_with_checksum(slot->block.payload(), view->data + cache::kBlockHeaderBytes,
                               loc.length - cache::kBlockHeaderBytes);
        slot->status = consumer_cache()->commit_received(
            slot->item->mm_hash, slot->block.generation,
            {slot->item->mm_hash, slot->item->meta, loc.generation,
             "region " + std::to_string(loc.region) + " offset " + std::to_string(loc.offset) +
                 " on agent " + producer},
            sum);
      }
    } else if (!descs.empty()) {
      auto handle = agent()->read(producer, descs, deadline);
      Status s = handle.ok() ? handle->wait(deadline) : handle.status();
      for (size_t k = 0; k < moving.size(); ++k) {
        FetchSlot* slot = moving[k];
        if (s.ok()) {
          slot->status = consumer_cache()->commit_received(
              slot->item->mm_hash, slot->block.generation,
              {slot->item->mm_hash, slot->item->meta, moving_where[k].generation,
               "region " + std::to_string(moving_where[k].region) + " offset " +
                   std::to_string(moving_where[k].offset) + " on agent " + producer});
        } else {
          slot->status = s;
        }
      }
    }
    // A grant the producer no longer holds: its pin ended (released, expired), so the
    // block may be gone. That is the "evicted" NACK, not an error of ours.
    for (FetchSlot* slot : group) {
      if (slot->status.code() == StatusCode::kPermissionDenied) {
        slot->status = Status(StatusCode::kEvicted,
                              slot->status.message() + " (the producer no longer grants it)");
      }
    }
    // Release what we pinned at the producer (params pins and lookup pins), in one
    // message, whether the read worked or not.
    ReleaseNotice release;
    for (size_t i = 0; i < group.size(); ++i) {
      if (where[i].pin != 0) release.pins.push_back({where[i].pin, where[i].capability});
      // pull-2step looked the item up again: the pin from E's params is released too.
      const auto& p = *group[i]->item->params;
      auto cap = params_capability(p);
      if (p.pin != 0 && p.pin != where[i].pin && cap.ok()) release.pins.push_back({p.pin, *cap});
    }
    if (!release.pins.empty()) queue_release(producer, std::move(release.pins));
  }

  void fetch_push(const std::string& producer, std::vector<FetchSlot*>& all, Deadline deadline) {
    std::vector<FetchSlot*> group = all;
    int64_t wait_ms = 0;
    // The producer may write our reserved blocks, and nothing else, until the call ends.
    std::vector<transfer::Capability> grants;
    auto revoke_all = [&] {
      for (const auto& g : grants) agent()->revoke(g);
      grants.clear();
    };
    while (!group.empty()) {
      LoadBlocksRequest req{.consumer = agent()->metadata().to_json(),
                            .backend = options().backend,
                            .wait_ms = wait_ms};
      for (FetchSlot* slot : group) {
        const auto& p = *slot->item->params;
        auto cap = params_capability(p);
        auto window = agent()->grant(consumer_cache()->region_id(), slot->block.offset,
                                     slot->block.block_length, /*write=*/true, producer);
        if (window.ok()) grants.push_back(*window);
        req.items.push_back({.mm_hash = slot->item->mm_hash,
                             .capability = cap.ok() ? *cap : transfer::Capability{},
                             .dst_region = consumer_cache()->region_id(),
                             .dst_offset = slot->block.offset,
                             .dst_length = slot->block.block_length,
                             .dst_capability = window.ok() ? *window : transfer::Capability{},
                             .generation = p.generation,
                             .pin = p.pin});
      }
      auto answer = agent()->call(producer, to_json(req), deadline);
      revoke_all();
      Result<ItemsReply> reply = answer.ok() ? parse_items_reply(*answer, group.size())
                                             : Result<ItemsReply>(answer.status());
      if (!reply.ok()) {
        for (FetchSlot* s : group) s->status = reply.status().with_context("load at " + producer);
        return;
      }
      std::vector<FetchSlot*> again;
      for (size_t i = 0; i < group.size(); ++i) {
        FetchSlot* slot = group[i];
        Status s = reply->items[i].status;
        if (s.code() == StatusCode::kNotReady && !deadline.expired()) {
          note_not_ready(slot->item->mm_hash);
          again.push_back(slot);
          continue;
        }
        if (s.ok()) {
          s = consumer_cache()->commit_received(
              slot->item->mm_hash, slot->block.generation,
              {slot->item->mm_hash, slot->item->meta, slot->item->params->generation,
               "our cache offset " + std::to_string(slot->block.offset) + " written by " +
                   producer});
        }
        slot->status = s;
      }
      group.swap(again);
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
      wait_ms = std::min<int64_t>(left, kMaxLookupWaitMs);
    }
  }

  // RELEASE travels off the critical path: queued here, sent after the load completes.
  void queue_release(const std::string& producer, std::vector<ReleasedPin> pins) {
    std::lock_guard lock(release_mu_);
    auto& q = pending_releases_[producer];
    q.insert(q.end(), pins.begin(), pins.end());
  }

  void after_load(const LoadRequest&, const std::vector<FetchSlot*>&) override {
    std::map<std::string, std::vector<ReleasedPin>> batch;
    {
      std::lock_guard lock(release_mu_);
      batch.swap(pending_releases_);
    }
    for (auto& [producer, pins] : batch) {
      size_t n = pins.size();
      Status s = agent()->notify(producer, to_json(ReleaseNotice{std::move(pins)}));
      if (s.ok()) releases_sent_ += n;
    }
  }

  void add_stats(json& j) const override {
    j["releases_sent"] = releases_sent_.load();
    j["releases_received"] = releases_received_.load();
    j["params_rejected"] = params_rejected_.load();
    if (producer_pool_) {
      auto s = producer_pool_->stats();
      j["producer_pool"] = {{"capacity_bytes", s.capacity_bytes},
                            {"used_bytes", s.used_bytes},
                            {"payload_bytes", s.payload_bytes},
                            {"entries", s.entries},
                            {"pinned_entries", s.pinned_entries},
                            {"pins", s.pins},
                            {"evictions", s.evictions},
                            {"lease_expiries", s.lease_expiries},
                            {"bytes_used_per_payload_byte", s.bytes_used_per_payload_byte}};
    }
  }

 public:
  cache::EncoderCachePool* producer_pool() const { return producer_pool_.get(); }

 private:
  std::unique_ptr<cache::EncoderCachePool> producer_pool_;
  std::mutex meta_mu_;
  std::string metadata_json_;  // guarded by meta_mu_
  std::mutex producers_mu_;
  std::map<std::string, std::string> known_producers_;  // engine_id -> agent JSON; guarded
  std::mutex release_mu_;
  std::map<std::string, std::vector<ReleasedPin>> pending_releases_;  // guarded by release_mu_
  std::atomic<uint64_t> releases_sent_{0}, releases_received_{0}, params_rejected_{0};
};

}  // namespace

Result<std::unique_ptr<EcConnector>> create_p2p_connector(ConnectorConfig config,
                                                          ConnectorOptions options,
                                                          ConnectorContext context) {
  return make_connector<P2pConnector>(std::move(config), std::move(options), std::move(context));
}

}  // namespace ecx::connector
