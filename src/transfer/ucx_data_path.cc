// The ucx backend's per-peer data path (see transfer/ucx_backend.h).
//
// Locking: UCX runs request and error callbacks inside ucp_worker_progress, holding the
// worker's lock. So this file never calls UCX while holding mu_, and calls that purge
// requests (closing an endpoint) run on the progress thread through UcxWorker::defer.
// A post holds its endpoint's `use` across its UCX calls; the close takes it (outside
// ucp_worker_progress) before the endpoint is freed.
#include "transfer/ucx_data_path.h"

#include <atomic>

#include "ecx/common/log.h"
#include "transfer/connection.h"
#include "transfer/memory.h"
#include "transfer/ucx_worker.h"

namespace ecx::transfer {

// An endpoint to the peer and the rkeys unpacked on it. Lives until its close has
// completed (the error handler's argument is this object).
struct UcxDataPath::Endpoint {
  std::shared_ptr<UcxWorker> worker;
  std::weak_ptr<UcxDataPath> path;
  ucp_ep_h ep = nullptr;
  Mutex mu;
  std::map<uint32_t, ucp_rkey_h> rkeys ECX_GUARDED_BY(mu);
  // Posting on `ep` and closing it exclude each other: the progress thread's forced close
  // (a peer's failure, another batch's deadline) frees the ucp_ep, so a thread that was
  // still posting a batch on it would use freed memory (a consumer died so, silently,
  // when its producer was killed under load). A post holds `use` from its first use of
  // `ep` to its last; the close marks it `closed` first.
  Mutex use;
  bool closed ECX_GUARDED_BY(use) = false;
  // UCX reported the endpoint failed (its error handler), maybe before it was current.
  std::atomic<bool> failed = false;

  ~Endpoint() {
    for (auto& [region, rkey] : rkeys) worker->api().rkey_destroy(rkey);
  }
};

namespace {

using Endpoint = UcxDataPath::Endpoint;

// One request in flight: its batch, the API to free it, and the worker that lists it
// (which outlives it: a request still pending when the worker goes is dropped there).
struct UcxOp {
  std::shared_ptr<UcxBatch> batch;
  const UcpApi* api = nullptr;
  UcxWorker* worker = nullptr;
};

// The worker's destructor, for a request UCX never completed: its batch had already been
// failed or abandoned (a dead peer), so only the memory goes.
void drop_op(void* user_data) { delete static_cast<UcxOp*>(user_data); }

UcxOp* new_op(const std::shared_ptr<UcxBatch>& batch, UcxWorker& worker) {
  auto* op = new UcxOp{batch, &worker.api(), &worker};
  worker.request_posted(op, drop_op);
  return op;
}

void on_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<UcxOp*>(user_data);
  op->worker->request_completed(op);
  std::shared_ptr<UcxBatch> batch = std::move(op->batch);
  const UcpApi& api = *op->api;
  delete op;
  api.request_free(request);
  batch->request_done(status == UCS_OK ? Status::Ok() : ucx_status(api, status, "ucx request"));
}

// Completes a request that ucp_*_nbx returned: NULL (done at once), an error, or a
// request whose callback completes it later.
void track(void* request, UcxOp* op) {
  if (request == nullptr || UCS_PTR_IS_ERR(request)) op->worker->request_completed(op);
  if (request == nullptr) {
    auto batch = std::move(op->batch);
    delete op;
    batch->request_done(Status::Ok());
  } else if (UCS_PTR_IS_ERR(request)) {
    auto batch = std::move(op->batch);
    const UcpApi& api = *op->api;
    delete op;
    batch->request_done(ucx_status(api, UCS_PTR_STATUS(request), "post a ucx request"));
  }
}

ucp_request_param_t request_param(UcxOp* op) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = on_request_done;
  param.user_data = op;
  return param;
}

void on_endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* endpoint = static_cast<Endpoint*>(arg);
  endpoint->failed = true;
  if (auto path = endpoint->path.lock()) path->endpoint_failed(ep, status);
}

// Holds an endpoint until its forced close completes.
struct Closing {
  std::shared_ptr<Endpoint> endpoint;
};

