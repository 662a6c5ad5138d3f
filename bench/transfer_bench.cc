// `ecx bench transfer`: the transfer engine against the limits of this machine.
// Two processes: this one (consumer) and a spawned `ecx bench transfer-peer` (producer).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "transfer_bench.h"

#include "bench.h"
#include "bench_stats.h"
#include "charts.h"
#include "connector_bench.h"
#include "connector_peer.h"
#include "ecx/common/auth.h"
#include "ecx/common/bytes.h"
#include "ecx/common/checksum.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/log.h"
#include "ecx/common/subprocess.h"
#include "ecx/transfer/agent.h"
#include "netns.h"
#include "transfer_peer.h"
#include "transfer_results.h"
#include "wire/socket.h"

namespace ecx::bench {
namespace {

// The 2-step baseline's address reply {"region","offset","length"} as a READ of `size`
// bytes into `local`.
Result<transfer::TransferDescriptor> parse_address(const std::string& reply, void* local,
                                                   uint64_t size) {
  auto j = parse_json_object(reply, "addr reply");
  if (!j.ok()) return Internal("bad addr reply: " + reply);
  JsonReader r(*j, "addr reply");
  auto region = r.u64("region", Presence::kRequired, UINT32_MAX);
  auto offset = r.u64("offset", Presence::kRequired);
  auto length = r.u64("length", Presence::kRequired);
  if (!region.ok() || !offset.ok() || !length.ok() || *length != size) {
    return Internal("bad addr reply: " + reply);
  }
  return transfer::TransferDescriptor{local, static_cast<uint32_t>(*region), *offset, *length};
}

using nlohmann::json;
using transfer::Agent;
using transfer::Backend;
using transfer::TransferDescriptor;

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    if (comma > start) out.push_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// Why the bench stops early: the line it prints after "bench transfer: " and its exit
// code (2: bad flags, 1: a failure while measuring).
struct EarlyExit {
  int code = 1;
  std::string line;
};
EarlyExit usage_error(std::string line) { return {2, std::move(line)}; }
EarlyExit failure(std::string line) { return {1, std::move(line)}; }

constexpr uint64_t kPeerSeed = 20261130;

// Runs as: parse flags -> start the agent and the producer -> baselines, cases, baselines
// again -> connector rows -> JSON -> stop the producer.
class TransferBench {
 public:
  explicit TransferBench(TransferBenchOptions options) : options_(std::move(options)) {}
  int run();

 private:
  std::optional<EarlyExit> parse_flags();
  std::optional<EarlyExit> parse_lists();
  std::optional<EarlyExit> start();
  Status start_agent();
  Status start_peer();
  Status resolve_hosts();
  Status report_auto_backend();
  Status restart_with_ucx(const std::string& tls);
  std::optional<EarlyExit> measure_transfers();
  std::optional<EarlyExit> measure_backend(Backend backend);
  std::optional<EarlyExit> measure_ucx(const std::string& tls);
  std::optional<EarlyExit> measure_connectors();
  std::optional<EarlyExit> write_json() const;
  void write_chart() const;
  void stop_peer();
  Result<Row> run_case(Backend backend, const std::string& mode, uint64_t size, int batch);
  Result<std::vector<int64_t>> time_pull(const std::vector<TransferDescriptor>& descs);
  Result<std::vector<int64_t>> time_pull_2step(const std::vector<TransferDescriptor>& descs,
                                               uint64_t size);
  Result<std::vector<int64_t>> time_push(uint64_t size, int batch);
  Status verify(const std::string& mode, uint64_t size, int batch);
  Result<std::vector<Baseline>> measure_baselines();
  Result<std::vector<Baseline>> average_with_second_run(const std::vector<Baseline>& before);
  Result<Baseline> memcpy_baseline(uint64_t size);
  Result<Baseline> socket_baseline(uint64_t size);
  Result<Baseline> measure_baseline(const std::string& name, uint64_t size) {
    return name == "memcpy" ? memcpy_baseline(size) : socket_baseline(size);
  }

