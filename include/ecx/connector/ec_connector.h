// EcConnector: moves encoder caches from producers (E) to consumers (PD), with vLLM's
// EC connector semantics. One instance per process and role; thread-safe.
//
// Producer (E), worker side:
//   begin_save / commit_save (zero-copy: the encoder writes into the returned span)
//   or save_caches (copying) -> EcTransferParams for the response.
// Consumer (PD), scheduler side:
//   has_caches(request)            which items can be loaded instead of encoded
//   update_state_after_alloc(r, i) item i's destination exists: schedule its load
//   build_connector_meta()         the loads scheduled this step
// Consumer, worker side:
//   start_load_caches(meta)        starts them (asynchronously)
//   wait_for_load(id, deadline)    the outcome of one request's loads
//   get_finished()                 requests whose loads ended since the last call
//   loaded(id, mm_hash)            the loaded bytes (valid until request_finished)
//   item_finished(id, mm_hash)     release one item of it early
//   request_finished(id)           release what the request held
// When the two sides are different processes (vLLM's scheduler and its workers), they
// talk through their agents: remote_saved_params (a producer's scheduler asks its worker
// for params) and share_loaded (a consumer's scheduler lets its workers read its loads).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/connector/ec_transfer_params.h"

namespace ecx::connector {

enum class Role { kProducer, kConsumer, kBoth };
Result<Role> parse_role(std::string_view name);  // "producer", "consumer", "both"
std::string_view role_name(Role role);

// What the consumer does when an item cannot be loaded.
enum class FailurePolicy { kRecompute, kFail };

// The whole connector configuration, as one JSON object (vLLM's --ec-transfer-config):
//   {"connector":"p2p","role":"consumer","extra":{"mode":"pull", ...}}
struct ConnectorConfig {
  std::string connector = "p2p";
  Role role = Role::kBoth;
  nlohmann::json extra = nlohmann::json::object();

  static Result<ConnectorConfig> parse(std::string_view json);
  // From a CLI name: "p2p" (= pull), "p2p:push", "p2p:pull-2step", "disk", "store", "local".
  static Result<ConnectorConfig> from_name(std::string_view name, Role role);
  nlohmann::json to_json() const;
};

struct LoadItem {
  MmHash mm_hash;
  TensorMeta meta;
  std::optional<EcTransferParams> params;  // from E's response, when there is one
  // When the params' pin was taken for this reader alone: a worker's own scheduler shared
  // the item with it (share_loaded), on this host's steady clock. A same-host view then
  // holds that pin as its own, renewed and given back at its end, and takes none by a
  // lookup (one round trip less), provided the pin is less than lease_ms / 3 old (its
  // lease outlasts the view's first renewal); the block's header is checked all the same.
  std::optional<Clock::time_point> own_pin_taken;
};

struct LoadRequest {
  std::string request_id;
  std::vector<LoadItem> items;
  // The request's own deadline: loads end by the earlier of it and load_timeout_ms.
  std::optional<Deadline> deadline;
};

// Per-step scheduler output: which items of which requests to load.
struct ConnectorMetadata {
  struct Entry {
    LoadRequest request;
    std::vector<size_t> items;  // indices into request.items
  };
  std::vector<Entry> loads;
};

struct ItemOutcome {
  MmHash mm_hash;
  Status status;
  bool recomputed = false;  // encoded locally after the load failed
  bool local_hit = false;   // already in this consumer's cache
  double recompute_ms = 0;  // time spent encoding it locally (this request only)
};

struct LoadOutcome {
  Status status;  // ok, or the first unrecoverable item error (with its NACK code)
  std::vector<ItemOutcome> items;
  double load_ms = 0;
  uint64_t bytes = 0;
};

// Encodes one item locally into `out` (exactly meta.byte_size() bytes).
using RecomputeFn = std::function<Status(const MmHash&, const TensorMeta&, std::span<std::byte>)>;
// Called when an item is found not ready, before the connector retries (observability).
using NotReadyFn = std::function<void(const MmHash&)>;

struct ConnectorContext {
  RecomputeFn recompute;  // set on instances that can encode
  NotReadyFn on_not_ready;
};

// A connector's counters and pool figures: for /metrics, tests and benchmarks. Rendered
// to JSON (to_json) or Prometheus only at the edge.
struct ConnectorStats {
  std::string connector;  // "p2p:pull", "disk", ...
  std::string engine_id;
  Role role = Role::kBoth;
  uint64_t saves = 0;
  uint64_t loads_ok = 0;
  uint64_t loads_failed = 0;
  uint64_t items_loaded = 0;
  uint64_t items_recomputed = 0;
  uint64_t local_hits = 0;  // items already in the consumer cache
  uint64_t bytes_loaded = 0;
  uint64_t not_ready_retries = 0;
  double load_seconds_total = 0;
  std::map<std::string, uint64_t> nacks;  // failed item loads by status code name
  // Producer pins given back by this consumer, and received back by this producer.
  uint64_t releases_sent = 0;
  uint64_t releases_received = 0;
  // zero_copy: views this consumer holds now, items it loaded as views, and renewals a
  // producer refused (the view was dropped); renewals this producer granted.
  uint64_t views_held = 0;
  uint64_t items_viewed = 0;  // loads that were zero-copy views (of items_loaded)
  uint64_t view_renewals_failed = 0;
  uint64_t renewals_received = 0;
  // ec_transfer_params ignored: unsigned, not signed by this deployment, or not the item's.
  uint64_t params_rejected = 0;
  // Offers (EcConnector::offer): sent by this side and not delivered (an unreachable
  // consumer, a full queue); items this consumer was offered and loaded ahead of their
  // requests, and items it refused (untrusted params, too many offered loads at once).
  uint64_t offers_sent = 0;
  uint64_t offers_failed = 0;
  uint64_t items_offered = 0;
  uint64_t offered_refused = 0;
  // p2p: connections this side's agent opened to peers, by backend ("shm", "tcp", "ucx").
  std::map<std::string, uint64_t> transfer_connects;
  // p2p: peers that died while connected to this side's agent (their process ended or
  // their connection broke).
  uint64_t peer_failures = 0;
  // The agent's batches, by direction ("read", "write"): seconds from submission to end.
  std::map<std::string, transfer::LatencyHistogram> transfer_seconds;
  std::optional<cache::PoolStats> consumer_cache;  // consumers
  std::optional<cache::PoolStats> producer_pool;   // p2p producers
  struct Disk {
    std::string root;
    uint64_t bytes_on_disk = 0;
    uint64_t files_evicted = 0;
    uint64_t files_expired = 0;
    uint64_t files_released = 0;
  };
  std::optional<Disk> disk;  // the disk connector
};
nlohmann::json to_json(const ConnectorStats& stats);
nlohmann::json to_json(const cache::PoolStats& stats);

// A block reserved by begin_save, written by the caller, published by commit_save.
struct SaveSlot {
  MmHash mm_hash;
  TensorMeta meta;
  std::span<std::byte> payload;
  uint64_t token = 0;  // connector-private
};

class EcConnector {
 public:
  virtual ~EcConnector() = default;

