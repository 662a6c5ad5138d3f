// The ucx backend's per-peer data path (see transfer/ucx_backend.h): one endpoint to the
// peer's worker, the peer's remote keys, and the batches posted on it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ecx/common/mutex.h"
#include "transfer/data_path.h"
#include "transfer/ucx_worker.h"

namespace ecx::transfer {

// A peer region's key as the peer packed it: where the region is, how long, and the
// packed rkey (unpacked per endpoint).
struct UcxRemoteKey {
  uint64_t address = 0;
  uint64_t length = 0;
  bool writable = false;
  std::string packed;
};
// Parses a region's ucx data as UcxEngine::register_region spells it (hex of address |
// packed rkey).
Result<UcxRemoteKey> parse_ucx_key(std::string_view hex, uint64_t length, bool writable);

class UcxDataPath final : public DataPath, public std::enable_shared_from_this<UcxDataPath> {
 public:
  UcxDataPath(std::shared_ptr<UcxWorker> worker, PeerLink link, std::string peer_address,
              ucp_err_handling_mode_t mode);
  ~UcxDataPath() override;

  std::shared_ptr<TransferState> submit(std::span<const TransferDescriptor> descriptors, bool write,
                                        Deadline deadline, std::string description,
                                        TransferFinalizer finalizer) override ECX_EXCLUDES(mu_);
  void fail_all(const Status& reason) override ECX_EXCLUDES(mu_);
  Backend kind() const override { return Backend::kUcx; }

  // UCX reported the endpoint broken (peer error mode): it is closed and reopened for
  // the next batch.
  void endpoint_failed(ucp_ep_h ep, ucs_status_t status) ECX_EXCLUDES(mu_);

  // An endpoint to the peer and the rkeys unpacked on it (ucx_data_path.cc).
  struct Endpoint;

 private:
  Status post(const std::shared_ptr<UcxBatch>& batch,
              std::span<const TransferDescriptor> descriptors, bool write, Deadline deadline)
      ECX_EXCLUDES(mu_);
  Status arm_abort(const std::shared_ptr<UcxBatch>& batch, const std::shared_ptr<Endpoint>& ep,
                   Deadline deadline) ECX_EXCLUDES(mu_);
  void issue(const std::shared_ptr<UcxBatch>& batch, Endpoint& ep,
             std::span<const TransferDescriptor> descriptors,
             const std::vector<std::shared_ptr<const UcxRemoteKey>>& keys,
             const std::vector<ucp_rkey_h>& rkeys, bool write);
  // The keys of every region the batch names, asking the peer for those it lacks.
  Result<std::vector<std::shared_ptr<const UcxRemoteKey>>> resolve(
      std::span<const TransferDescriptor> descriptors, bool write, Deadline deadline);
  Result<std::shared_ptr<const UcxRemoteKey>> key_for(const TransferDescriptor& d,
                                                      Deadline deadline) ECX_EXCLUDES(mu_);
  Result<std::shared_ptr<Endpoint>> endpoint() ECX_EXCLUDES(mu_);
  Result<ucp_rkey_h> rkey_for(Endpoint& ep, uint32_t region, const UcxRemoteKey& key);
  // Makes `ep` no longer current, and force-closes it (purging its requests) on the
  // progress thread.
  void reset_endpoint(const std::shared_ptr<Endpoint>& ep) ECX_EXCLUDES(mu_);

  const std::shared_ptr<UcxWorker> worker_;
  const std::shared_ptr<ControlChannel> control_;
  StatsCounters* const stats_;
  const std::string peer_;
  const std::string peer_address_;  // the peer's worker address (bytes)
  const ucp_err_handling_mode_t mode_;

  Mutex mu_;
  std::shared_ptr<Endpoint> ep_ ECX_GUARDED_BY(mu_);
  std::vector<std::weak_ptr<UcxBatch>> inflight_ ECX_GUARDED_BY(mu_);  // error mode none only
  std::map<uint32_t, std::shared_ptr<const UcxRemoteKey>> keys_ ECX_GUARDED_BY(mu_);
  Status failed_ ECX_GUARDED_BY(mu_);
};

}  // namespace ecx::transfer