  TransferBenchOptions options_;
  std::vector<uint64_t> sizes_;
  std::vector<int> batches_;
  std::vector<Backend> backends_;
  std::vector<std::string> modes_;
  uint64_t region_bytes_ = 0;
  std::optional<Subprocess> peer_process_;
  std::unique_ptr<Agent> agent_;
  transfer::LocalRegion dest_;
  transfer::AgentMetadata peer_;
  std::string peer_name_;
  uint32_t source_region_ = 0;
  uint16_t baseline_port_ = 0;
  // Across network namespaces (--peer-netns): the producer's address, ours, and the
  // deployment secret both agents need to listen beyond loopback.
  std::string peer_host_ = "127.0.0.1";
  std::string consumer_host_;
  std::string secret_;
  std::string auto_backend_;          // what `auto` picked for the producer (--peer-netns)
  std::vector<std::byte> reference_;  // the producer's source pattern, for verification
  std::vector<Row> rows_;
  std::vector<Baseline> baselines_;
  std::vector<Baseline> perftest_;  // ucx_perftest, per UCX_TLS and size
  std::vector<ConnectorRow> connector_rows_;
  // The UCX_TLS of the agents' ucx backend while ucx rows are measured; unset: ucx off.
  std::optional<std::string> ucx_tls_;
};

int TransferBench::run() {
  std::optional<EarlyExit> stop = parse_flags();
  if (!stop) stop = start();
  if (!stop) stop = measure_transfers();
  if (!stop) stop = measure_connectors();
  if (!stop) stop = write_json();
  if (stop) {
    std::cerr << "bench transfer: " << stop->line << "\n";
    return stop->code;
  }
  stop_peer();
  for (const auto& r : connector_rows_) {
    if (!r.error.empty() && r.connector != "store") return 1;  // store may lack a Redis
  }
  return 0;
}

std::optional<EarlyExit> TransferBench::parse_flags() {
  if (auto stop = parse_lists()) return stop;
  if (options_.iters < 1) return usage_error("--iters must be at least 1");
  uint64_t max_size = *std::max_element(sizes_.begin(), sizes_.end());
  int max_batch = *std::max_element(batches_.begin(), batches_.end());
  region_bytes_ = max_size * static_cast<uint64_t>(max_batch);
  if (region_bytes_ == 0 || region_bytes_ > (8ull << 30)) {
    return usage_error("sizes x batch must be between 1 B and 8 GiB");
  }
  return std::nullopt;
}

// --sizes, --batch, --backends and --modes.
std::optional<EarlyExit> TransferBench::parse_lists() {
  auto sizes = parse_byte_list(options_.sizes);
  if (!sizes.ok()) return usage_error("--sizes: " + sizes.status().message());
  sizes_ = *sizes;
  for (const auto& b : split(options_.batches)) {
    int v = std::atoi(b.c_str());
    if (v <= 0 || v > 1024)
      return usage_error("--batch: '" + b + "' is not a batch size in 1..1024");
    batches_.push_back(v);
  }
  const bool netns = !options_.peer_netns.empty();
  if (netns && !options_.backends_given) options_.backends = "tcp";
  for (const auto& b : split(options_.backends == "none" ? "" : options_.backends)) {
    auto parsed = transfer::parse_backend(b);
    if (!parsed.ok() || *parsed == Backend::kAuto) {
      return usage_error("--backends: '" + b + "' (expected shm, tcp or ucx)");
    }
    if (netns && *parsed == Backend::kShm) {
      return usage_error("--backends shm cannot reach a producer in another network namespace");
    }
    backends_.push_back(*parsed);
  }
  const std::string& mode = options_.ucx_error_mode;
  if (mode != "auto" && mode != "peer" && mode != "none") {
    return usage_error("--ucx-error-mode: '" + mode + "' (expected auto, peer or none)");
  }
  if (options_.ucx_tls.empty()) return usage_error("--ucx-tls: no transports");
  modes_ = split(options_.modes);
  for (const auto& m : modes_) {
    if (m != "pull" && m != "push" && m != "pull-2step") {
      return usage_error("--modes: unknown mode '" + m + "'");
    }
  }
  return std::nullopt;
}

// The consumer agent and its destination region; the producer when a backend is measured.
std::optional<EarlyExit> TransferBench::start() {
  Status st = options_.peer_netns.empty() ? Status::Ok() : resolve_hosts();
  if (st.ok()) st = start_agent();
  if (st.ok() && !backends_.empty()) st = start_peer();
  if (st.ok() && !backends_.empty() && !options_.peer_netns.empty()) st = report_auto_backend();
  if (!st.ok()) return failure(st.to_string());
  if (!backends_.empty()) {
    std::printf("ecx bench transfer: producer pid %d, consumer pid %d, %d iterations per case\n",
                peer_process_->pid(), ::getpid(), options_.iters);
  }
  return std::nullopt;
}

Status TransferBench::start_agent() {
  transfer::AgentConfig config{.name = "bench-consumer",
                               .tcp_slice_bytes = options_.slice_bytes,
                               .tcp_streams = options_.streams};
  if (!secret_.empty()) {
    config.tcp_host = consumer_host_;
    config.auth_secret = secret_;
  }
  if (ucx_tls_) {
    config.ucx = {.enable = true,
                  .library = options_.ucx_library,
                  .tls = *ucx_tls_ == "default" ? std::string() : *ucx_tls_,
                  .error_mode = options_.ucx_error_mode};
  }
  ECX_ASSIGN_OR_RETURN(agent_, Agent::create(config));
  ECX_ASSIGN_OR_RETURN(
      dest_, agent_->allocate(region_bytes_, {.remote_read = true, .remote_write = true}));
  return Status::Ok();
}

Status TransferBench::start_peer() {
  TransferPeerOptions peer{.region_bytes = region_bytes_,
                           .seed = kPeerSeed,
                           .tcp_slice_bytes = options_.slice_bytes,
                           .tcp_streams = options_.streams};
  if (ucx_tls_) {
    peer.ucx = *ucx_tls_;
    peer.ucx_error_mode = options_.ucx_error_mode;
    peer.ucx_library = options_.ucx_library;
  }
  std::optional<SecretFile> secret_file;
  if (!secret_.empty()) {
    ECX_ASSIGN_OR_RETURN(secret_file, SecretFile::write(secret_));
    peer.tcp_host = peer_host_;
    peer.auth_token_file = secret_file->path();
  }
  ECX_ASSIGN_OR_RETURN(
      auto child, Subprocess::spawn(in_netns(options_.peer_netns,
                                             transfer_peer_command(current_executable(), peer))));
  peer_process_.emplace(std::move(child));
  ECX_ASSIGN_OR_RETURN(std::string line, peer_process_->read_line(Deadline::after_ms(30000)));
  secret_file.reset();  // read by now
  auto ready = parse_json_object(line, "bench peer's ready line");
  if (!ready.ok()) return Internal("bench peer printed no JSON: " + line);
  JsonReader r(*ready, "bench peer's ready line");
  ECX_ASSIGN_OR_RETURN(std::string metadata, r.string("metadata", Presence::kRequired, 1 << 24));
  ECX_ASSIGN_OR_RETURN(peer_, transfer::AgentMetadata::parse(metadata));
  peer_name_ = peer_.name;
  ECX_ASSIGN_OR_RETURN(uint64_t region, r.u64("source_region", Presence::kRequired, UINT32_MAX));
  source_region_ = static_cast<uint32_t>(region);
  ECX_ASSIGN_OR_RETURN(uint64_t port, r.u64("baseline_port", Presence::kRequired, 65535));
  baseline_port_ = static_cast<uint16_t>(port);
  ECX_ASSIGN_OR_RETURN(peer_host_, r.string("host", Presence::kOptional, 256, "127.0.0.1"));
  reference_.resize(region_bytes_);
  fill_pattern(reference_.data(), reference_.size(), kPeerSeed);
  return Status::Ok();
}

// --peer-netns: the producer listens on its namespace's address, we on ours towards it,
// both with a secret made for this run.
Status TransferBench::resolve_hosts() {
  ECX_ASSIGN_OR_RETURN(peer_host_, netns_address(options_.peer_netns));
  if (!options_.tcp_host.empty()) {
    consumer_host_ = options_.tcp_host;
  } else {
    ECX_ASSIGN_OR_RETURN(consumer_host_, local_address_towards(peer_host_));
  }
  secret_ = hex_encode(random_bytes(32).data(), 32);
  std::printf("producer in network namespace %s at %s, consumer at %s\n",
              options_.peer_netns.c_str(), peer_host_.c_str(), consumer_host_.c_str());
  return Status::Ok();
}

// Which backend `auto` picks for the producer: tcp (or ucx) between two hosts, not shm.
Status TransferBench::report_auto_backend() {
  ECX_RETURN_IF_ERROR(agent_->connect(peer_, {}).status());
  ECX_ASSIGN_OR_RETURN(Backend backend, agent_->peer_backend(peer_name_));
  auto_backend_ = std::string(transfer::backend_name(backend));
  agent_->disconnect(peer_name_);
  std::printf("backend auto picks %s for the producer\n", auto_backend_.c_str());
  return Status::Ok();
}

// Every case of every backend, between two measurements of the baselines.
std::optional<EarlyExit> TransferBench::measure_transfers() {
  if (backends_.empty()) return std::nullopt;
  auto before = measure_baselines();
  if (!before.ok()) return failure("baseline failed: " + before.status().to_string());
  for (Backend backend : backends_) {
    if (backend != Backend::kUcx) {
      if (auto stop = measure_backend(backend)) return stop;
      continue;
    }
    for (const auto& tls : options_.ucx_tls) {
      if (auto stop = measure_ucx(tls)) return stop;
    }
  }
  auto baselines = average_with_second_run(*before);
  if (!baselines.ok()) return failure("baseline failed: " + baselines.status().to_string());
  baselines_ = *baselines;
  baselines_.insert(baselines_.end(), perftest_.begin(), perftest_.end());
  if (!rows_.empty()) print_results(rows_, baselines_);
  return std::nullopt;
}

std::optional<EarlyExit> TransferBench::measure_backend(Backend backend) {
  agent_->disconnect(peer_name_);
  auto connected = agent_->connect(peer_, {.backend = backend});
  if (!connected.ok()) return failure(connected.status().to_string());
  if (std::find(modes_.begin(), modes_.end(), "push") != modes_.end()) {
    json req = {{"op", "connect"},
                {"metadata", agent_->metadata().to_json()},
                {"backend", std::string(transfer::backend_name(backend))}};
    auto r = agent_->call(peer_name_, req.dump(), Deadline::after_ms(10000));
    if (!r.ok()) return failure("producer cannot connect back: " + r.status().to_string());
  }
  for (const auto& mode : modes_) {
    for (uint64_t size : sizes_) {
      for (int batch : batches_) {
        auto row = run_case(backend, mode, size, batch);
        if (!row.ok()) return failure(row.status().to_string());
        rows_.push_back(*row);
      }
    }
  }
  return std::nullopt;
}

// Both agents restarted with ucx over `tls`; ucx_perftest with the same transports
// before and after the rows, averaged (as the other baselines are).
std::optional<EarlyExit> TransferBench::measure_ucx(const std::string& tls) {
  std::string mode = ucx_resolved_mode(options_.ucx_error_mode, tls);
  if (Status st = restart_with_ucx(tls); !st.ok()) {
    return failure("ucx with UCX_TLS '" + tls + "': " + st.to_string());
  }
  std::printf("%s: UCX_TLS=%s, error mode %s, producer pid %d\n", ucx_label(tls).c_str(),
              tls.c_str(), mode.c_str(), peer_process_->pid());
  auto perftest = [&] {
    return measure_ucx_perftest(options_.ucx_perftest, tls, mode, sizes_, options_.iters);
  };
  std::vector<Baseline> before = perftest();
  size_t first = rows_.size();
  if (auto stop = measure_backend(Backend::kUcx)) return stop;
  for (size_t i = first; i < rows_.size(); ++i) {
    rows_[i].ucx_tls = tls;
    rows_[i].ucx_error_mode = mode;
  }
  auto averaged = average_baselines(before, perftest());
  perftest_.insert(perftest_.end(), averaged.begin(), averaged.end());
  return std::nullopt;
}

std::optional<EarlyExit> TransferBench::measure_connectors() {
  if (options_.connectors.connectors.empty()) return std::nullopt;
  auto item = parse_bytes(options_.item_size);
  if (!item.ok() || *item == 0) {
    return usage_error("--item-size: " + options_.item_size + " is not a size");
  }
  options_.connectors.item_bytes = *item;
  if (!options_.peer_netns.empty()) {
    if (secret_.empty()) {
      if (Status st = resolve_hosts(); !st.ok()) return failure(st.to_string());
    }
    options_.connectors.peer_netns = options_.peer_netns;
    options_.connectors.peer_host = peer_host_;
    options_.connectors.consumer_host = consumer_host_;
  }
  std::printf("\nconnectors: %d requests of %d x %s each, producer in its own process\n",
              options_.connectors.requests, options_.connectors.items, format_bytes(*item).c_str());
  connector_rows_ = run_connector_bench(options_.connectors, current_executable());
  print_connector_rows(connector_rows_);
  return std::nullopt;
}

std::optional<EarlyExit> TransferBench::write_json() const {
  if (options_.json_path.empty()) return std::nullopt;
  json out = results_json(rows_, baselines_);
  if (!options_.peer_netns.empty()) {
    out["peer_netns"] = options_.peer_netns;
    if (!auto_backend_.empty()) out["auto_backend"] = auto_backend_;
  }
  if (!connector_rows_.empty()) out["connectors"] = connector_rows_json(connector_rows_);
  std::ofstream f(options_.json_path);
  f << out.dump(2) << "\n";
  if (!f) return failure("cannot write " + options_.json_path);
  std::printf("\nwrote %s\n", options_.json_path.c_str());
  write_chart();
  return std::nullopt;
}

// p50 per case, with a p99 whisker, next to the JSON.
void TransferBench::write_chart() const {
  BarChart chart{.title = "ecx bench transfer: latency per request (bar p50, whisker p99)",
                 .y_label = "microseconds (log scale)",
                 .log_scale = true};
  for (const auto& r : rows_) {
    std::string name = r.ucx_tls.empty() ? r.backend : r.backend + "(" + r.ucx_tls + ")";
    chart.bars.push_back(
        {name + " " + r.mode + " " + std::to_string(r.batch) + "x" + format_bytes(r.size), r.p50_us,
         r.p99_us});
  }
  std::string png = chart_path_for(options_.json_path);
  Status s = chart.bars.empty() ? Status::Ok() : write_bar_chart(chart, png);
  if (s.ok() && !chart.bars.empty()) std::printf("wrote %s\n", png.c_str());
  if (!s.ok()) std::printf("%s\n", s.message().c_str());
}

// Stops the producer and the agent, and starts both again with ucx over `tls`.
Status TransferBench::restart_with_ucx(const std::string& tls) {
  stop_peer();
  peer_process_.reset();
  dest_ = {};
  agent_.reset();
  ucx_tls_ = tls;
  ECX_RETURN_IF_ERROR(start_agent());
  return start_peer();
}

void TransferBench::stop_peer() {
  if (!peer_process_) return;
  agent_->disconnect(peer_name_);
  peer_process_->close_stdin();
  auto exited = peer_process_->wait(Deadline::after_ms(10000));
  if (!exited.ok() || *exited != 0) std::cerr << "bench transfer: producer did not exit cleanly\n";
}

Status TransferBench::verify(const std::string& mode, uint64_t size, int batch) {
  // Every mode lands item i of the source at offset i*size of our destination region.
  for (int i = 0; i < batch; ++i) {
    uint64_t off = static_cast<uint64_t>(i) * size;
    if (checksum64(dest_.data + off, size) != checksum64(reference_.data() + off, size)) {
      return Status(StatusCode::kDataLoss, mode + " " + format_bytes(size) + " item " +
                                               std::to_string(i) +
                                               ": bytes differ from the source");
    }
  }
  return Status::Ok();
}

Result<std::vector<int64_t>> TransferBench::time_pull(
    const std::vector<TransferDescriptor>& descs) {
  return time_iterations(options_.iters, [&]() -> Status {
    ECX_ASSIGN_OR_RETURN(auto h, agent_->read(peer_name_, descs));
    return h.wait(Deadline::after_ms(30000));
  });
}

// The seed's protocol: per item, ask the producer for the address, then READ it.
Result<std::vector<int64_t>> TransferBench::time_pull_2step(
    const std::vector<TransferDescriptor>& descs, uint64_t size) {
  return time_iterations(options_.iters, [&]() -> Status {
    for (size_t i = 0; i < descs.size(); ++i) {
      json q = {{"op", "addr"}, {"item", i}, {"size", size}};
      ECX_ASSIGN_OR_RETURN(std::string a,
                           agent_->call(peer_name_, q.dump(), Deadline::after_ms(30000)));
      ECX_ASSIGN_OR_RETURN(TransferDescriptor d, parse_address(a, descs[i].local, size));
      ECX_ASSIGN_OR_RETURN(auto h, agent_->read(peer_name_, {&d, 1}));
      ECX_RETURN_IF_ERROR(h.wait(Deadline::after_ms(30000)));
    }
    return Status::Ok();
  });
}

// Mooncake-style: one request listing our destinations; the producer writes into them.
Result<std::vector<int64_t>> TransferBench::time_push(uint64_t size, int batch) {
  json items = json::array();
  for (int i = 0; i < batch; ++i) {
    uint64_t off = static_cast<uint64_t>(i) * size;
    items.push_back({{"src", off}, {"dst_region", dest_.id}, {"dst", off}, {"len", size}});
  }
  std::string request = json{{"op", "push"}, {"peer", agent_->name()}, {"items", items}}.dump();
  return time_iterations(options_.iters, [&]() -> Status {
    return agent_->call(peer_name_, request, Deadline::after_ms(30000)).status();
  });
}

Result<Row> TransferBench::run_case(Backend backend, const std::string& mode, uint64_t size,
                                    int batch) {
  std::vector<TransferDescriptor> descs;
  for (int i = 0; i < batch; ++i) {
    uint64_t off = static_cast<uint64_t>(i) * size;
    descs.push_back({dest_.data + off, source_region_, off, size});
  }
  std::memset(dest_.data, 0, static_cast<size_t>(size) * batch);
  Row row{std::string(transfer::backend_name(backend)), mode, size, batch, options_.iters};
  Result<std::vector<int64_t>> samples = std::vector<int64_t>{};
  if (mode == "pull") {
    samples = time_pull(descs);
  } else if (mode == "pull-2step") {
    row.control_rtts_per_item = 1;
    samples = time_pull_2step(descs, size);
  } else if (mode == "push") {
    samples = time_push(size, batch);
  } else {
    return InvalidArgument("unknown mode '" + mode + "' (expected pull, push or pull-2step)");
  }
  if (!samples.ok())
    return samples.status().with_context(row.backend + " " + mode + " " + format_bytes(size));
  ECX_RETURN_IF_ERROR(verify(mode, size, batch));
  row.verified_bytes = size * static_cast<uint64_t>(batch);
  LatencySummary s = summarize(*samples);
  row.p50_us = s.p50_us;
  row.p99_us = s.p99_us;
  row.gbps = gbps(size * static_cast<uint64_t>(batch) * options_.iters, s.total_seconds);
  return row;
}

Result<std::vector<Baseline>> TransferBench::measure_baselines() {
  std::vector<Baseline> out;
  for (uint64_t size : sizes_) {
    for (const char* name : {"memcpy", "tcp-socket"}) {
      ECX_ASSIGN_OR_RETURN(Baseline b, measure_baseline(name, size));
      out.push_back(b);
    }
  }
  return out;
}

// Baselines measured before and after the cases and averaged, so they see the same
// machine state as the cases they are compared with.
Result<std::vector<Baseline>> TransferBench::average_with_second_run(
    const std::vector<Baseline>& before) {
  std::vector<Baseline> out;
  for (const Baseline& first : before) {
    ECX_ASSIGN_OR_RETURN(Baseline after, measure_baseline(first.name, first.size));
    Baseline b = first;
    b.gbps = (first.gbps + after.gbps) / 2;
    b.p50_us = (first.p50_us + after.p50_us) / 2;
    out.push_back(b);
  }
  return out;
}

Result<Baseline> TransferBench::memcpy_baseline(uint64_t size) {
  // The physical limit on this host: one memcpy of the same bytes between two buffers.
  std::vector<std::byte> dst(size);
  std::memset(dst.data(), 0, size);
  ECX_ASSIGN_OR_RETURN(auto samples, time_iterations(options_.iters, [&]() -> Status {
                         std::memcpy(dst.data(), reference_.data(), size);
                         return Status::Ok();
                       }));
  if (std::memcmp(dst.data(), reference_.data(), size) != 0)
    return Internal("memcpy baseline corrupt");
  LatencySummary s = summarize(samples);
  return Baseline{"memcpy", size, gbps(size * options_.iters, s.total_seconds), s.p50_us};
}

Result<Baseline> TransferBench::socket_baseline(uint64_t size) {
  // A plain blocking TCP socket, one stream, default buffers: request, then size bytes.
  ECX_ASSIGN_OR_RETURN(
      auto fd, transfer::connect_tcp({peer_host_, baseline_port_}, Deadline::after_ms(5000)));
  std::vector<std::byte> dst(size);
  ECX_ASSIGN_OR_RETURN(
      auto samples, time_iterations(options_.iters, [&]() -> Status {
        uint64_t len = size;
        ECX_RETURN_IF_ERROR(
            transfer::send_all(fd.get(), &len, sizeof(len), Deadline::never(), "baseline"));
        return transfer::recv_all(fd.get(), dst.data(), size, Deadline::never(), "baseline");
      }));
  if (std::memcmp(dst.data(), reference_.data(), size) != 0)
    return Internal("socket baseline corrupt");
  LatencySummary s = summarize(samples);
  return Baseline{"tcp-socket", size, gbps(size * options_.iters, s.total_seconds), s.p50_us};
}

}  // namespace

int run_transfer_bench(TransferBenchOptions options) {
  return TransferBench(std::move(options)).run();
}

}  // namespace ecx::bench
