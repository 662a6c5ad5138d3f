#include "transfer/ucp_library.h"

#include <dlfcn.h>
#include <glob.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <memory>
#include <vector>

#include "ecx/common/mutex.h"

namespace ecx::transfer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSoname = "libucp.so.0";

struct Loaded {
  std::string request;  // what the first caller asked for, to name it in a conflict
  std::unique_ptr<UcpApi> api;
};

Mutex g_mutex;
Loaded* g_loaded ECX_GUARDED_BY(g_mutex) = nullptr;  // set once, never freed

std::string dl_error() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown dlerror";
}

// AgentConfig::ucx.library, parsed once: Debian's libucp, the libucx wheel's, or a file.
struct LibraryChoice {
  enum Kind { kSystem, kWheel, kPath } kind = kSystem;
  std::string path;  // kPath

  static Result<LibraryChoice> parse(const std::string& library) {
    if (library.empty() || library == "system") return LibraryChoice{kSystem, {}};
    if (library == "wheel") return LibraryChoice{kWheel, {}};
    if (library.front() == '/') return LibraryChoice{kPath, library};
    return InvalidArgument("UCX library '" + library +
                           "' is neither \"system\", \"wheel\" nor an absolute path");
  }
};

std::string describe(const LibraryChoice& choice, const std::string& venv_dir) {
  switch (choice.kind) {
    case LibraryChoice::kSystem:
      return "system";
    case LibraryChoice::kWheel:
      return venv_dir.empty() ? "wheel" : "wheel (venv " + venv_dir + ")";
    case LibraryChoice::kPath:
      return choice.path;
  }
  return "system";
}

// The libucx wheel's lib directory under `root`, which is a site-packages or a venv.
std::string wheel_lib_in(const fs::path& root) {
  std::error_code ec;
  if (fs::exists(root / "libucx/lib" / kSoname, ec)) return (root / "libucx/lib").string();
  for (const char* pattern : {"lib/python3*/site-packages", ".venv/lib/python3*/site-packages"}) {
    glob_t found{};
    std::string full = (root / pattern).string();
    if (glob(full.c_str(), 0, nullptr, &found) == 0) {
      for (size_t i = 0; i < found.gl_pathc; ++i) {
        fs::path lib = fs::path(found.gl_pathv[i]) / "libucx/lib";
        if (fs::exists(lib / kSoname, ec)) {
          globfree(&found);
          return lib.string();
        }
      }
    }
    globfree(&found);
  }
  return "";
}

// Walks up from `start` (a directory) to the root; returns the first wheel lib dir.
std::string wheel_lib_above(fs::path start) {
  std::error_code ec;
  start = fs::weakly_canonical(start, ec);
  for (fs::path dir = start; !dir.empty(); dir = dir.parent_path()) {
    if (std::string lib = wheel_lib_in(dir); !lib.empty()) return lib;
    if (dir == dir.parent_path()) break;
  }
  return "";
}

Result<std::string> find_wheel(const std::string& venv_dir) {
  if (!venv_dir.empty()) {
    std::string lib = wheel_lib_in(venv_dir);
    if (lib.empty()) {
      return Unavailable("no libucx wheel (libucx/lib/" + std::string(kSoname) + ") in " +
                         venv_dir + "; install libucx-cu13 there");
    }
    return lib + "/" + kSoname;
  }
  std::vector<fs::path> starts;
  std::error_code ec;
  auto add_start = [&](const fs::path& dir) {
    fs::path canonical = fs::weakly_canonical(fs::absolute(dir, ec), ec);
    if (!ec && std::find(starts.begin(), starts.end(), canonical) == starts.end()) {
      starts.push_back(canonical);
    }
  };
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&load_ucp), &self) != 0 && self.dli_fname != nullptr) {
    add_start(fs::path(self.dli_fname).parent_path());
  }
  if (fs::path exe = fs::read_symlink("/proc/self/exe", ec); !ec) add_start(exe.parent_path());
  if (fs::path cwd = fs::current_path(ec); !ec) add_start(cwd);
  std::string searched;
  for (const fs::path& start : starts) {
    if (std::string lib = wheel_lib_above(start); !lib.empty()) return lib + "/" + kSoname;
    searched += (searched.empty() ? "" : ", ") + start.string();
  }
  return Unavailable("no libucx wheel (libucx/lib/" + std::string(kSoname) +
                     " in a site-packages or .venv) above " + searched +
                     "; install libucx-cu13 or give the venv directory");
}

