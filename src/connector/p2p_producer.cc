#include "connector/p2p_producer.h"

#include <map>

#include "connector/p2p_common.h"
#include "ecx/common/log.h"

namespace ecx::connector {

using p2p::kMaxLookupWaitMs;
using p2p::params_capability;

Status P2pProducer::start() {
  if (core_.is_producer()) {
    cache::PoolConfig pc;
    pc.name = options().engine_id;
    pc.capacity_bytes = options().pool_bytes;
    pc.lease = std::chrono::milliseconds(options().lease_ms);
    pc.max_pins_per_holder = static_cast<size_t>(options().max_pins_per_holder);
    pc.require_grant = options().require_grants;  // peers read only what they were handed
    ECX_ASSIGN_OR_RETURN(pool_, cache::EncoderCachePool::create(agent(), pc));
    served_ = pool_.get();
  } else {
    // A consumer answers for the blocks its share_loaded handed to readers (the workers
    // of its instance): a reader that views one pins it for itself (lookup) and keeps it
    // (renew), as it would at a producer.
    served_ = core_.consumer_cache();
  }
  if (served_ == nullptr) return Status::Ok();
  agent()->set_call_handler([this](const transfer::Caller& caller, std::string_view body) {
    return handle_call(caller, body);
  });
  // Pins are held by the caller's authenticated identity, so only its own end here.
  agent()->set_peer_gone_handler([this](const std::string& holder) {
    size_t n = served_->release_holder(holder);
    if (n) spdlog::info("{}: consumer {} went away, released {} pins", name(), holder, n);
  });
  return Status::Ok();
}

Status P2pProducer::release_params(const EcTransferParams& p) {
  if (p.connector != "p2p" || p.engine_id != options().engine_id) {
    return InvalidArgument("ec_transfer_params for " + p.mm_hash.str() + " are from '" +
                           p.engine_id + "', not this encoder ('" + options().engine_id + "')");
  }
  ECX_RETURN_IF_ERROR(p.verify(options().auth_secret));
  if (p.pin == 0) return Status::Ok();
  ECX_ASSIGN_OR_RETURN(transfer::Capability cap, params_capability(p));
  // A pin already ended (read and released, or expired) needs nothing more.
  if (pool_->release_granted(p.pin, cap).ok()) releases_received_++;
  return Status::Ok();
}

// An entry that is already cached is not written again: E can skip the encoder.
Result<EcTransferParams> P2pProducer::params_for(const MmHash& mm_hash,
                                                 const std::string& quota_holder) {
  // The pin keeps the block in place until the consumer's RELEASE or the lease ends;
  // its capability is the only way in for whoever the proxy hands the params to.
  ECX_ASSIGN_OR_RETURN(cache::Pin pin, quota_holder.empty()
                                           ? pool_->pin_for_peer(mm_hash, "")
                                           : pool_->pin_for_bearer(mm_hash, quota_holder));
  return core_.located_params(pin);
}

Result<std::string> P2pProducer::handle_call(const transfer::Caller& caller,
                                             std::string_view body) {
  auto request = parse_control_request(body);
  if (!request.ok()) return request.status().with_context(name() + " from " + caller.name);
  try {  // nothing below throws by design; this keeps a bug from killing the server thread
    if (auto* lookup = std::get_if<LookupRequest>(&*request)) {
      return to_json(handle_lookup(caller, *lookup));
    }
    if (auto* renew = std::get_if<RenewRequest>(&*request))
      return to_json(handle_renew(caller, *renew));
    if (pool_ == nullptr) {  // a consumer serves lookups and renewals of its cache only
      return Status(StatusCode::kFailedPrecondition,
                    name() + " is a consumer: it hands out no params and writes no blocks");
    }
    if (auto* params = std::get_if<ParamsRequest>(&*request))
      return to_json(handle_params(caller, *params));
    return handle_load(caller, std::get<LoadBlocksRequest>(*request));
  } catch (const std::exception& e) {
    return Internal(name() + ": request from " + caller.name + " failed: " + e.what());
  }
}

// The entry a consumer asks for, pinned for that consumer alone. With a capability, the
// consumer proves it was handed the entry (the params' pin must still be live); without
// one it is a lookup by key: knowing the mm_hash (a SHA-256 of the image) is the proof,
// and only authenticated agents of the deployment get this far.
Result<cache::Pin> P2pProducer::entry_for(const transfer::Caller& caller, const MmHash& mm_hash,
                                          const transfer::Capability& capability, Deadline wait) {
  if (!capability.empty()) {
    ECX_RETURN_IF_ERROR(served_->pin_of_capability(mm_hash, capability).status());
  } else if (pool_ == nullptr) {
    return PermissionDenied(name() +
                            " is a consumer: its cache is read only with the "
                            "capability share_loaded handed out, not looked up by key");
  }
  ECX_RETURN_IF_ERROR(served_->wait_ready(mm_hash, wait).status());
  return served_->pin_for_peer(mm_hash, caller.holder);  // ends by RELEASE or death
}

ItemsReply P2pProducer::handle_lookup(const transfer::Caller& caller, const LookupRequest& req) {
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
Result<std::string> P2pProducer::handle_load(const transfer::Caller& caller,
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
  for (uint64_t pin : our_pins) pool_->unpin(pin).ignore_error();
  for (const auto& item : req.items) {
    if (item.pin != 0) pool_->release_granted(item.pin, item.capability).ignore_error();
  }
  return to_json(reply);
}

// A RELEASE for a pin of our pool: only with the capability it was granted with, so
// nobody ends another reader's pin.
bool P2pProducer::release_granted(uint64_t pin, const transfer::Capability& capability) {
  if (!pool_ || !pool_->release_granted(pin, capability).ok()) return false;
  releases_received_++;
  return true;
}

// The params pins a caller holds count against a quota of its own (the params' 16 x
// max_pins_per_holder), not against those E issues itself, so no caller can keep E, or
// another caller, from params; an item asked for twice in one call is pinned once, and
// both answers carry that pin.
ItemsReply P2pProducer::handle_params(const transfer::Caller& caller, const ParamsRequest& req) {
  Deadline wait = Deadline::after_ms(std::min<int64_t>(req.wait_ms, kMaxLookupWaitMs));
  const std::string quota_holder = cache::EncoderCachePool::params_quota_holder(caller.holder);
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
    out.status = pool_->wait_ready(mm_hash, wait).status();
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
ItemsReply P2pProducer::handle_renew(const transfer::Caller& caller, const RenewRequest& req) {
  ItemsReply reply;
  for (const auto& item : req.items) {
    ItemReply out{.mm_hash = item.mm_hash};
    auto pin = served_->pin_of_capability(item.mm_hash, item.capability);
    if (pin.ok() && pin->pin_id != item.pin) {
      out.status = NotFound("pin " + std::to_string(item.pin) + " of " + item.mm_hash.str() +
                            ": not held with that capability");
    } else if (!pin.ok()) {
      out.status = pin.status();
    } else {
      out.status = served_->renew_granted(item.pin, item.capability, caller.holder);
      if (out.status.ok()) renewals_received_++;
    }
    reply.items.push_back(std::move(out));
  }
  return reply;
}
Result<SaveSlot> P2pProducer::begin_save(const MmHash& mm_hash, const TensorMeta& meta) {
  auto ref = pool_->reserve(mm_hash, meta, Deadline::after_ms(options().save_wait_ms));
  if (!ref.ok()) return ref.status();
  return SaveSlot{mm_hash, meta, {ref->payload(), meta.byte_size()}, ref->generation};
}

Result<EcTransferParams> P2pProducer::commit_save(const SaveSlot& slot) {
  ECX_RETURN_IF_ERROR(pool_->commit(slot.mm_hash, slot.token));
  return params_for(slot.mm_hash);
}

Result<EcTransferParams> P2pProducer::saved_params(const MmHash& mm_hash) {
  // Another request may be encoding this very item: wait for it rather than fail.
  ECX_RETURN_IF_ERROR(
      pool_->wait_ready(mm_hash, Deadline::after_ms(options().load_timeout_ms)).status());
  return params_for(mm_hash);
}

void P2pProducer::abort_save(const SaveSlot& slot) { pool_->abort(slot.mm_hash, slot.token); }

Status P2pProducer::wait_for_readers(Deadline deadline) { return pool_->wait_unpinned(deadline); }

bool P2pProducer::holds(const MmHash& mm_hash) { return pool_ && pool_->find(mm_hash).ok(); }

void P2pProducer::add_stats(ConnectorStats& s) const {
  s.releases_received = releases_received_.load();
  s.renewals_received = renewals_received_.load();
  if (pool_) s.producer_pool = pool_->stats();
}

}  // namespace ecx::connector
