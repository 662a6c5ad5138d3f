// What every EcConnector does the same way on top of its virtual methods.
#include "ecx/connector/ec_connector.h"

#include <cstring>

namespace ecx::connector {

Result<EcTransferParams> EcConnector::save_caches(const MmHash& mm_hash, const TensorMeta& meta,
                                                  std::span<const std::byte> payload) {
  ECX_RETURN_IF_ERROR(meta.validate());
  if (payload.size() != meta.byte_size()) {
    return InvalidArgument("save_caches: " + std::to_string(payload.size()) + " bytes for " +
                           meta.to_string());
  }
  auto begun = begin_save(mm_hash, meta);
  if (!begun.ok() && begun.status().code() == StatusCode::kAlreadyExists)
    return saved_params(mm_hash);
  ECX_ASSIGN_OR_RETURN(SaveSlot slot, std::move(begun));
  if (!payload.empty()) std::memcpy(slot.payload.data(), payload.data(), payload.size());
  return commit_save(slot);
}

LoadOutcome EcConnector::load(const LoadRequest& request, Deadline deadline) {
  // One request on its own, not through the shared per-step scheduler state: safe to
  // call from many threads at once.
  ConnectorMetadata meta;
  meta.loads.push_back({request, {}});
  // The load gives up by the earlier of the connector's load timeout and this deadline.
  auto& own = meta.loads[0].request.deadline;
  own = own ? Deadline::earliest(*own, deadline) : deadline;
  for (size_t i = 0; i < request.items.size(); ++i) meta.loads[0].items.push_back(i);
  Status started = start_load_caches(meta);
  if (!started.ok()) {
    LoadOutcome out;
    out.status = started;
    return out;
  }
  return wait_for_load(request.request_id, deadline);
}

}  // namespace ecx::connector