// The file that defines `symbol` in this process, or "" if unknown.
std::string file_of(void* symbol) {
  Dl_info info{};
  if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
  std::error_code ec;
  fs::path path = fs::canonical(info.dli_fname, ec);
  return ec ? std::string(info.dli_fname) : path.string();
}

// Sets `*out` to `name` in `handle`; appends the name to `missing` when absent.
template <typename F>
void resolve(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr) *missing += (missing->empty() ? "" : ", ") + std::string(name);
}

// libucs's constructor installs crash handlers for these signals (UCX_HANDLE_ERRORS,
// "bt" in Debian's build, "none" in the wheel's). They replace ASan's and Python's
// faulthandler, and 1.13's faults inside itself under ASan, so the process keeps its
// own unless the user asked for UCX's by setting UCX_HANDLE_ERRORS.
constexpr int kErrorSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};

class ErrorSignalsGuard {
 public:
  ErrorSignalsGuard() : keep_ucx_(getenv("UCX_HANDLE_ERRORS") != nullptr) {
    for (size_t i = 0; i < std::size(kErrorSignals); ++i)
      sigaction(kErrorSignals[i], nullptr, &saved_[i]);
  }
  ~ErrorSignalsGuard() {
    if (keep_ucx_) return;
    for (size_t i = 0; i < std::size(kErrorSignals); ++i)
      sigaction(kErrorSignals[i], &saved_[i], nullptr);
  }

 private:
  bool keep_ucx_;
  struct sigaction saved_[std::size(kErrorSignals)]{};
};

// "wheel (/path/libucp.so.0)", or just the path when that is what was asked for.
std::string name_of(const std::string& label, const std::string& file) {
  return label == file ? file : label + " (" + file + ")";
}

// Looks up every UCX function ecx calls; the names of those missing.
std::string resolve_all(void* handle, UcpApi* api) {
  std::string missing;
  resolve(handle, "ucp_config_read", &api->config_read, &missing);
  resolve(handle, "ucp_config_release", &api->config_release, &missing);
  resolve(handle, "ucp_config_modify", &api->config_modify, &missing);
  resolve(handle, "ucp_config_print", &api->config_print, &missing);
  resolve(handle, "ucp_init_version", &api->init_version, &missing);
  resolve(handle, "ucp_cleanup", &api->cleanup, &missing);
  resolve(handle, "ucp_context_query", &api->context_query, &missing);
  resolve(handle, "ucp_context_print_info", &api->context_print_info, &missing);
  resolve(handle, "ucp_get_version", &api->get_version, &missing);
  resolve(handle, "ucp_get_version_string", &api->get_version_string, &missing);
  resolve(handle, "ucp_mem_map", &api->mem_map, &missing);
  resolve(handle, "ucp_mem_unmap", &api->mem_unmap, &missing);
  resolve(handle, "ucp_mem_query", &api->mem_query, &missing);
  resolve(handle, "ucp_rkey_pack", &api->rkey_pack, &missing);
  resolve(handle, "ucp_rkey_buffer_release", &api->rkey_buffer_release, &missing);
  resolve(handle, "ucp_ep_rkey_unpack", &api->ep_rkey_unpack, &missing);
  resolve(handle, "ucp_rkey_destroy", &api->rkey_destroy, &missing);
  resolve(handle, "ucp_worker_create", &api->worker_create, &missing);
  resolve(handle, "ucp_worker_destroy", &api->worker_destroy, &missing);
  resolve(handle, "ucp_worker_query", &api->worker_query, &missing);
  resolve(handle, "ucp_worker_get_address", &api->worker_get_address, &missing);
  resolve(handle, "ucp_worker_release_address", &api->worker_release_address, &missing);
  resolve(handle, "ucp_worker_get_efd", &api->worker_get_efd, &missing);
  resolve(handle, "ucp_worker_arm", &api->worker_arm, &missing);
  resolve(handle, "ucp_worker_signal", &api->worker_signal, &missing);
  resolve(handle, "ucp_worker_progress", &api->worker_progress, &missing);
  resolve(handle, "ucp_worker_flush_nbx", &api->worker_flush_nbx, &missing);
  resolve(handle, "ucp_worker_print_info", &api->worker_print_info, &missing);
  resolve(handle, "ucp_ep_create", &api->ep_create, &missing);
  resolve(handle, "ucp_ep_close_nbx", &api->ep_close_nbx, &missing);
  resolve(handle, "ucp_ep_flush_nbx", &api->ep_flush_nbx, &missing);
  resolve(handle, "ucp_get_nbx", &api->get_nbx, &missing);
  resolve(handle, "ucp_put_nbx", &api->put_nbx, &missing);
  resolve(handle, "ucp_request_check_status", &api->request_check_status, &missing);
  resolve(handle, "ucp_request_free", &api->request_free, &missing);
  resolve(handle, "ucp_request_cancel", &api->request_cancel, &missing);
  resolve(handle, "ucs_status_string", &api->status_string, &missing);
  return missing;
}