void on_closed(void* request, ucs_status_t, void* user_data) {
  auto* closing = static_cast<Closing*>(user_data);
  auto worker = closing->endpoint->worker;
  worker->api().request_free(request);
  delete closing;
  worker->close_finished();
}

// On the progress thread: closes `endpoint`, purging its requests (their callbacks
// report an error), and frees it (and its rkeys) once UCX is done with it.
void close_endpoint(std::shared_ptr<Endpoint> endpoint) {
  auto worker = endpoint->worker;
  {
    MutexLock lock(&endpoint->use);  // a post under way on it ends first
    endpoint->closed = true;
  }
  worker->close_started();
  auto* closing = new Closing{std::move(endpoint)};
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  param.cb.send = on_closed;
  param.user_data = closing;
  void* request = worker->api().ep_close_nbx(closing->endpoint->ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) {
    delete closing;
    worker->close_finished();
  }
}

}  // namespace

UcxDataPath::UcxDataPath(std::shared_ptr<UcxWorker> worker, PeerLink link, std::string peer_address,
                         ucp_err_handling_mode_t mode)
    : worker_(std::move(worker)),
      control_(std::move(link.control)),
      stats_(link.stats),
      peer_(link.peer.name),
      peer_address_(std::move(peer_address)),
      mode_(mode) {
  // Keys of regions any peer may reach come with the metadata: no round trip for them.
  for (const auto& region : link.peer.regions) {
    const std::string& data = region.data_for(Backend::kUcx);
    if (data.empty()) continue;
    auto key = parse_ucx_key(data, region.length, region.remote_write);
    if (key.ok()) keys_[region.id] = std::make_shared<const UcxRemoteKey>(std::move(*key));
  }
}

UcxDataPath::~UcxDataPath() {
  std::shared_ptr<Endpoint> ep;
  {
    MutexLock lock(&mu_);
    ep = std::move(ep_);
  }
  if (ep) worker_->defer([ep] { close_endpoint(ep); });
}

void UcxDataPath::fail_all(const Status& reason) {
  std::shared_ptr<Endpoint> ep;
  std::vector<std::weak_ptr<UcxBatch>> inflight;
  {
    MutexLock lock(&mu_);
    if (failed_.ok()) failed_ = reason;
    ep = ep_;
    inflight.swap(inflight_);
  }
  if (mode_ == UCP_ERR_HANDLING_MODE_PEER) {
    if (ep) reset_endpoint(ep);  // the forced close purges every request
    return;
  }
  // Error mode none: UCX cannot purge, and a dead peer's memory can no longer be
  // copied, so its batches end now (on the progress thread: no copy is under way).
  worker_->defer([inflight, reason] {
    for (const auto& weak : inflight) {
      if (auto batch = weak.lock()) batch->abandon(reason);
    }
  });
}

void UcxDataPath::reset_endpoint(const std::shared_ptr<Endpoint>& ep) {
  {
    MutexLock lock(&mu_);
    if (ep_ != ep) return;  // already replaced
    ep_.reset();
  }
  worker_->defer([ep] { close_endpoint(ep); });
}

void UcxDataPath::endpoint_failed(ucp_ep_h ep, ucs_status_t status) {
  std::shared_ptr<Endpoint> current;
  {
    MutexLock lock(&mu_);
    if (!ep_ || ep_->ep != ep) return;
    current = ep_;
  }
  spdlog::debug("agent {}: ucx endpoint to {} failed: {}", worker_->agent(), peer_,
                worker_->api().status_string(status));
  reset_endpoint(current);
}

std::shared_ptr<TransferState> UcxDataPath::submit(std::span<const TransferDescriptor> descriptors,
                                                   bool write, Deadline deadline,
                                                   std::string description,
                                                   TransferFinalizer finalizer) {
  auto state = std::make_shared<TransferState>(std::move(description), 1);
  state->set_finalizer(std::move(finalizer));
  auto batch = std::make_shared<UcxBatch>(state);
  Status posted = post(batch, descriptors, write, deadline);
  if (!posted.ok()) batch->fail(posted);
  batch->request_done(Status::Ok());  // the submitter's count
  return state;
}

