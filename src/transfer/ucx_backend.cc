#include "transfer/ucx_backend.h"

#include <sys/epoll.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>

#include "ecx/common/bytes.h"
#include "ecx/common/log.h"
#include "transfer/memory.h"
#include "transfer/ucx_data_path.h"
#include "transfer/ucx_worker.h"
#include "wire/socket.h"

namespace ecx::transfer {

Status ucx_status(const UcpApi& api, ucs_status_t status, const std::string& what) {
  std::string text = what + ": UCX " + api.status_string(status);
  switch (status) {
    case UCS_ERR_TIMED_OUT:
      return DeadlineExceeded(text);
    case UCS_ERR_CANCELED:
      return Status(StatusCode::kCancelled, text);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return InvalidArgument(text);
    case UCS_ERR_UNSUPPORTED:
      return Status(StatusCode::kFailedPrecondition, text);
    default:
      return Unavailable(text);
  }
}

namespace {

bool is_shared_memory_transport(const std::string& tl) {
  static const char* kShared[] = {"posix", "sysv", "cma", "knem", "xpmem", "sm", "shm", "self"};
  for (const char* s : kShared) {
    if (tl == s) return true;
  }
  return false;
}

// The transports of a UCX_TLS list; nullopt for an exclusion list ("^tcp").
std::optional<std::vector<std::string>> transports(const std::string& tls) {
  std::vector<std::string> out;
  std::stringstream in(tls);
  std::string t;
  while (std::getline(in, t, ',')) {
    if (!t.empty() && t[0] == '^') return std::nullopt;
    if (!t.empty()) out.push_back(t);
  }
  return out;
}

}  // namespace

bool ucx_tls_is_shared_memory(const std::string& tls) {
  auto list = transports(tls);
  if (!list || list->empty()) return false;
  return std::all_of(list->begin(), list->end(), is_shared_memory_transport);
}

// `auto`: none where UCX will move the bytes through shared memory (every transport is
// one, or the peer is on this host and shared memory is allowed), else peer.
bool ucx_auto_mode_is_none(const std::string& tls, bool same_host) {
  if (ucx_tls_is_shared_memory(tls)) return true;
  if (!same_host) return false;
  auto list = transports(tls);
  if (!list || list->empty()) return true;  // UCX's default set includes shared memory
  return std::any_of(list->begin(), list->end(), is_shared_memory_transport);
}

void UcxBatch::fail(const Status& status) {
  MutexLock lock(&mu_);
  if (status_.ok()) status_ = status;
}

void UcxBatch::request_done(const Status& status) {
  if (!status.ok()) fail(status);
  if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  complete();
}

void UcxBatch::abandon(const Status& reason) {
  fail(reason);
  complete();
}

void UcxBatch::complete() {
  if (completed_.exchange(true, std::memory_order_acq_rel)) return;
  Status final_status;
  {
    MutexLock lock(&mu_);
    final_status = status_;
  }
  state_->part_done(final_status.with_context(state_->description()));
}

namespace {
constexpr size_t kUcxKeyPadding = 4096;
// While batches are in flight the progress thread wakes at least this often.
constexpr int kBusyWakeMs = 20;
}  // namespace

Result<UcxRemoteKey> parse_ucx_key(std::string_view hex, uint64_t length, bool writable) {
  ECX_ASSIGN_OR_RETURN(std::string bytes, hex_decode(hex, "ucx key"));
  if (bytes.size() <= sizeof(uint64_t)) return InvalidArgument("ucx key: too short");
  UcxRemoteKey key{.length = length, .writable = writable};
  std::memcpy(&key.address, bytes.data(), sizeof(key.address));
  key.packed = bytes.substr(sizeof(uint64_t));
  // UCX parses a packed rkey without a length: zero padding keeps a short or forged key
  // from making it read past this buffer.
  key.packed.append(kUcxKeyPadding, '\0');
  return key;
}

// ---------------------------------------------------------------------------------------
// The worker and its progress thread.

Result<std::shared_ptr<UcxWorker>> UcxWorker::create(const UcpApi& api, const UcxConfig& config,
                                                     const std::string& agent) {
  std::shared_ptr<UcxWorker> worker(new UcxWorker(api, agent));
  ECX_RETURN_IF_ERROR(worker->init(config));
  return worker;
}

Status UcxWorker::init(const UcxConfig& config) {
  const std::string lib = api_.path + " (UCX " + api_.version + ")";
  ucp_config_t* ucp_config = nullptr;
  ucs_status_t s = api_.config_read(nullptr, nullptr, &ucp_config);
  if (s != UCS_OK) return ucx_status(api_, s, "read the UCX configuration of " + lib);
  if (!config.tls.empty()) s = api_.config_modify(ucp_config, "TLS", config.tls.c_str());
  if (s != UCS_OK) {
    api_.config_release(ucp_config);
    return ucx_status(api_, s, "UCX_TLS '" + config.tls + "'");
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.name = agent_.c_str();
  s = api_.init(&params, ucp_config, &context_);
  api_.config_release(ucp_config);
  if (s != UCS_OK) return ucx_status(api_, s, "ucp_init with " + lib);

  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (api_.context_query(context_, &attr) == UCS_OK) {
    supports_cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  s = api_.worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return ucx_status(api_, s, "create a UCX worker");
  s = api_.worker_get_efd(worker_, &efd_);
  if (s != UCS_OK) return ucx_status(api_, s, "the UCX worker's event fd");
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  s = api_.worker_get_address(worker_, &address, &address_length);
  if (s != UCS_OK) return ucx_status(api_, s, "the UCX worker's address");
  address_hex_ = hex_encode(address, address_length);
  api_.worker_release_address(worker_, address);
  return Status::Ok();
}

UcxWorker::~UcxWorker() {
  stop_progress();
  if (worker_ != nullptr) api_.worker_destroy(worker_);
  if (context_ != nullptr) api_.cleanup(context_);
  std::unordered_map<void*, void (*)(void*)> pending;
  {
    MutexLock lock(&ops_mu_);
    pending.swap(ops_);
  }
  for (auto& [op, drop] : pending) drop(op);
}

void UcxWorker::request_posted(void* op, void (*drop)(void*)) {
  MutexLock lock(&ops_mu_);
  ops_.emplace(op, drop);
}

void UcxWorker::request_completed(void* op) {
  MutexLock lock(&ops_mu_);
  ops_.erase(op);
}

void UcxWorker::start_progress() {
  progress_ = std::thread([this] { progress_loop(); });
}

void UcxWorker::stop_progress() {
  if (!progress_.joinable()) return;
  stopping_.store(true, std::memory_order_release);
  wake();
  progress_.join();
  // Endpoints still closing get a bounded chance to finish, so their requests are
  // purged and their memory freed before the worker goes.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  do {
    run_due();
    api_.worker_progress(worker_);
  } while (closing_.load() > 0 && std::chrono::steady_clock::now() < until);
}

void UcxWorker::watch(Deadline deadline, std::weak_ptr<void> owner,
                      std::function<void()> on_expire) {
  bool earliest = false;
  {
    MutexLock lock(&watch_mu_);
    auto it =
        watches_.emplace(deadline.time_point(), Watch{std::move(owner), std::move(on_expire)});
    earliest = it == watches_.begin();
  }
  if (earliest) wake();  // the progress thread sleeps until the earliest deadline
}

void UcxWorker::defer(std::function<void()> task) {
  {
    MutexLock lock(&watch_mu_);
    deferred_.push_back(std::move(task));
  }
  wake();
}

int UcxWorker::run_due() {
  std::vector<std::function<void()>> due;
  int next_ms = -1;
  {
    MutexLock lock(&watch_mu_);
    due.swap(deferred_);
    auto now = std::chrono::steady_clock::now();
    while (!watches_.empty()) {
      auto it = watches_.begin();
      if (it->second.owner.expired()) {
        watches_.erase(it);
        continue;
      }
      if (it->first > now) {
        auto ms = std::chrono::ceil<std::chrono::milliseconds>(it->first - now).count();
        next_ms = static_cast<int>(std::min<int64_t>(ms, 60000));
        break;
      }
      due.push_back(std::move(it->second.on_expire));
      watches_.erase(it);
    }
  }
  for (auto& f : due) f();
  return next_ms;
}

// Progresses until idle, arms the worker, and sleeps on its event fd (or until the
// next deadline). ucp_worker_signal wakes it for new requests and for stop.
void UcxWorker::progress_loop() {
  UniqueFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  epoll_event ev{};
  ev.events = EPOLLIN;
  if (!epoll.valid() || ::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, efd_, &ev) != 0) {
    spdlog::error("agent {}: ucx progress thread cannot watch the worker's event fd", agent_);
    return;
  }
  while (!stopping_.load(std::memory_order_acquire)) {
    while (api_.worker_progress(worker_) != 0) {
    }
    int timeout_ms = run_due();
    if (batches_.load(std::memory_order_relaxed) > 0 &&
        (timeout_ms < 0 || timeout_ms > kBusyWakeMs)) {
      timeout_ms = kBusyWakeMs;
    }
    ucs_status_t s = api_.worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // more events arrived: progress again
    if (s != UCS_OK) {
      spdlog::error("agent {}: ucp_worker_arm: {}", agent_, api_.status_string(s));
      timeout_ms = 10;  // progress on a timer rather than not at all
    }
    epoll_event out{};
    ::epoll_wait(epoll.get(), &out, 1, timeout_ms);
  }
}

// ---------------------------------------------------------------------------------------
// The engine.

namespace {

// A region's ucp memory handle, unmapped when the region goes.
struct UcxRegistration {
  std::shared_ptr<UcxWorker> worker;
  ucp_mem_h memh = nullptr;
  ~UcxRegistration() {
    if (memh != nullptr) worker->api().mem_unmap(worker->context(), memh);
  }
};

// AgentConfig::ucx.error_mode, parsed once.
enum class UcxErrorMode { kAuto, kPeer, kNone };

Result<UcxErrorMode> parse_error_mode(const std::string& mode) {
  if (mode == "auto") return UcxErrorMode::kAuto;
  if (mode == "peer") return UcxErrorMode::kPeer;
  if (mode == "none") return UcxErrorMode::kNone;
  return InvalidArgument("ucx error_mode '" + mode + "' (expected auto, peer or none)");
}

class UcxEngine final : public BackendEngine {
 public:
  UcxEngine(const AgentConfig& config, UcxErrorMode mode, std::shared_ptr<UcxWorker> worker)
      : config_(config), mode_(mode), worker_(std::move(worker)) {}

