// The Agent as Python sees it: an ecx Agent plus the local regions it may address by
// (region, offset), each bounds-checked before a descriptor is built, and the Python
// objects whose memory it registered (kept alive until deregistered).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ecx/common/mutex.h"
#include "ecx/transfer/agent.h"
#include "python/bindings.h"

namespace ecx::python {

struct PyRegion {
  uint32_t id = 0;
  uint64_t length = 0;
};

// (local_region, local_offset, remote_region, remote_offset, length, capability_hex)
using DescriptorTuple = std::tuple<uint32_t, uint64_t, uint32_t, uint64_t, uint64_t, std::string>;

class PyAgent {
 public:
  explicit PyAgent(transfer::AgentConfig config);
  ~PyAgent();

  transfer::Agent& agent() const { return *agent_; }

  PyRegion allocate(uint64_t length, bool remote_write, bool require_grant) ECX_EXCLUDES(mu_);
  PyRegion register_memory(nb::ndarray<nb::c_contig> array, bool remote_write) ECX_EXCLUDES(mu_);
  void deregister(uint32_t region) ECX_EXCLUDES(mu_);
  // The region's bytes without a copy; deregister() raises while any such array lives.
  ByteArray buffer(uint32_t region, nb::handle self) ECX_EXCLUDES(mu_);
  std::string connect(const std::string& metadata, const std::string& backend,
                      std::optional<int64_t> timeout_ms);
  transfer::TransferHandle read(const std::string& peer, const std::vector<DescriptorTuple>& batch,
                                std::optional<int64_t> timeout_ms);
  transfer::TransferHandle write(const std::string& peer, const std::vector<DescriptorTuple>& batch,
                                 std::optional<std::string> notification,
                                 std::optional<int64_t> timeout_ms);

 private:
  std::pair<std::byte*, uint64_t> local(uint32_t region) const ECX_EXCLUDES(mu_);
  std::vector<transfer::TransferDescriptor> descriptors(
      const std::vector<DescriptorTuple>& batch) const;

  std::unique_ptr<transfer::Agent> agent_;
  mutable Mutex mu_;
  std::map<uint32_t, std::pair<std::byte*, uint64_t>> regions_ ECX_GUARDED_BY(mu_);
  std::map<uint32_t, nb::object> kept_ ECX_GUARDED_BY(mu_);
  std::map<uint32_t, std::shared_ptr<int>> view_tokens_ ECX_GUARDED_BY(mu_);  // buffer()'s
};

}  // namespace ecx::python