Status UcxDataPath::post(const std::shared_ptr<UcxBatch>& batch,
                         std::span<const TransferDescriptor> descriptors, bool write,
                         Deadline deadline) {
  {
    MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;
  }
  ECX_ASSIGN_OR_RETURN(auto keys, resolve(descriptors, write, deadline));
  ECX_ASSIGN_OR_RETURN(auto ep, endpoint());
  MutexLock in_use(&ep->use);
  if (ep->closed) {
    return Unavailable("ucx endpoint to agent " + peer_ +
                       " was closed while the batch was posted (the peer failed, or a batch "
                       "on it was aborted)");
  }
  std::vector<ucp_rkey_h> rkeys;
  for (size_t i = 0; i < descriptors.size(); ++i) {
    ECX_ASSIGN_OR_RETURN(ucp_rkey_h rkey, rkey_for(*ep, descriptors[i].remote_region, *keys[i]));
    rkeys.push_back(rkey);
  }
  ECX_RETURN_IF_ERROR(arm_abort(batch, ep, deadline));
  worker_->batch_started();
  std::weak_ptr<UcxWorker> weak_worker = worker_;  // a callback never owns the worker
  batch->state()->on_complete([weak_worker](const Status&) {
    if (auto worker = weak_worker.lock()) worker->batch_finished();
  });
  issue(batch, *ep, descriptors, keys, rkeys, write);
  worker_->wake();
  return Status::Ok();
}

// How a batch ends early: a deadline or a cancel force-closes the endpoint (peer error
// mode), or, over shared memory, fail_all abandons it with a dead peer.
Status UcxDataPath::arm_abort(const std::shared_ptr<UcxBatch>& batch,
                              const std::shared_ptr<Endpoint>& ep, Deadline deadline) {
  // A force-closed endpoint's requests are purged, and the batch completes with the
  // reason once they are.
  std::weak_ptr<UcxDataPath> weak_path = weak_from_this();
  std::weak_ptr<Endpoint> weak_ep = ep;
  std::weak_ptr<UcxBatch> weak_batch = batch;
  auto abort = [weak_path, weak_ep, weak_batch](const Status& why) {
    auto b = weak_batch.lock();
    if (!b) return;
    b->fail(why);
    auto path = weak_path.lock();
    auto endpoint = weak_ep.lock();
    if (path && endpoint) path->reset_endpoint(endpoint);
  };
  if (mode_ == UCP_ERR_HANDLING_MODE_PEER) {
    batch->state()->set_cancel_hook(
        [abort] { abort(Status(StatusCode::kCancelled, "cancelled")); });
    worker_->watch(deadline, batch, [abort] { abort(DeadlineExceeded("deadline passed")); });
  } else {
    // Shared memory: requests complete without the peer (and cannot be purged); a dead
    // peer's batches are abandoned by fail_all.
    MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;  // fail_all ran since the check above: not listed there
    std::erase_if(inflight_, [](const auto& weak) { return weak.expired(); });
    inflight_.push_back(batch);
  }

  return Status::Ok();
}

// Posts one get (or put) per descriptor, and after puts a flush.
void UcxDataPath::issue(const std::shared_ptr<UcxBatch>& batch, Endpoint& ep,
                        std::span<const TransferDescriptor> descriptors,
                        const std::vector<std::shared_ptr<const UcxRemoteKey>>& keys,
                        const std::vector<ucp_rkey_h>& rkeys, bool write) {
  const UcpApi& api = worker_->api();
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    uint64_t remote = keys[i]->address + d.remote_offset;
    batch->add_request();
    auto* op = new_op(batch, *worker_);
    ucp_request_param_t param = request_param(op);
    track(write ? api.put_nbx(ep.ep, d.local, d.length, remote, rkeys[i], &param)
                : api.get_nbx(ep.ep, d.local, d.length, remote, rkeys[i], &param),
          op);
  }
  if (write) {
    // A put completes locally; the flush completes once every put has landed remotely,
    // so the notification that follows the batch arrives after its data.
    batch->add_request();
    auto* op = new_op(batch, *worker_);
    ucp_request_param_t param = request_param(op);
    track(api.ep_flush_nbx(ep.ep, &param), op);
  }
}