  Backend kind() const override { return Backend::kUcx; }
  bool reaches(const AgentMetadata& peer, bool) const override {
    return !peer.endpoint(Backend::kUcx).empty();
  }
  // Device memory too, where it registered it (register_region).
  bool carries(MemoryKind) const override { return true; }
  Result<ControlSocket> dial_control(const AgentMetadata& peer, bool same_host,
                                     Deadline d) const override {
    if (same_host && !peer.endpoint(Backend::kShm).empty()) return dial_unix_control(peer, d);
    return dial_tcp_control(peer, d);
  }
  // A region's rkey comes from REGION_QUERY's backend data.
  void add_services(FrameServices& services, const ServeContext& context) override {
    add_region_query_service(services, context);
  }
  Result<std::shared_ptr<DataPath>> open(PeerLink link, Deadline deadline) override;
  void describe(AgentMetadata& self) const override {
    self.endpoints[Backend::kUcx] = worker_->address_hex();
  }
  Status register_region(RegionEntry& region) override;
  void stop() override { worker_->stop_progress(); }

 private:
  Result<ucp_err_handling_mode_t> error_mode(bool same_host) const;

  const AgentConfig& config_;
  const UcxErrorMode mode_;
  const std::shared_ptr<UcxWorker> worker_;
};

Result<ucp_err_handling_mode_t> UcxEngine::error_mode(bool same_host) const {
  if (mode_ == UcxErrorMode::kPeer) return UCP_ERR_HANDLING_MODE_PEER;
  if (mode_ == UcxErrorMode::kNone) return UCP_ERR_HANDLING_MODE_NONE;
  // Shared-memory transports have no peer-failure handling: the control connection
  // watches the peer instead.
  if (ucx_auto_mode_is_none(config_.ucx.tls, same_host)) return UCP_ERR_HANDLING_MODE_NONE;
  return UCP_ERR_HANDLING_MODE_PEER;
}

Result<std::shared_ptr<DataPath>> UcxEngine::open(PeerLink link, Deadline) {
  ECX_ASSIGN_OR_RETURN(
      std::string address,
      hex_decode(link.peer.endpoint(Backend::kUcx), "agent " + link.peer.name + "'s ucx address"));
  if (address.empty()) return Unavailable("agent '" + link.peer.name + "' has no ucx endpoint");
  ECX_ASSIGN_OR_RETURN(ucp_err_handling_mode_t mode, error_mode(link.same_host));
  auto path = std::make_shared<UcxDataPath>(worker_, std::move(link), std::move(address), mode);
  return std::shared_ptr<DataPath>(std::move(path));
}

Status UcxEngine::register_region(RegionEntry& region) {
  if (region.kind == MemoryKind::kCuda && !worker_->supports_cuda()) {
    return Status(StatusCode::kFailedPrecondition,
                  "the loaded UCX (" + worker_->api().path + ", " + worker_->api().version +
                      ") has no CUDA memory support: set ucx.library to \"wheel\" (libucx-cu13)");
  }
  const UcpApi& api = worker_->api();
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_PROT | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = region.data;
  params.length = region.length;
  params.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
  if (region.access.remote_read) params.prot |= UCP_MEM_MAP_PROT_REMOTE_READ;
  if (region.access.remote_write) params.prot |= UCP_MEM_MAP_PROT_REMOTE_WRITE;
  params.memory_type =
      region.kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  auto registration = std::make_shared<UcxRegistration>();
  registration->worker = worker_;
  ucs_status_t s = api.mem_map(worker_->context(), &params, &registration->memh);
  if (s != UCS_OK) {
    registration->memh = nullptr;
    return ucx_status(api, s, "register " + std::to_string(region.length) + " bytes with UCX");
  }
  void* packed = nullptr;
  size_t packed_size = 0;
  s = api.rkey_pack(worker_->context(), registration->memh, &packed, &packed_size);
  if (s != UCS_OK) return ucx_status(api, s, "pack a UCX remote key");
  uint64_t address = reinterpret_cast<uintptr_t>(region.data);
  std::string key = hex_encode(&address, sizeof(address)) + hex_encode(packed, packed_size);
  api.rkey_buffer_release(packed);
  region.backends[Backend::kUcx] = {std::move(registration), std::move(key)};
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<BackendEngine>> make_ucx_engine(const AgentConfig& config) {
  const UcxConfig& ucx = config.ucx;
  ECX_ASSIGN_OR_RETURN(UcxErrorMode mode, parse_error_mode(ucx.error_mode));
  // Without peer error handling UCX cannot purge a request that waits on a network peer,
  // so a stalled peer could not be cancelled: `none` is for shared memory only.
  if (mode == UcxErrorMode::kNone && !ucx.tls.empty() && !ucx_tls_is_shared_memory(ucx.tls)) {
    return InvalidArgument(
        "ucx error_mode 'none' needs shared-memory transports (posix, cma, "
        "...), not UCX_TLS '" +
        ucx.tls + "': a stalled network peer could not be cancelled; use 'peer'");
  }
  ECX_ASSIGN_OR_RETURN(const UcpApi* api, load_ucp(ucx.library));
  auto worker = UcxWorker::create(*api, config.ucx, config.name);
  if (!worker.ok()) return worker.status().with_context("agent " + config.name + ": ucx backend");
  (*worker)->start_progress();
  spdlog::debug("agent {}: ucx backend on {} (UCX {}), tls '{}'", config.name, api->path,
                api->version, config.ucx.tls);
  return std::unique_ptr<BackendEngine>(
      std::make_unique<UcxEngine>(config, mode, std::move(*worker)));
}

}  // namespace ecx::transfer
