// The flags of `ecx bench transfer` and of its hidden producer processes.
#include <memory>

#include "bench.h"
#include "connector_peer.h"
#include "transfer_bench.h"
#include "transfer_peer.h"

namespace ecx::bench {

namespace {

void add_ucx_options(CLI::App* t, TransferBenchOptions* options) {
  t->add_option("--ucx-tls", options->ucx_tls,
                "ucx rows: one set per UCX_TLS value, e.g. --ucx-tls tcp posix,cma ('default': "
                "UCX's choice); each against ucx_perftest with the same transports")
      ->capture_default_str();
  t->add_option("--ucx-library", options->ucx_library, "ucx: system, wheel or a libucp.so path")
      ->capture_default_str();
  t->add_option("--ucx-error-mode", options->ucx_error_mode,
                "ucx: auto (peer over tcp, none over shared memory), peer or none")
      ->capture_default_str();
  t->add_option("--ucx-perftest", options->ucx_perftest, "ucx_perftest binary (baseline)")
      ->capture_default_str();
}

void add_connector_options(CLI::App* t, TransferBenchOptions* options) {
  t->add_option("--connectors", options->connectors.connectors,
                "Also measure connectors per request: p2p:pull,p2p:pull-view (pull with "
                "zero_copy),p2p:pull-unchecked (pull with checksum off),p2p:pull-2step,"
                "p2p:push,disk,store");
  t->add_option("--items", options->connectors.items, "Items per request (connectors)")
      ->capture_default_str();
  t->add_option("--item-size", options->item_size, "Item size (connectors)")->capture_default_str();
  t->add_option("--requests", options->connectors.requests, "Requests per connector")
      ->capture_default_str();
  t->add_option("--redis", options->connectors.redis, "Redis for the store connector")
      ->capture_default_str();
  t->add_option("--security", options->connectors.security,
                "Connectors with authentication and grant checks: on, off or on,off (alternated)")
      ->capture_default_str();
  t->add_option("--rounds", options->connectors.rounds,
                "Repeat the connector rows this many times, alternating --security modes")
      ->capture_default_str();
  t->add_option("--connector-backend", options->connectors.backend, "p2p backend: auto, shm or tcp")
      ->capture_default_str();
  t->add_flag("--cold-cache", options->connectors.cold_cache,
              "Connectors: evict the caches before each timed load (8x the last-level cache "
              "written), so every item size starts alike");
}

void add_transfer_command(CLI::App& bench, int* exit_code) {
  auto options = std::make_shared<TransferBenchOptions>();
  CLI::App* t =
      bench.add_subcommand("transfer", "Transfer engine benchmark (nixlbench-like), two processes");
  CLI::Option* backends =
      t->add_option("--backends", options->backends,
                    "Backends to measure: shm,tcp,ucx (with --peer-netns the default is tcp)")
          ->capture_default_str();
  add_ucx_options(t, options.get());
  add_connector_options(t, options.get());
  t->add_option("--modes", options->modes, "Modes: pull,push,pull-2step")->capture_default_str();
  t->add_option("--sizes", options->sizes, "Item sizes")->capture_default_str();
  t->add_option("--batch", options->batches, "Items per request")->capture_default_str();
  t->add_option("--iters", options->iters, "Timed iterations per case")->capture_default_str();
  t->add_option("--json", options->json_path, "Write results as JSON to this file");
  t->add_option("--slice-bytes", options->slice_bytes, "tcp slice size in bytes")
      ->capture_default_str();
  t->add_option("--streams", options->streams, "tcp data connections per peer")
      ->capture_default_str();
  t->add_option("--peer-netns", options->peer_netns,
                "Run the producer in this network namespace (ip netns exec; a test host of "
                "scripts/hosts, docs/HOSTS.md): agents talk over its address, with a secret");
  t->add_option("--tcp-host", options->tcp_host,
                "With --peer-netns: the consumer's listen address (default: this namespace's "
                "address on the route to the producer)");
  t->callback([options, backends, exit_code] {
    options->backends_given = backends->count() > 0;
    *exit_code = run_transfer_bench(*options);
  });
}

void add_transfer_peer_command(CLI::App& bench, int* exit_code) {
  auto peer = std::make_shared<TransferPeerOptions>();
  CLI::App* p =
      bench.add_subcommand("transfer-peer", "Producer process of bench transfer (internal)");
  p->group("");  // hidden from --help
  add_transfer_peer_flags(*p, *peer);
  p->callback([peer, exit_code] { *exit_code = run_transfer_peer(*peer); });
}

}  // namespace

void add_transfer_peer_flags(CLI::App& app, TransferPeerOptions& options) {
  CLI::App* p = &app;
  TransferPeerOptions* peer = &options;
  p->add_option("--name", peer->name);
  p->add_option("--compat-hash", peer->compat_hash);
  p->add_option("--region-bytes", peer->region_bytes);
  p->add_option("--seed", peer->seed);
  p->add_option("--slice-bytes", peer->tcp_slice_bytes);
  p->add_option("--streams", peer->tcp_streams);
  p->add_option("--tcp-host", peer->tcp_host, "Listen address (not loopback: needs a secret)");
  p->add_option("--auth-token-file", peer->auth_token_file, "File holding the secret (mode 600)");
  p->add_option("--ucx", peer->ucx, "Enable ucx with this UCX_TLS ('default': UCX's choice)");
  p->add_option("--ucx-error-mode", peer->ucx_error_mode);
  p->add_option("--ucx-library", peer->ucx_library);
  p->add_option("--memory", peer->memory, "Source region memory: host or cuda")
      ->check(CLI::IsMember({"host", "cuda"}));
}

namespace {

void add_connector_peer_command(CLI::App& bench, int* exit_code) {
  auto connector_config = std::make_shared<std::string>();
  CLI::App* cp = bench.add_subcommand("connector-peer", "A connector driven over stdin (internal)");
  cp->group("");
  cp->add_option("--config", *connector_config, "Connector config JSON")->required();
  cp->callback(
      [connector_config, exit_code] { *exit_code = run_connector_peer(*connector_config); });
}

}  // namespace

void add_transfer_commands(CLI::App& bench, int* exit_code) {
  add_transfer_command(bench, exit_code);
  add_transfer_peer_command(bench, exit_code);
  add_connector_peer_command(bench, exit_code);
}

}  // namespace ecx::bench
