// ServerState (http_connection.h): who is admitted, the body budget, requests in flight.
#include <unistd.h>

#include "http_server/http_connection.h"

namespace ecx::serve {

namespace {

// The least share of connections one client may hold (ServerState::client_share).
constexpr int64_t kMinClientShare = 256;
// A client holding at most this many connections is a newcomer: served past
// max_connections, within ServerState::newcomer_room() (at least kMinNewcomerRoom).
constexpr int64_t kNewcomerConnections = 4;
constexpr int64_t kMinNewcomerRoom = 64;
// Waiting connections of the largest client asked to close per newcomer let in.
constexpr int kYieldAsks = 4;

// A quarter of physical memory (4 GiB when unknown): the default budget of request bodies.
uint64_t quarter_of_memory() {
  long pages = ::sysconf(_SC_PHYS_PAGES);
  long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 4ull << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4;
}

}  // namespace

ServerState::ServerState(const CommonServiceConfig& config, std::string role_name, int n_workers)
    : role(std::move(role_name)),
      io_threads(std::max(1, config.io_threads)),
      workers(std::max(1, n_workers)),
      max_body_bytes(config.max_body_bytes),
      max_buffered_bytes(config.max_buffered_bytes > 0 ? config.max_buffered_bytes
                                                       : quarter_of_memory()),
      idle_timeout(std::max(1, config.idle_timeout_s)) {}

bool ServerState::reserve_body(uint64_t bytes) {
  uint64_t held = buffered_bytes_.load();
  do {
    if (held > max_buffered_bytes || bytes > max_buffered_bytes - held) return false;
  } while (!buffered_bytes_.compare_exchange_weak(held, held + bytes));
  return true;
}

void ServerState::release_body(uint64_t bytes) { buffered_bytes_ -= bytes; }

bool ServerState::has_room(uint64_t bytes) const {
  uint64_t held = buffered_bytes_.load();
  return held <= max_buffered_bytes && bytes <= max_buffered_bytes - held;
}

int64_t ServerState::client_share() const {
  return std::max<int64_t>(kMinClientShare, max_connections / 4);
}

int64_t ServerState::newcomer_room() const {
  return std::max<int64_t>(kMinNewcomerRoom, max_connections / 8);
}

Admission ServerState::admit(const std::string& client, std::weak_ptr<AdmittedConnection> conn) {
  // Asked to yield once the lock is let go: a connection's last reference may go with the
  // ask, and its destructor leave()s.
  std::optional<std::vector<std::shared_ptr<AdmittedConnection>>> to_ask;
  Admission a;
  {
    MutexLock lock(&clients_mu_);
    auto& held = connections_by_client_[client];
    held.push_back(std::move(conn));
    a.slot = std::prev(held.end());
    const int64_t open = ++open_connections;
    const auto count = static_cast<int64_t>(held.size());
    a.over_share = count > client_share() && open > max_connections / 2;
    const bool newcomer = count <= kNewcomerConnections;
    if (open > max_connections && newcomer && open <= max_connections + newcomer_room()) {
      to_ask = room_makers_locked(client);
    }
    a.over_capacity = !to_ask && (a.over_share || open > max_connections);
  }
  if (to_ask) {
    for (const auto& c : *to_ask) c->yield_if_waiting();
  }
  return a;
}

std::optional<std::vector<std::shared_ptr<AdmittedConnection>>> ServerState::room_makers_locked(
    const std::string& newcomer) {
  std::list<std::weak_ptr<AdmittedConnection>>* largest = nullptr;
  for (auto& [client, held] : connections_by_client_) {
    if (client != newcomer && (largest == nullptr || held.size() > largest->size())) {
      largest = &held;
    }
  }
  if (largest == nullptr || static_cast<int64_t>(largest->size()) <= kNewcomerConnections) {
    return std::nullopt;  // nobody holds many: the service is full of small clients
  }
  // Its oldest first; those asked go to the back, so the next newcomer asks others.
  std::vector<std::shared_ptr<AdmittedConnection>> out;
  for (int asked = 0; asked < kYieldAsks && !largest->empty(); ++asked) {
    if (auto c = largest->front().lock()) out.push_back(std::move(c));
    largest->splice(largest->end(), *largest, largest->begin());
  }
  return out;
}

void ServerState::leave(const std::string& client, const Admission& admission) {
  MutexLock lock(&clients_mu_);
  auto it = connections_by_client_.find(client);
  if (it != connections_by_client_.end()) {
    it->second.erase(admission.slot);
    if (it->second.empty()) connections_by_client_.erase(it);
  }
  open_connections--;
}

void ServerState::begin_request() {
  MutexLock lock(&mu_);
  ++in_flight_;
}

bool ServerState::try_begin_request() {
  MutexLock lock(&mu_);
  if (stopping) return false;
  ++in_flight_;
  return true;
}

void ServerState::begin_stopping() {
  MutexLock lock(&mu_);
  stopping = true;
}

void ServerState::end_request() {
  MutexLock lock(&mu_);
  if (--in_flight_ == 0) idle_cv_.notify_all();
}

bool ServerState::wait_idle(Deadline deadline) {
  MutexLock lock(&mu_);
  return idle_cv_.wait_until(&mu_, deadline.time_point(),
                             [this]() ECX_REQUIRES(mu_) { return in_flight_ == 0; });
}

}  // namespace ecx::serve
