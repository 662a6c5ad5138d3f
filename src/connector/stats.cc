// ConnectorStats and PoolStats as JSON: what `ecx bench` peers print and tests read
// across processes. In-process code reads the structs.
#include "ecx/connector/ec_connector.h"

namespace ecx::connector {

using nlohmann::json;

json to_json(const cache::PoolStats& s) {
  return {{"capacity_bytes", s.capacity_bytes},
          {"used_bytes", s.used_bytes},
          {"payload_bytes", s.payload_bytes},
          {"entries", s.entries},
          {"writing_entries", s.writing_entries},
          {"pinned_entries", s.pinned_entries},
          {"pins", s.pins},
          {"evictions", s.evictions},
          {"lease_expiries", s.lease_expiries},
          {"hits", s.hits},
          {"misses", s.misses},
          {"bytes_used_per_payload_byte", s.bytes_used_per_payload_byte}};
}

json to_json(const ConnectorStats& s) {
  json j = {{"connector", s.connector},
            {"engine_id", s.engine_id},
            {"role", std::string(role_name(s.role))},
            {"saves", s.saves},
            {"loads_ok", s.loads_ok},
            {"loads_failed", s.loads_failed},
            {"items_loaded", s.items_loaded},
            {"items_recomputed", s.items_recomputed},
            {"local_hits", s.local_hits},
            {"bytes_loaded", s.bytes_loaded},
            {"load_seconds_total", s.load_seconds_total},
            {"not_ready_retries", s.not_ready_retries},
            {"nacks", s.nacks},
            {"releases_sent", s.releases_sent},
            {"releases_received", s.releases_received},
            {"views_held", s.views_held},
            {"items_viewed", s.items_viewed},
            {"view_renewals_failed", s.view_renewals_failed},
            {"renewals_received", s.renewals_received},
            {"params_rejected", s.params_rejected},
            {"offers_sent", s.offers_sent},
            {"offers_failed", s.offers_failed},
            {"items_offered", s.items_offered},
            {"offered_refused", s.offered_refused},
            {"transfer_connects", s.transfer_connects},
            {"peer_failures", s.peer_failures}};
  for (const auto& [op, h] : s.transfer_seconds) {
    if (h.count == 0) continue;
    j["transfer_seconds"][op] = {{"bounds", h.bounds},
                                 {"cumulative", h.cumulative},
                                 {"sum", h.sum_seconds},
                                 {"count", h.count}};
  }
  if (s.consumer_cache) j["consumer_cache"] = to_json(*s.consumer_cache);
  if (s.producer_pool) j["producer_pool"] = to_json(*s.producer_pool);
  if (s.disk) {
    j.update({{"root", s.disk->root},
              {"bytes_on_disk", s.disk->bytes_on_disk},
              {"files_evicted", s.disk->files_evicted},
              {"files_expired", s.disk->files_expired},
              {"files_released", s.disk->files_released}});
  }
  return j;
}

}  // namespace ecx::connector
