// The UCX ucp API, resolved at run time (dlopen/dlsym) so that ecx builds and runs on a
// host without UCX and can use either the system's libucp or the one in the libucx-cu13
// wheel. Compiled against the system's <ucp/api/ucp.h> (1.13); a loaded library must be
// at least that version (ucp keeps its ABI backwards compatible within major version 1).
//
// Loading is process-wide and happens once: UCX's libraries cannot be unloaded cleanly
// and two UCX versions cannot share a process (their libucs/libuct resolve by soname).
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "ecx/common/status.h"

namespace ecx::transfer {

// One pointer per ucp/ucs function the ucx backend calls; every one is non-null in a
// UcpApi returned by load_ucp. Signatures are those of the 1.13 headers.
struct UcpApi {
  // Context configuration.
  decltype(&::ucp_config_read) config_read;
  decltype(&::ucp_config_release) config_release;
  decltype(&::ucp_config_modify) config_modify;
  decltype(&::ucp_config_print) config_print;
  // Context. `init_version` is what the ucp_init() inline wraps; call init() below.
  decltype(&::ucp_init_version) init_version;
  decltype(&::ucp_cleanup) cleanup;
  decltype(&::ucp_context_query) context_query;
  decltype(&::ucp_context_print_info) context_print_info;
  decltype(&::ucp_get_version) get_version;
  decltype(&::ucp_get_version_string) get_version_string;
  // Memory registration and remote keys.
  decltype(&::ucp_mem_map) mem_map;
  decltype(&::ucp_mem_unmap) mem_unmap;
  decltype(&::ucp_mem_query) mem_query;
  decltype(&::ucp_rkey_pack) rkey_pack;
  decltype(&::ucp_rkey_buffer_release) rkey_buffer_release;
  decltype(&::ucp_ep_rkey_unpack) ep_rkey_unpack;
  decltype(&::ucp_rkey_destroy) rkey_destroy;
  // Worker.
  decltype(&::ucp_worker_create) worker_create;
  decltype(&::ucp_worker_destroy) worker_destroy;
  decltype(&::ucp_worker_query) worker_query;
  decltype(&::ucp_worker_get_address) worker_get_address;
  decltype(&::ucp_worker_release_address) worker_release_address;
  decltype(&::ucp_worker_get_efd) worker_get_efd;
  decltype(&::ucp_worker_arm) worker_arm;
  decltype(&::ucp_worker_signal) worker_signal;
  decltype(&::ucp_worker_progress) worker_progress;
  decltype(&::ucp_worker_flush_nbx) worker_flush_nbx;
  decltype(&::ucp_worker_print_info) worker_print_info;
  // Endpoints and RMA.
  decltype(&::ucp_ep_create) ep_create;
  decltype(&::ucp_ep_close_nbx) ep_close_nbx;
  decltype(&::ucp_ep_flush_nbx) ep_flush_nbx;
  decltype(&::ucp_get_nbx) get_nbx;
  decltype(&::ucp_put_nbx) put_nbx;
  // Requests.
  decltype(&::ucp_request_check_status) request_check_status;
  decltype(&::ucp_request_free) request_free;
  decltype(&::ucp_request_cancel) request_cancel;
  // ucs (libucs, found through libucp's dependencies).
  decltype(&::ucs_status_string) status_string;

  // ucp_init() as the header's inline spells it, with this build's API version.
  ucs_status_t init(const ucp_params_t* params, const ucp_config_t* config,
                    ucp_context_h* context) const {
    return init_version(UCP_API_MAJOR, UCP_API_MINOR, params, config, context);
  }

  // The loaded library's version ("1.22.0") and absolute path (symlinks resolved).
  std::string version;
  std::string path;
};

// Where load_ucp finds libucp.
//  "" or "system": dlopen("libucp.so.0") through the default search path.
//  "wheel": libucx/lib/libucp.so.0 of the libucx-cu13 wheel in a Python environment:
//      the one in `venv_dir` when given (a venv root, or its site-packages), else the
//      first found walking up from the directory of the module that holds ecx (the
//      Python extension sits in site-packages beside libucx), of /proc/self/exe, and of
//      the working directory, looking at each level in `libucx/lib` and in
//      `.venv/lib/python3*/site-packages/libucx/lib`.
//  an absolute path: that file.
//
// Returns the process-wide UcpApi (never freed), loading it on the first call.
// Errors: InvalidArgument for a relative path or unknown name; Unavailable when the
// library is not found or cannot be loaded (the message names it and has dlerror());
// kFailedPrecondition when another library was already loaded by an earlier call
// (the message names both), when the library is older than the 1.13 headers, or when
// its libucs comes from another UCX install already in the process.
// The process's SIGSEGV/SIGBUS/SIGILL/SIGFPE handlers survive the load (libucs's
// constructor replaces them with UCX's crash handler) unless UCX_HANDLE_ERRORS is set.
// Thread-safe.
Result<const UcpApi*> load_ucp(const std::string& library, const std::string& venv_dir = "");

}  // namespace ecx::transfer
