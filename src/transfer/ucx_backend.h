// ucx backend: one-sided READ and WRITE through UCX's ucp API (ucp_get_nbx /
// ucp_put_nbx), loaded at run time (transfer/ucp_library.h), so one build can use
// Debian's UCX (RDMA verbs) or the libucx-cu13 wheel's (CUDA).
//
// Per agent: one ucp context and worker (thread mode MULTI), and one progress thread
// that sleeps on the worker's event fd (ucp_worker_arm) and never spins. Every region
// the agent registers is ucp_mem_map'ed; its key (address + packed rkey, hex) goes in
// the agent metadata, or, for regions behind grants, to a peer that presents a
// capability (REGION_QUERY for the ucx backend's data).
//
// Per peer: one endpoint to the peer's worker address. Error handling: UCX's `peer`
// mode where the transports have it (tcp, RDMA); `none` on shared memory, where the
// agent's control connection reports the peer's death (fail_all). A batch that
// outlives its deadline, is cancelled, or meets a dead peer fails after its requests
// are purged (the endpoint is force-closed and reopened for the next batch), so no
// byte lands in local memory once the batch has completed.
#pragma once

#include <memory>
#include <string>

#include "transfer/data_path.h"

namespace ecx::transfer {

// Loads UCX (config.ucx.library) and starts the worker and its
// progress thread. Errors name the library, the transports and UCX's status.
Result<std::unique_ptr<BackendEngine>> make_ucx_engine(const AgentConfig& config);

// Whether every transport in a UCX_TLS list is shared memory (posix, sysv, cma, knem,
// xpmem, sm, shm, self), which have no peer-failure handling (error mode `none`).
bool ucx_tls_is_shared_memory(const std::string& tls);
// Error mode `auto`: whether to use `none` with a peer (on this host when `same_host`).
bool ucx_auto_mode_is_none(const std::string& tls, bool same_host);

}  // namespace ecx::transfer
