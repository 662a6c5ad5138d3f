// The backends every transfer and connector test runs over: shm, tcp, and ucx over
// each transport this machine has (tcp, and shared memory: posix + cma).
#pragma once

#include <string>
#include <vector>

#include "ecx/transfer/agent.h"

namespace ecx::testing {

struct BackendCase {
  transfer::Backend backend = transfer::Backend::kAuto;
  std::string ucx_tls;  // ucx only: UCX_TLS of both agents
  std::string name;     // the test-name suffix

  bool ucx() const { return backend == transfer::Backend::kUcx; }
  // `config` with this case's ucx settings (ucx cases enable the ucx backend).
  transfer::AgentConfig apply(transfer::AgentConfig config) const {
    if (ucx()) config.ucx = {.enable = true, .tls = ucx_tls};
    return config;
  }
};

inline std::vector<BackendCase> transfer_backends() {
  return {{transfer::Backend::kShm, "", "shm"},
          {transfer::Backend::kTcp, "", "tcp"},
          {transfer::Backend::kUcx, "tcp", "ucx_tcp"},
          {transfer::Backend::kUcx, "posix,cma", "ucx_shm"}};
}

}  // namespace ecx::testing
