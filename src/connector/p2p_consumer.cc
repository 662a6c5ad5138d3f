#include "connector/p2p_consumer.h"

#include <numeric>
#include <set>

#include "connector/p2p_common.h"
#include "connector/p2p_fetch.h"
#include "ecx/common/log.h"

namespace ecx::connector {
namespace {

// Longest one connect attempt to a producer waits for its handshake before dialling again.
constexpr int64_t kConnectAttemptMs = 2500;
// Longest a consumer spends connecting to a producer only to give its pins back.
constexpr int64_t kReleaseConnectMs = 2000;

// Pins one RELEASE notice carries at most (a coalesced batch is split beyond it).
constexpr size_t kMaxPinsPerNotice = 256;

// Producers remembered by the consumer (engine id -> metadata) before the map is reset.
constexpr size_t kMaxKnownProducers = 1024;

std::unique_ptr<FetchMode> copying_mode(P2pMode mode, P2pConsumer& consumer) {
  switch (mode) {
    case P2pMode::kPush:
      return make_push(consumer);
    case P2pMode::kPull2Step:
      return make_pull(consumer, /*two_step=*/true);
    case P2pMode::kPull:
      break;
  }
  return make_pull(consumer, /*two_step=*/false);
}

}  // namespace

using p2p::lookup_wait_ms;
using p2p::params_capability;

P2pConsumer::P2pConsumer(ConnectorCore& core)
    : core_(core),
      fetches_(copying_mode(core.options().mode, *this)),
      views_(core.options().mode == P2pMode::kPull ? make_view(*this) : nullptr) {}

P2pConsumer::~P2pConsumer() = default;

// Only params an encoder of this deployment issued, for this very item: anything else (a
// client's forgery, a mix-up) is ignored, and the item is computed here.
Status P2pConsumer::trust(const LoadItem& item) const {
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

bool P2pConsumer::can_load(const LoadItem& item) {
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
void P2pConsumer::per_producer(
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

void P2pConsumer::fetch(std::vector<FetchSlot*>& slots, Deadline deadline) {
  per_producer(slots, deadline, [&](const std::string& producer, std::vector<FetchSlot*>& group) {
    fetches_->fetch(producer, group, deadline);
  });
}

// zero_copy: pull views what it can where it lies; push and 2-step copy what they move.
void P2pConsumer::view(std::vector<FetchSlot*>& slots, Deadline deadline) {
  if (!views_) return;
  per_producer(slots, deadline, [&](const std::string& producer, std::vector<FetchSlot*>& group) {
    views_->fetch(producer, group, deadline);
  });
}

Status P2pConsumer::connect_producer(const EcTransferParams& params, Deadline deadline) {
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
void P2pConsumer::call_until_ready(const std::string& producer,
                                   const std::vector<FetchSlot*>& group, Deadline deadline,
                                   const char* what, const Exchange& exchange,
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
void P2pConsumer::lookup(const std::string& producer, std::vector<FetchSlot*>& group,
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
std::vector<BlockLocation> P2pConsumer::locate(const std::string& producer,
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
std::vector<Status> P2pConsumer::renew_pins(const std::string& producer,
                                            const std::vector<const FetchSlot*>& group,
                                            Deadline deadline) {
  // Each view's own pin first (its answer is the view's; a view held by the params' pin
  // alone, LoadItem::own_pin_taken, has that one), then the params' pins the views' requests
  // hold too: no pin of a live view ends by lease.
  RenewRequest req;
  for (const FetchSlot* slot : group) {
    ReleasedPin pin = slot->producer_pin;
    if (pin.pin == 0) {
      const auto& p = *slot->item->params;
      auto cap = params_capability(p);
      if (cap.ok()) pin = {p.pin, *cap};
    }
    req.items.push_back({slot->item->mm_hash, pin.pin, pin.capability});
  }
  for (const FetchSlot* slot : group) {
    if (slot->producer_pin.pin == 0) continue;  // its params' pin is its own, above
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
std::vector<Status> P2pConsumer::renew(std::span<const FetchSlot* const> views, Deadline deadline) {
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
// The pins `load` holds at producers: each trusted item's params pin (unless the
// producer ended it itself), and the pins lookups took.
void P2pConsumer::collect_pins(const FinishedLoad& load, PinsByProducer& by_producer,
                               std::map<std::string, const EcTransferParams*>& params_of) const {
  std::set<const LoadItem*> kept;   // ended by the producer, or (at the load's end) viewed
  std::set<const LoadItem*> views;  // of a views release: only these items
  for (const auto& slot : *load.slots) {
    if (slot.params_pin_released || slot.params_pin_left || (slot.viewed && !load.views))
      kept.insert(slot.item);
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
void P2pConsumer::release(std::span<const FinishedLoad> loads) {
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

void P2pConsumer::add_stats(ConnectorStats& s) const {
  s.releases_sent = releases_sent_.load();
  s.params_rejected = params_rejected_.load();
}

}  // namespace ecx::connector
