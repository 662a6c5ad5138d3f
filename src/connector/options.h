// ConnectorOptions: the `extra` object of a connector config, parsed and checked once.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "ecx/common/status.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"
#include "ecx/transfer/types.h"

namespace ecx::connector {

// Whether a consumer checks each loaded payload against its producer's xxh3 (the
// "checksum" option). kAuto: wherever the bytes crossed a wire or a disk (tcp, ucx, push,
// disk, store); not for a same-host shm read, which a generation check before and after
// the copy proves untorn instead (docs/SECURITY.md, "Integrity of loaded bytes").
enum class ChecksumPolicy { kAuto, kOn, kOff };

// How the p2p connector moves an item (see p2p_connector.h).
enum class P2pMode { kPull, kPull2Step, kPush };
Result<P2pMode> parse_p2p_mode(std::string_view name);  // "pull", "pull-2step", "push"
std::string_view p2p_mode_name(P2pMode mode);

struct ConnectorOptions {
  // Common to every connector.
  std::string engine_id;                  // default "<connector>-<pid>"
  std::string compat_hash = "ecx-ec-v1";  // model + preprocessing + dtype identity
  FailurePolicy failure_policy = FailurePolicy::kRecompute;
  int64_t load_timeout_ms = 10000;
  uint64_t pool_bytes = 1ull << 30;  // producer pool (p2p) and consumer cache
  int64_t lease_ms = 30000;          // producer pins handed out in params
  int64_t consumer_pin_ms = 600000;  // consumer pins, released by request_finished
  int64_t save_wait_ms = 2000;       // producer backpressure when its pool is pinned full
  int loader_threads = 4;
  // Whether loaded items stay in the consumer cache after their request finished (later
  // requests hit them). false: dropped once nothing pins them (vLLM's workers, which
  // copy every load into vLLM's own encoder cache).
  bool keep_loaded = true;
  // The deployment secret (auth_token, or auth_token_file): authenticates agents and signs
  // ec_transfer_params. Empty: no secret, agents on loopback only.
  std::string auth_secret;
  int max_connections = 256;  // per agent
  // Live pins one peer (or one request's readers) may hold in a pool; the params E issues,
  // and those each agent asks for with the params op, 16 times this (cache::PoolConfig).
  int64_t max_pins_per_holder = 4096;
  int64_t idle_timeout_ms = 60000;  // served agent connections idle this long close
  // Pools reachable by peers only through grants (capabilities). Off only to measure what
  // the checks cost (ecx bench transfer --security on,off); never in a deployment.
  bool require_grants = true;
  ChecksumPolicy checksum = ChecksumPolicy::kAuto;
  // Whether a load that `crossed` a wire or disk (false: a same-host view) checks the
  // payload's checksum.
  bool verify_checksum(bool crossed) const {
    return checksum == ChecksumPolicy::kOn || (checksum == ChecksumPolicy::kAuto && crossed);
  }
  // p2p
  P2pMode mode = P2pMode::kPull;
  // Consumer, pull: a load from a producer on this host takes no copy. The request holds
  // the producer's pin, renewed every lease_ms / 3 until request_finished, and loaded()
  // returns a read-only view of the producer's sealed block. Items it cannot view (another
  // host, push) are copied as before. Viewed items are not kept after their request.
  bool zero_copy = false;
  // Consumer, pull on one host: threads that copy one load's blocks out of the producer's
  // memory, the loading thread included. Loads of 1 MiB or more are cut into 256 KiB
  // pieces the threads share; 1: the loading thread copies alone.
  int copy_threads = 2;
  // The consumers this side may offer items to (EcConnector::offer), "host:port" each:
  // the PDs' scheduler agents. An address comes from the request E is sent, so it must
  // be one of these: dialed elsewhere, an agent's handshake could be relayed to another
  // agent of the deployment. Empty: no offers.
  std::vector<std::string> offer_to;
  transfer::Backend backend = transfer::Backend::kAuto;
  // "ucx": true (or backend "ucx") enables the agent's ucx backend; "ucx_tls",
  // "ucx_library" and "ucx_error_mode" set the rest of it (transfer::UcxConfig).
  transfer::UcxConfig ucx;
  std::string tcp_host = "127.0.0.1";  // the address the agent's tcp listener binds
  uint16_t tcp_port = 0;
  std::string tcp_advertise_host;  // the address peers dial; empty: tcp_host
  // disk
  std::string root;  // default <tmp>/ecx-disk-cache
  int64_t ttl_s = 3600;
  uint64_t max_bytes = 8ull << 30;
  bool delete_on_release = true;
  // store
  std::string redis = "127.0.0.1:6379";

  static Result<ConnectorOptions> parse(const std::string& connector, const nlohmann::json& extra);
};

}  // namespace ecx::connector
