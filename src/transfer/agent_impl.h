// Inside the transfer library: the Agent (ecx/transfer/agent.h) as implemented.
// agent.cc holds its regions, transfers, calls and notifications; agent_peers.cc connects
// it to peers (a backend engine per peer, chosen once, behind data_path.h).
#pragma once

#include "ecx/transfer/agent.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <thread>
#include <vector>

#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"
#include "transfer/connection.h"
#include "transfer/data_path.h"
#include "transfer/serve_io.h"
#include "transfer/server.h"
#include "wire/wire.h"

namespace ecx::transfer {

// One connected peer and the data path that reaches it.
struct Peer {
  std::string name;
  Backend backend = Backend::kTcp;
  // Shared so a transfer's finalizer can notify without owning the Peer: a worker
  // thread must never drop the last reference to the pool that owns it.
  std::shared_ptr<ControlChannel> control;
  std::shared_ptr<DataPath> data;  // shared: cancel hooks hold weak references
  uint64_t connection_id = 0;      // tells this connection from later ones to the same name

  ~Peer() {
    // Data first (its workers may be mid-transfer), then the control channel.
    data.reset();
    control.reset();
  }
};

// The connection state of a peer name; lets concurrent connects share one handshake.
struct PeerSlot {
  bool connecting = false;
  std::shared_ptr<Peer> peer;  // set once connected
  Status error;                // last connect failure
};

class AgentImpl final : public Agent {
 public:
  explicit AgentImpl(AgentConfig config) : config_(std::move(config)), regions_(config_.name) {}
  ~AgentImpl() override;

  Status start();

  const std::string& name() const override { return config_.name; }
  const AgentConfig& config() const override { return config_; }
  Result<LocalRegion> allocate(uint64_t length, RegionAccess access) override;
  Result<LocalRegion> register_memory(void* data, uint64_t length, MemoryKind kind,
                                      RegionAccess access) override;
  Result<Capability> grant(uint32_t region_id, uint64_t offset, uint64_t length, bool write,
                           const std::string& holder) override {
    return regions_.grant(region_id, offset, length, write, holder);
  }
  void revoke(const Capability& capability) override { regions_.revoke(capability); }
  Status deregister(uint32_t region_id) override { return regions_.remove(region_id); }
  AgentMetadata metadata() const override;
  Result<AgentMetadata> connect(const AgentMetadata& peer, ConnectOptions options) override
      ECX_EXCLUDES(mu_);
  void disconnect(const std::string& peer) override ECX_EXCLUDES(mu_);
  Result<Backend> peer_backend(const std::string& peer) const override;
  Result<TransferHandle> read(const std::string& peer,
                              std::span<const TransferDescriptor> descriptors,
                              std::optional<Deadline> deadline) override {
    return transfer(peer, descriptors, false, std::nullopt, deadline);
  }
  Result<TransferHandle> write(const std::string& peer,
                               std::span<const TransferDescriptor> descriptors,
                               std::optional<std::string> notification,
                               std::optional<Deadline> deadline) override {
    return transfer(peer, descriptors, true, std::move(notification), deadline);
  }
  Status notify(const std::string& peer, std::string message) override;
  Result<std::string> call(const std::string& peer, std::string request,
                           Deadline deadline) override;
  void set_call_handler(CallHandler handler) override ECX_EXCLUDES(mu_);
  void set_peer_gone_handler(PeerGoneHandler handler) override ECX_EXCLUDES(mu_);
  void set_notification_handler(NotificationHandler handler) override ECX_EXCLUDES(mu_);
  Result<Notification> wait_notification(Deadline deadline) override ECX_EXCLUDES(notify_mu_);
  Result<RemoteView> view(const std::string& peer, uint32_t region, uint64_t offset,
                          uint64_t length, const Capability& capability) override;
  AgentStats stats() const override ECX_EXCLUDES(mu_) {
    AgentStats s = stats_.snapshot();
    MutexLock lock(&mu_);
    s.connects_by_backend = connects_by_backend_;
    return s;
  }
  void shutdown() override ECX_EXCLUDES(mu_);
  // How READ replies go out (serve_io.h), from the next one on; `io` outlives the agent.
  void set_serve_io(ServeIo& io) { serve_io_.store(&io, std::memory_order_release); }

 private:
  Result<std::shared_ptr<Peer>> connected_peer(const std::string& name) const ECX_EXCLUDES(mu_);
  Result<std::shared_ptr<Peer>> open_peer(const AgentMetadata& meta, const ConnectOptions& options,
                                          Deadline deadline);
  Result<std::shared_ptr<Peer>> open_with(BackendEngine& engine, const AgentMetadata& meta,
                                          bool same_host, bool any_name, Deadline deadline);
  BackendEngine* engine(Backend kind) const;
  ServerHooks server_hooks();
  Result<TransferHandle> transfer(const std::string& peer,
                                  std::span<const TransferDescriptor> descriptors, bool write,
                                  std::optional<std::string> notification,
                                  std::optional<Deadline> deadline);
  Result<uint64_t> check_descriptors(std::span<const TransferDescriptor> descriptors,
                                     const char* op);
  std::function<Status(const Status&)> transfer_finalizer(
      const std::shared_ptr<ControlChannel>& control, bool write, uint64_t total,
      std::optional<std::string> notification);
  void on_peer_death(const std::string& name, uint64_t connection_id, const Status& reason)
      ECX_EXCLUDES(mu_);
  // Destroys dead peers (joins their threads, unmaps their memory) off their own threads.
  void reap_dead_peers() ECX_EXCLUDES(mu_);

  const AgentConfig config_;
  RegionTable regions_;
  StatsCounters stats_;
  std::atomic<ServeIo*> serve_io_{&ServeIo::standard()};  // before server_: it reads it
  std::unique_ptr<Server> server_;
  // One engine per enabled backend, in the order `auto` tries them.
  std::vector<std::unique_ptr<BackendEngine>> engines_;
  std::string host_id_;
  // Our session with a server (AgentMetadata::session), sent in our handshakes with it
  // only: an HMAC under a key of this process over the server's name. The server keys
  // what it hands us by it, so no other process that declares our name can take or end
  // it, and a server that learns our session with it cannot pose as us to another.
  std::string session_with(const std::string& server) const {
    Mac mac = hmac_sha256(session_key_, {"ecx-session-v1", server});
    return hex_encode(mac.data(), 16);
  }
  const std::string session_key_ = random_bytes(32);
  std::atomic<uint64_t> next_connection_id_{1};

  mutable Mutex mu_;
  CondVar peers_cv_;
  std::map<std::string, PeerSlot> peers_ ECX_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> connects_by_backend_ ECX_GUARDED_BY(mu_);
  CallHandler call_handler_ ECX_GUARDED_BY(mu_);
  PeerGoneHandler peer_gone_handler_ ECX_GUARDED_BY(mu_);
  NotificationHandler notification_handler_ ECX_GUARDED_BY(mu_);
  bool stopped_ ECX_GUARDED_BY(mu_) = false;
  // Peers whose connection died, waiting for the reaper thread to destroy them.
  std::vector<std::shared_ptr<Peer>> dead_peers_ ECX_GUARDED_BY(mu_);
  CondVar reaper_cv_;
  std::thread reaper_;

  Mutex notify_mu_;
  CondVar notify_cv_;
  std::deque<Notification> notifications_ ECX_GUARDED_BY(notify_mu_);
  size_t notification_bytes_ ECX_GUARDED_BY(notify_mu_) = 0;
};

}  // namespace ecx::transfer