// The loaded library's version and libucs are ones ecx works with.
Status check_version(UcpApi* api, const std::string& label) {
  api->path = file_of(reinterpret_cast<void*>(api->init_version));
  unsigned major = 0, minor = 0, release = 0;
  api->get_version(&major, &minor, &release);
  api->version = api->get_version_string();
  if (major != UCP_API_MAJOR || minor < UCP_API_MINOR) {
    return Status(StatusCode::kFailedPrecondition,
                  "UCX library " + name_of(label, api->path) + " is version " + api->version +
                      "; ecx needs " + std::to_string(UCP_API_MAJOR) + "." +
                      std::to_string(UCP_API_MINOR) + " or newer within major version " +
                      std::to_string(UCP_API_MAJOR));
  }
  // libucp finds libucs by soname; one already loaded from another UCX install (a
  // different version) would be used silently, and the two do not mix.
  std::string ucs = file_of(reinterpret_cast<void*>(api->status_string));
  if (!ucs.empty() && !api->path.empty() &&
      fs::path(ucs).parent_path() != fs::path(api->path).parent_path()) {
    return Status(StatusCode::kFailedPrecondition,
                  "UCX library " + name_of(label, api->path) + " runs with libucs from " + ucs +
                      ", another UCX install already loaded in this process");
  }
  return Status::Ok();
}

Result<std::unique_ptr<UcpApi>> load(const std::string& file, const std::string& label) {
  dlerror();
  ErrorSignalsGuard signals;
  // RTLD_LOCAL: UCX resolves its own modules (libuct_*.so) through their NEEDED
  // entries, so nothing needs ucp's symbols in the global namespace.
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    return Unavailable("cannot load UCX library " + name_of(label, file) + ": " + dl_error());
  }
  auto api = std::make_unique<UcpApi>();
  std::string missing = resolve_all(handle, api.get());
  if (!missing.empty()) {
    // Not dlclose'd: UCX's constructors have run, and its destructors are not safe to
    // run while anything it started (its async thread) may be alive.
    return Unavailable("UCX library " + name_of(label, file) + " lacks " + missing);
  }

  ECX_RETURN_IF_ERROR(check_version(api.get(), label));
  return api;
}

// The file to dlopen for `choice`: a path, or the soname for the system's.
Result<std::string> library_file(const LibraryChoice& choice, const std::string& venv_dir) {
  switch (choice.kind) {
    case LibraryChoice::kSystem:
      return std::string(kSoname);
    case LibraryChoice::kWheel:
      return find_wheel(venv_dir);
    case LibraryChoice::kPath:
      return choice.path;
  }
  return std::string(kSoname);
}

}  // namespace

Result<const UcpApi*> load_ucp(const std::string& library, const std::string& venv_dir) {
  ECX_ASSIGN_OR_RETURN(LibraryChoice choice, LibraryChoice::parse(library));
  MutexLock lock(&g_mutex);
  std::string request = describe(choice, venv_dir);
  if (g_loaded != nullptr) {
    if (g_loaded->request == request) return g_loaded->api.get();
    // Another spelling of the same file ("wheel" and its absolute path) is no conflict.
    Result<std::string> file = library_file(choice, venv_dir);
    std::error_code ec;
    if (file.ok() && file->front() == '/' && fs::canonical(*file, ec) == g_loaded->api->path) {
      return g_loaded->api.get();
    }
    return Status(StatusCode::kFailedPrecondition,
                  "UCX library " + request + " requested, but " + g_loaded->request + " (" +
                      g_loaded->api->path + ", version " + g_loaded->api->version +
                      ") is already loaded in this process");
  }
  ECX_ASSIGN_OR_RETURN(std::string file, library_file(choice, venv_dir));
  ECX_ASSIGN_OR_RETURN(std::unique_ptr<UcpApi> api, load(file, request));
  g_loaded = new Loaded{request, std::move(api)};
  return g_loaded->api.get();
}

}  // namespace ecx::transfer