  virtual const std::string& name() const = 0;  // "p2p:pull", "disk", ...
  virtual Role role() const = 0;
  virtual const std::string& compat_hash() const = 0;
  virtual FailurePolicy failure_policy() const = 0;

  // ---- producer ----
  virtual Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) = 0;
  virtual Result<EcTransferParams> commit_save(const SaveSlot& slot) = 0;
  // Params for an item this producer already holds (so E can skip the encoder), or
  // kNotFound.
  virtual Result<EcTransferParams> saved_params(const MmHash& mm_hash) = 0;
  // Whether this producer holds a ready entry for mm_hash (no pin is taken).
  virtual bool holds(const MmHash&) { return false; }
  // Discards a slot from begin_save that will not be committed (the encoder failed).
  virtual void abort_save(const SaveSlot& slot) = 0;
  // Waits until no consumer holds a pin on this producer's items (RELEASEd or leases
  // expired): what a graceful shutdown of E waits for. Ok at once where nothing pins.
  virtual Status wait_for_readers(Deadline deadline) = 0;
  // Ends the pin `params` (issued by this producer) hold, for a request that will not
  // load them: what the proxy calls when a request is abandoned between E and PD. Checks
  // that this deployment signed them; ok where nothing is pinned.
  virtual Status release_params(const EcTransferParams& params) = 0;
  Result<EcTransferParams> save_caches(const MmHash& mm_hash, const TensorMeta& meta,
                                       std::span<const std::byte> payload);

  // ---- a producer in another process (vLLM's EngineCore asking its worker) ----
  // One CALL to the p2p producer whose agent metadata (JSON) is `producer`: the params of
  // the items it holds, as saved_params gives them there (pinned for whoever is handed
  // them, signed). Per item: the params, or the producer's status for it (kNotFound when
  // it does not hold it). The call's own failure (unreachable, deadline) is the Result's.
  // p2p connectors only: kFailedPrecondition elsewhere.
  virtual Result<std::vector<Result<EcTransferParams>>> remote_saved_params(
      const std::string& /*producer*/, const std::vector<MmHash>& /*hashes*/, Deadline) {
    return Status(StatusCode::kFailedPrecondition, "remote_saved_params: not a p2p connector");
  }