Result<std::vector<std::shared_ptr<const UcxRemoteKey>>> UcxDataPath::resolve(
    std::span<const TransferDescriptor> descriptors, bool write, Deadline deadline) {
  std::vector<std::shared_ptr<const UcxRemoteKey>> keys;
  keys.reserve(descriptors.size());
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const auto& d = descriptors[i];
    std::string what = "descriptor " + std::to_string(i) + ": " +
                       describe_access(write, d.length, d.remote_offset, d.remote_region, peer_);
    auto key = key_for(d, deadline);
    if (!key.ok()) return key.status().with_context(what);
    const UcxRemoteKey& k = **key;
    if (d.remote_offset > k.length || d.length > k.length - d.remote_offset) {
      stats_->rejected_descriptors++;
      return OutOfRange(what + ": outside the region's " + std::to_string(k.length) + " bytes");
    }
    if (write && !k.writable) {
      stats_->rejected_descriptors++;
      return Status(StatusCode::kFailedPrecondition, what + ": region is not remotely writable");
    }
    keys.push_back(std::move(*key));
  }
  return keys;
}

// A region's key: from the metadata, or asked once from the peer with the descriptor's
// capability (regions behind grants), then kept for this peer.
Result<std::shared_ptr<const UcxRemoteKey>> UcxDataPath::key_for(const TransferDescriptor& d,
                                                                 Deadline deadline) {
  {
    MutexLock lock(&mu_);
    auto it = keys_.find(d.remote_region);
    if (it != keys_.end()) return it->second;
  }
  ECX_ASSIGN_OR_RETURN(RegionGrant grant, control_->query_region(d.remote_region, d.capability,
                                                                 deadline, Backend::kUcx));
  if (grant.backend_data.empty()) {
    return Status(StatusCode::kFailedPrecondition, "region " + std::to_string(d.remote_region) +
                                                       " of agent " + peer_ +
                                                       " is not registered with ucx");
  }
  ECX_ASSIGN_OR_RETURN(UcxRemoteKey key,
                       parse_ucx_key(grant.backend_data, grant.length, grant.remote_write));
  auto shared = std::make_shared<const UcxRemoteKey>(std::move(key));
  MutexLock lock(&mu_);
  return keys_.emplace(d.remote_region, std::move(shared)).first->second;
}

Result<std::shared_ptr<Endpoint>> UcxDataPath::endpoint() {
  {
    MutexLock lock(&mu_);
    if (ep_) return ep_;
  }
  auto e = std::make_shared<Endpoint>();
  e->worker = worker_;
  e->path = weak_from_this();
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address_.data());
  params.err_mode = mode_;
  params.err_handler.cb = ecx::transfer::on_endpoint_error;
  params.err_handler.arg = e.get();
  ucs_status_t s = worker_->api().ep_create(worker_->worker(), &params, &e->ep);
  if (s != UCS_OK) {
    return ucx_status(worker_->api(), s, "create a ucx endpoint to agent " + peer_);
  }
  std::shared_ptr<Endpoint> raced;
  {
    MutexLock lock(&mu_);
    if (!ep_) ep_ = e;
    raced = ep_;
  }
  if (raced == e) {
    // Its error handler may have run before it was current, where endpoint_failed
    // ignores it, and UCX reports a failure once.
    if (!e->failed) return e;
    reset_endpoint(e);
    return Unavailable("ucx endpoint to agent " + peer_ + " failed as it was made");
  }
  // Another thread made one first: use it, close ours.
  worker_->defer([e] { close_endpoint(e); });
  return raced;
}

Result<ucp_rkey_h> UcxDataPath::rkey_for(Endpoint& ep, uint32_t region, const UcxRemoteKey& key) {
  {
    MutexLock lock(&ep.mu);
    auto it = ep.rkeys.find(region);
    if (it != ep.rkeys.end()) return it->second;
  }
  ucp_rkey_h rkey = nullptr;
  ucs_status_t s = worker_->api().ep_rkey_unpack(ep.ep, key.packed.data(), &rkey);
  if (s != UCS_OK) {
    stats_->rejected_descriptors++;
    return ucx_status(
        worker_->api(), s,
        "unpack the ucx key of region " + std::to_string(region) + " of agent " + peer_);
  }
  MutexLock lock(&ep.mu);
  auto [it, added] = ep.rkeys.emplace(region, rkey);
  if (!added) worker_->api().rkey_destroy(rkey);  // unpacked twice at once: keep one
  return it->second;
}

}  // namespace ecx::transfer
