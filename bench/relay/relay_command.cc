// `ecx relay`: flags of the relay, the echo server and the probe (relay.h).
#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>

#include "relay.h"

namespace ecx::relay {
namespace {

struct RelayFlags {
  RelayOptions relay;
  double delay_ms = 0;
  bool echo = false, once = false, json = false;
  std::string probe;
  int count = 50;
  size_t bytes = 64;
};

int run(RelayFlags& f) {
  Status s;
  if (!f.probe.empty()) {
    s = run_probe(f.probe, f.count, f.bytes, f.json);
  } else if (f.echo) {
    s = run_echo(f.relay.listen, f.once);
  } else if (f.delay_ms < 0 || f.delay_ms > 60000) {
    s = InvalidArgument("--delay-ms must be in 0..60000");
  } else {
    f.relay.delay = std::chrono::nanoseconds(static_cast<int64_t>(f.delay_ms * 1e6 + 0.5));
    s = run_relay(f.relay);
  }
  if (s.ok()) return 0;
  std::cerr << "ecx relay: " << s.to_string() << "\n";
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

void add_relay_command(CLI::App& app, int* exit_code) {
  auto f = std::make_shared<RelayFlags>();
  CLI::App* r = app.add_subcommand(
      "relay",
      "Delaying TCP relay between test hosts (scripts/hosts; docs/HOSTS.md); --echo and --probe "
      "measure the round trip");
  r->add_option("--listen", f->relay.listen, "HOST:PORT to accept on (relay and --echo)")
      ->capture_default_str();
  r->add_option("--delay-ms", f->delay_ms, "One-way delay of every byte and EOF (RTT/2)")
      ->capture_default_str();
  r->add_option("--buffer-bytes", f->relay.buffer_bytes,
                "Bytes held per direction of a connection before reading stops")
      ->capture_default_str();
  r->add_option("--max-connections", f->relay.max_connections,
                "Connections relayed at once; more are refused")
      ->capture_default_str();
  r->add_flag("--echo", f->echo, "Echo server instead of a relay (the far end of --probe)");
  r->add_flag("--once", f->once, "--echo: exit after the first connection");
  r->add_option("--probe", f->probe, "HOST:PORT of an echo server: measure the round trip");
  r->add_option("--count", f->count, "--probe: round trips")->capture_default_str();
  r->add_option("--bytes", f->bytes, "--probe: message size")->capture_default_str();
  r->add_flag("--json", f->json, "--probe: print JSON");
  r->callback([f, exit_code] { *exit_code = run(*f); });
}

}  // namespace ecx::relay