  // ---- telling a consumer early ----
  // Sends `params` (signed params this deployment's producers issued for one request's
  // items) to the consumer agent at `address` ("host:port" or "tcp://host:port", its tcp
  // endpoint), which starts loading them into its cache at once, before the request that
  // uses them reaches it (its load then finds them there and gives their pins back).
  // Returns once queued: sent from a thread of this connector, never the caller's; an
  // offer that cannot be delivered costs the consumer its early start, nothing else
  // (stats: offers_sent, offers_failed). Only to an address of the offer_to option
  // (kPermissionDenied otherwise: nothing is dialed); kInvalidArgument for a malformed
  // address; kResourceExhausted when the queue is full; kFailedPrecondition for a
  // connector without an agent.
  virtual Status offer(const std::string& /*address*/,
                       const std::vector<EcTransferParams>& /*params*/) {
    return Status(StatusCode::kFailedPrecondition, "offer: not a p2p connector");
  }

  // ---- consumer, scheduler side ----
  virtual std::vector<bool> has_caches(const LoadRequest& request) = 0;
  virtual Status update_state_after_alloc(const LoadRequest& request, size_t index) = 0;
  virtual ConnectorMetadata build_connector_meta() = 0;

  // ---- consumer, worker side ----
  virtual Status start_load_caches(const ConnectorMetadata& metadata) = 0;
  // The outcome of request_id's load, once it ended; by `deadline` at the latest (then
  // kDeadlineExceeded and no items: the load goes on). Returns by `deadline` whatever the
  // load does.
  virtual LoadOutcome wait_for_load(const std::string& request_id, Deadline deadline) = 0;
  virtual std::vector<std::string> get_finished() = 0;
  // With zero_copy, an item read where it lies is a read-only view of its producer's
  // block (writing to it faults), held until request_finished.
  virtual Result<cache::BlockRef> loaded(const std::string& request_id, const MmHash& mm_hash) = 0;
  // Whether request_id still reads mm_hash where it lies: Ok while the view's pins hold (no
  // renewal was refused) and its block's header is still the item's; kEvicted once it is
  // not (its bytes may be another item's: stop reading them). kFailedPrecondition when the
  // request holds the item as a copy of its own, or has no such load.
  virtual Status view_intact(const std::string& /*request_id*/, const MmHash& /*mm_hash*/) {
    return Status(StatusCode::kFailedPrecondition, "view_intact: this connector has no views");
  }
  // Lets `readers` other agents of this deployment READ a loaded item from this consumer's
  // cache (vLLM's scheduler hands its loads to its workers, which are other processes):
  // per reader, signed p2p params of the block, each with its own pin (lease_ms) and
  // capability, which that reader's load gives back. The request's own pin keeps the
  // entry meanwhile. kFailedPrecondition unless request_id's load ended with the item
  // loaded, or for a connector without an agent. An item the request holds as a
  // zero-copy view is shared as its producer's block itself (params without a pin: this
  // request's pins hold it), so the readers read from the producer.
  virtual Result<std::vector<EcTransferParams>> share_loaded(const std::string& /*request_id*/,
                                                             const MmHash& /*mm_hash*/,
                                                             size_t /*readers*/) {
    return Status(StatusCode::kFailedPrecondition, "share_loaded: not supported by this connector");
  }
  // Ends request_id's hold on one item before the request ends: its view's pins at the
  // producer (copied into the consumer cache first, with keep_loaded), or its consumer
  // cache pins. The request's other items stay held until request_finished. What holds
  // items of one load for different lengths of time (vLLM's encoder cache, each entry
  // freed on its own) loads them in one request and ends each with this.
  // kFailedPrecondition for a request with no finished load, or one not holding mm_hash.
  virtual Status item_finished(const std::string& /*request_id*/, const MmHash& /*mm_hash*/) {
    return Status(StatusCode::kFailedPrecondition,
                  "item_finished: this connector ends holds per request only");
  }
  virtual void request_finished(const std::string& request_id) = 0;
  // `request` will not be loaded (it failed before its load started): gives back what
  // its items' params hold at producers, off the critical path.
  virtual void discard(const LoadRequest& request) = 0;

  // has_caches + update_state_after_alloc for every loadable item + build + start + wait,
  // in effect; an implementation may run it on the calling thread.
  virtual LoadOutcome load(const LoadRequest& request, Deadline deadline);

  // Counters and pool figures, for /metrics and tests.
  virtual ConnectorStats stats() const = 0;
  // This connector's agent metadata (JSON; empty without an agent): what a peer of the
  // same deployment connects with, e.g. as remote_saved_params's `producer`.
  virtual std::string agent_metadata() const { return {}; }
};

// Creates a connector by name ("p2p", "disk", "store", "local").
Result<std::unique_ptr<EcConnector>> create_connector(const ConnectorConfig& config,
                                                      ConnectorContext context = {});

}  // namespace ecx::connector
