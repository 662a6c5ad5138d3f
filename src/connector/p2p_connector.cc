#include "connector/p2p_connector.h"

#include <cstring>
#include <map>

#include "ecx/common/checksum.h"
#include "ecx/common/log.h"

namespace ecx::connector {
namespace {

using nlohmann::json;

// Longest a producer holds a lookup open waiting for a not-ready entry.
constexpr int64_t kMaxLookupWaitMs = 2000;

// A block's location at the producer, from params or a lookup.
struct Location {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t generation = 0;
  uint64_t pin = 0;
};

json status_json(const Status& s) {
  return {{"status", std::string(status_code_name(s.code()))}, {"message", s.message()}};
}

Status status_from_json(const json& j) {
  auto code = status_code_from_name(j.value("status", "internal")).value_or(StatusCode::kInternal);
  return Status(code, j.value("message", std::string()));
}

class P2pConnector final : public ConnectorBase {
 public:
  P2pConnector(ConnectorConfig config, ConnectorOptions options, ConnectorContext context)
      : ConnectorBase("p2p:" + options.mode, std::move(config), options, std::move(context)) {}

  ~P2pConnector() override {
    shutdown_base();
    producer_pool_.reset();
  }

  Status init() {
    ECX_RETURN_IF_ERROR(init_base(/*consumer_cache_remote_write=*/options().mode == "push"));
    if (is_producer()) {
      cache::PoolConfig pc;
      pc.name = options().engine_id;
      pc.capacity_bytes = options().pool_bytes;
      pc.lease = std::chrono::milliseconds(options().lease_ms);
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
    // The pin keeps the block in place until the consumer's RELEASE or the lease ends.
    ECX_ASSIGN_OR_RETURN(cache::Pin pin, producer_pool_->pin(mm_hash, "params"));
    EcTransferParams p;
    p.connector = "p2p";
    p.mode = options().mode;
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
    return p;
  }

  std::string agent_metadata() {
    std::lock_guard lock(meta_mu_);
    if (metadata_json_.empty()) metadata_json_ = agent()->metadata().to_json();
    return metadata_json_;
  }

  Result<std::string> handle_call(const std::string& peer, std::string_view body) {
    json req = json::parse(body, nullptr, false);
    if (req.is_discarded() || !req.is_object() || !req.contains("op") || !req["op"].is_string()) {
      return InvalidArgument(name() + ": request is not a JSON object with an 'op'");
    }
    try {
      std::string op = req["op"];
      if (op == "lookup") return handle_lookup(peer, req).dump();
      if (op == "load") return handle_load(peer, req);
      return InvalidArgument(name() + ": unknown op '" + op + "'");
    } catch (const json::exception& e) {
      return InvalidArgument(name() + ": malformed request: " + e.what());
    }
  }

  json handle_lookup(const std::string& peer, const json& req) {
    int64_t wait_ms = std::clamp<int64_t>(req.value("wait_ms", int64_t{0}), 0, kMaxLookupWaitMs);
    Deadline wait = Deadline::after_ms(wait_ms);
    json items = json::array();
    for (const auto& item : req.at("items")) {
      auto mm_hash = MmHash::parse(item.at("mm_hash").get<std::string>());
      Status s = mm_hash.ok() ? Status::Ok() : mm_hash.status();
      json out = {{"mm_hash", item.at("mm_hash")}};
      if (s.ok()) {
        auto ready = producer_pool_->wait_ready(*mm_hash, wait);
        if (ready.ok()) {
          auto pin = producer_pool_->pin(*mm_hash, peer);  // released by RELEASE or peer death
          if (pin.ok()) {
            out.update({{"region", pin->ref.region},
                        {"offset", pin->ref.offset},
                        {"length", pin->ref.block_length},
                        {"generation", pin->ref.generation},
                        {"pin", pin->pin_id}});
          }
          s = pin.ok() ? Status::Ok() : pin.status();
        } else {
          s = ready.status();
        }
      }
      out.update(status_json(s));
      items.push_back(out);
    }
    return {{"items", items}};
  }

  Result<std::string> handle_load(const std::string& peer, const json& req) {
    ECX_ASSIGN_OR_RETURN(auto consumer,
                         transfer::AgentMetadata::parse(req.at("consumer").get<std::string>()));
    if (consumer.name != peer)
      return InvalidArgument("load: consumer metadata names '" + consumer.name +
                             "', not the caller");
    ECX_ASSIGN_OR_RETURN(auto backend, transfer::parse_backend(req.value("backend", "auto")));
    ECX_RETURN_IF_ERROR(agent()->connect(consumer, {.backend = backend}).status());
    int64_t wait_ms = std::clamp<int64_t>(req.value("wait_ms", int64_t{0}), 0, kMaxLookupWaitMs);
    Deadline wait = Deadline::after_ms(wait_ms);
    std::vector<transfer::TransferDescriptor> descs;
    std::vector<uint64_t> temp_pins;
    json items = json::array();
    std::vector<size_t> moving;  // index into items of each descriptor
    for (const auto& item : req.at("items")) {
      json out = {{"mm_hash", item.at("mm_hash")}};
      auto mm_hash = MmHash::parse(item.at("mm_hash").get<std::string>());
      Status s = mm_hash.ok() ? Status::Ok() : mm_hash.status();
      std::optional<cache::Pin> pin;
      if (s.ok()) s = producer_pool_->wait_ready(*mm_hash, wait).status();
      if (s.ok()) {
        auto pinned = producer_pool_->pin(*mm_hash, "push:" + peer);
        if (pinned.ok()) {
          pin = *pinned;
        } else {
          s = pinned.status();
        }
      }
      if (s.ok()) {
        uint64_t want = item.value("generation", uint64_t{0});
        uint64_t dst_length = item.at("dst_length").get<uint64_t>();
        if (want != 0 && want != pin->ref.generation) {
          s = Status(StatusCode::kEvicted, "mm_hash " + mm_hash->str() + ": generation " +
                                               std::to_string(pin->ref.generation) +
                                               " != expected " + std::to_string(want) +
                                               " (evicted)");
        } else if (dst_length != pin->ref.block_length) {
          s = InvalidArgument("load: destination of " + std::to_string(dst_length) +
                              " bytes for a block of " + std::to_string(pin->ref.block_length));
        }
      }
      if (pin) temp_pins.push_back(pin->pin_id);
      if (s.ok()) {
        descs.push_back({pin->ref.block, item.at("dst_region").get<uint32_t>(),
                         item.at("dst_offset").get<uint64_t>(), pin->ref.block_length});
        moving.push_back(items.size());
        if (item.contains("pin")) producer_pool_->unpin(item["pin"].get<uint64_t>()).ignore_error();
      }
      out.update(status_json(s));
      items.push_back(out);
    }
    if (!descs.empty()) {
      auto handle = agent()->write(peer, descs);
      Status s = handle.ok() ? handle->wait(Deadline::after_ms(options().load_timeout_ms))
                             : handle.status();
      if (!s.ok()) {
        for (size_t i : moving) items[i].update(status_json(s));
      }
    }
    for (uint64_t p : temp_pins) producer_pool_->unpin(p).ignore_error();
    return json{{"items", items}}.dump();
  }

  void handle_notification(const transfer::Notification& n) {
    json msg = json::parse(n.message, nullptr, false);
    if (msg.is_discarded() || msg.value("op", "") != "release" || !msg.contains("pins") ||
        !msg["pins"].is_array()) {
      spdlog::warn("{}: ignored a malformed notification from {}", name(), n.from);
      return;
    }
    for (const auto& p : msg["pins"]) {
      if (p.is_number_unsigned()) {
        if (producer_pool_->unpin(p.get<uint64_t>()).ok()) releases_received_++;
      }
    }
  }

  // ---------------- consumer ----------------

  bool can_load(const LoadItem& item) override {
    return item.params && item.params->connector == "p2p" && !item.params->agent.empty();
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
      if (options().mode == "push") {
        fetch_push(producer, group, deadline);
      } else if (options().mode == "pull-2step") {
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
    known_producers_[params.engine_id] = params.agent;
    return Status::Ok();
  }

  // Asks the producer where the blocks are (and pins them for us). Retries not-ready
  // items, each retry waiting at the producer, until the deadline.
  void lookup(const std::string& producer, std::vector<FetchSlot*>& group,
              std::vector<Location>& where, Deadline deadline) {
    std::vector<size_t> pending;
    for (size_t i = 0; i < group.size(); ++i) pending.push_back(i);
    int64_t wait_ms = 0;
    while (!pending.empty()) {
      json items = json::array();
      for (size_t i : pending) items.push_back({{"mm_hash", group[i]->item->mm_hash.str()}});
      json req = {{"op", "lookup"}, {"items", items}, {"wait_ms", wait_ms}};
      auto reply = agent()->call(producer, req.dump(), deadline);
      if (!reply.ok()) {
        for (size_t i : pending) group[i]->status = reply.status();
        return;
      }
      json r = json::parse(*reply, nullptr, false);
      if (r.is_discarded() || !r.contains("items") || !r["items"].is_array() ||
          r["items"].size() != pending.size()) {
        for (size_t i : pending)
          group[i]->status = Internal("malformed lookup reply from " + producer);
        return;
      }
      std::vector<size_t> again;
      for (size_t k = 0; k < pending.size(); ++k) {
        const json& it = r["items"][k];
        Status s = status_from_json(it);
        FetchSlot* slot = group[pending[k]];
        if (s.code() == StatusCode::kNotReady && !deadline.expired()) {
          note_not_ready(slot->item->mm_hash);
          again.push_back(pending[k]);
          continue;
        }
        if (!s.ok()) {
          slot->status = s;
          continue;
        }
        Location& loc = where[pending[k]];
        loc.region = it.value("region", 0u);
        loc.offset = it.value("offset", uint64_t{0});
        loc.length = it.value("length", uint64_t{0});
        loc.generation = it.value("generation", uint64_t{0});
        loc.pin = it.value("pin", uint64_t{0});
        slot->status = Status::Ok();
      }
      pending.swap(again);
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
      wait_ms = std::min<int64_t>(left, kMaxLookupWaitMs);
    }
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
      } else {
        where[i] = {p.region, p.offset, p.length, p.generation, p.pin};
      }
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
      descs.push_back({slot->block.block, loc.region, loc.offset, loc.length});
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
        auto view = agent()->view(producer, loc.region, loc.offset, loc.length);
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
    // Release what we pinned at the producer (params pins and lookup pins), in one
    // message, whether the read worked or not.
    json pins = json::array();
    for (size_t i = 0; i < group.size(); ++i) {
      if (where[i].pin != 0) pins.push_back(where[i].pin);
      // pull-2step looked the item up again: the pin from E's params is released too.
      uint64_t params_pin = group[i]->item->params->pin;
      if (params_pin != 0 && params_pin != where[i].pin) pins.push_back(params_pin);
    }
    if (!pins.empty()) queue_release(producer, std::move(pins));
  }

  void fetch_push(const std::string& producer, std::vector<FetchSlot*>& all, Deadline deadline) {
    std::vector<FetchSlot*> group = all;
    int64_t wait_ms = 0;
    while (!group.empty()) {
      json items = json::array();
      for (FetchSlot* slot : group) {
        const auto& p = *slot->item->params;
        json it = {{"mm_hash", slot->item->mm_hash.str()},
                   {"dst_region", consumer_cache()->region_id()},
                   {"dst_offset", slot->block.offset},
                   {"dst_length", slot->block.block_length}};
        if (p.generation) it["generation"] = p.generation;
        if (p.pin) it["pin"] = p.pin;
        items.push_back(it);
      }
      json req = {{"op", "load"},
                  {"consumer", agent()->metadata().to_json()},
                  {"backend", std::string(transfer::backend_name(options().backend))},
                  {"wait_ms", wait_ms},
                  {"items", items}};
      auto reply = agent()->call(producer, req.dump(), deadline);
      if (!reply.ok()) {
        for (FetchSlot* s : group) s->status = reply.status();
        return;
      }
      json r = json::parse(*reply, nullptr, false);
      if (r.is_discarded() || !r.contains("items") || !r["items"].is_array() ||
          r["items"].size() != group.size()) {
        for (FetchSlot* s : group) s->status = Internal("malformed load reply from " + producer);
        return;
      }
      std::vector<FetchSlot*> again;
      for (size_t i = 0; i < group.size(); ++i) {
        FetchSlot* slot = group[i];
        Status s = status_from_json(r["items"][i]);
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
  void queue_release(const std::string& producer, json pins) {
    std::lock_guard lock(release_mu_);
    auto& q = pending_releases_[producer];
    for (auto& p : pins) q.push_back(p);
  }

  void after_load(const LoadRequest&, const std::vector<FetchSlot*>&) override {
    std::map<std::string, json> batch;
    {
      std::lock_guard lock(release_mu_);
      batch.swap(pending_releases_);
    }
    for (auto& [producer, pins] : batch) {
      Status s = agent()->notify(producer, json{{"op", "release"}, {"pins", pins}}.dump());
      if (s.ok()) releases_sent_ += pins.size();
    }
  }

  void add_stats(json& j) const override {
    j["releases_sent"] = releases_sent_.load();
    j["releases_received"] = releases_received_.load();
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
  std::map<std::string, json> pending_releases_;  // guarded by release_mu_
  std::atomic<uint64_t> releases_sent_{0}, releases_received_{0};
};

}  // namespace

Result<std::unique_ptr<EcConnector>> create_p2p_connector(ConnectorConfig config,
                                                          ConnectorOptions options,
                                                          ConnectorContext context) {
  return make_connector<P2pConnector>(std::move(config), std::move(options), std::move(context));
}

}  // namespace ecx::connector
