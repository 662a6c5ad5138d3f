#include "connector_bench.h"
#include "ecx/common/json_reader.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "bench_stats.h"
#include "ecx/common/bytes.h"
#include "ecx/common/checksum.h"
#include "ecx/common/subprocess.h"
#include "ecx/connector/ec_connector.h"
#include "netns.h"

namespace ecx::bench {
namespace {

using connector::EcTransferParams;
using nlohmann::json;

// Control round trips an item needs before its data can move.
// Control round trips per item: pull-2step's lookup per item; pull-view's renew call, one
// per request.
double control_rtts(const std::string& name, int items) {
  if (name == "p2p:pull-2step") return 1.0;
  if (name == "p2p:pull-view") return 1.0 / std::max(1, items);
  return 0.0;
}

class Producer {
 public:
  static Result<Producer> start(const std::string& exe, const json& config,
                                const std::string& netns) {
    ECX_ASSIGN_OR_RETURN(Subprocess p,
                         Subprocess::spawn(in_netns(
                             netns, {exe, "bench", "connector-peer", "--config", config.dump()})));
    Producer producer(std::move(p));
    ECX_ASSIGN_OR_RETURN(std::string ready, producer.process_.read_line(Deadline::after_ms(30000)));
    if (ready.rfind("ok", 0) != 0) return Unavailable("producer did not start: " + ready);
    return producer;
  }
  Result<std::string> command(const std::string& line) {
    ECX_RETURN_IF_ERROR(process_.write_stdin(line + "\n"));
    ECX_ASSIGN_OR_RETURN(std::string reply, process_.read_line(Deadline::after_ms(60000)));
    if (reply.rfind("ok", 0) != 0) return Internal("producer: " + reply);
    return reply.size() > 3 ? reply.substr(3) : std::string();
  }
  ~Producer() {
    if (process_.pid() > 0) {
      command("quit").status().ignore_error();
      process_.close_stdin();
      process_.wait(Deadline::after_ms(10000)).status().ignore_error();
    }
  }
  Producer(Producer&&) = default;

 private:
  explicit Producer(Subprocess p) : process_(std::move(p)) {}
  Subprocess process_;
};

// The config both sides share: pool, timeouts, the connector's own settings, security.
json connector_extra(const ConnectorBenchOptions& o, const std::string& name,
                     const std::string& tag, const std::filesystem::path& disk_root,
                     const std::string& security) {
  auto colon = name.find(':');
  std::string kind = name.substr(0, colon);
  uint64_t pool = std::max<uint64_t>(64ull << 20, 8ull * o.items * (o.item_bytes + 4096));
  json extra = {{"pool_bytes", pool}, {"load_timeout_ms", 30000}, {"compat_hash", "bench"}};
  if (kind == "p2p") {
    extra["mode"] = colon == std::string::npos ? "pull" : name.substr(colon + 1);
    extra["backend"] = o.backend;
    if (extra["mode"] == "pull-view") {  // pull with zero_copy: the consumer reads in place
      extra["mode"] = "pull";
      extra["zero_copy"] = true;
    } else if (extra["mode"] == "pull-unchecked") {
      // pull with no xxh3 of the loaded bytes: what the checksum costs
      extra["mode"] = "pull";
      extra["checksum"] = "off";
    }
  }
  if (kind == "disk") {
    extra["root"] = disk_root.string();
    extra["delete_on_release"] = true;
  }
  if (kind == "store") extra["redis"] = o.redis;
  if (security == "on") {
    extra["auth_token"] = "bench-" + tag + "-" + std::to_string(::getpid());
  } else {
    extra["require_grants"] = false;
  }
  return extra;
}

// Items of the seed's geometry when sizes allow: bf16 [tokens, 2048].
TensorMeta item_meta(uint64_t item_bytes) {
  return item_bytes % 4096 == 0 ? TensorMeta{DType::kBF16, {int64_t(item_bytes / 4096), 2048}}
                                : TensorMeta{DType::kU8, {int64_t(item_bytes)}};
}

// "d0,d1,...", as the producer's save command takes a shape.
std::string dims_text(const TensorMeta& meta) {
  std::string dims;
  for (size_t i = 0; i < meta.shape.size(); ++i) {
    // Appended piecewise: `"," + std::to_string(...)` trips GCC 12's false -Wrestrict at -O3.
    if (i > 0) dims += ',';
    dims += std::to_string(meta.shape[i]);
  }
  return dims;
}

// One request of the measurement: its items saved on the producer (item i filled with
// the pattern of seeds[i]), and the load request that names them.
struct BenchRequest {
  connector::LoadRequest load;
  std::vector<uint64_t> seeds;
};

Result<BenchRequest> save_request(Producer& producer, int items, const TensorMeta& meta,
                                  const std::string& tag, int r) {
  BenchRequest req;
  req.load.request_id = "bench-" + std::to_string(r);
  for (int i = 0; i < items; ++i) {
    MmHash h = MmHash::sha256_of({"bench", tag, std::to_string(r), std::to_string(i)});
    uint64_t seed = 1000003ull * r + i;
    ECX_ASSIGN_OR_RETURN(
        std::string saved,
        producer.command("save " + h.str() + " " + std::to_string(seed) + " " +
                         std::string(dtype_name(meta.dtype)) + " " + dims_text(meta)));
    ECX_ASSIGN_OR_RETURN(json saved_json, parse_json_object(saved, "saved params"));
    ECX_ASSIGN_OR_RETURN(auto params, EcTransferParams::from_json(saved_json));
    req.load.items.push_back({h, meta, params});
    req.seeds.push_back(seed);
  }
  return req;
}

// Loads `req` and returns how long the load took; checks the bytes outside that time.
Result<int64_t> timed_load(connector::EcConnector& consumer, const BenchRequest& req, int r) {
  auto t0 = Clock::now();
  auto out = consumer.load(req.load, Deadline::after_ms(30000));
  auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  // The row shows a failed load with its code.
  if (!out.status.ok()) return Status(out.status.code(), out.status.to_string());
  std::vector<std::byte> expected(req.load.items.front().meta.byte_size());
  for (size_t i = 0; i < req.seeds.size(); ++i) {
    fill_pattern(expected.data(), expected.size(), req.seeds[i]);
    auto ref = consumer.loaded(req.load.request_id, req.load.items[i].mm_hash);
    if (!ref.ok() || std::memcmp(ref->payload(), expected.data(), expected.size()) != 0) {
      return Status(StatusCode::kDataLoss, "wrong bytes for item " + std::to_string(i) +
                                               " of request " + std::to_string(r));
    }
  }
  return elapsed;
}

// Evicts this core's caches (ConnectorBenchOptions::cold_cache): writes a scratch buffer
// of 8x the last-level cache (64 MiB where the size is unknown), a new value each time.
void evict_caches() {
  static std::vector<std::byte> scratch = [] {
    long llc = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    return std::vector<std::byte>(llc > 0 ? 8 * static_cast<size_t>(llc) : 64u << 20);
  }();
  static unsigned char value = 0;
  std::memset(scratch.data(), ++value, scratch.size());
}

// Per-request load latencies in nanoseconds, after 3 untimed warm-up requests.
Result<std::vector<int64_t>> time_requests(const ConnectorBenchOptions& o, Producer& producer,
                                           connector::EcConnector& consumer,
                                           const std::string& tag) {
  const int warmup = 3;
  const TensorMeta meta = item_meta(o.item_bytes);
  std::vector<int64_t> samples;
  for (int r = 0; r < o.requests + warmup; ++r) {
    ECX_ASSIGN_OR_RETURN(BenchRequest req, save_request(producer, o.items, meta, tag, r));
    if (o.cold_cache) evict_caches();
    ECX_ASSIGN_OR_RETURN(int64_t elapsed, timed_load(consumer, req, r));
    consumer.request_finished(req.load.request_id);
    if (r >= warmup) samples.push_back(elapsed);
  }
  return samples;
}

// The producer pool's bytes used per payload byte (p2p), 0 where it reports none.
double producer_pool_overhead(Producer& producer) {
  auto stats = producer.command("stats");
  if (!stats.ok()) return 0;
  auto j = parse_json_object(*stats, "producer stats");
  if (!j.ok()) return 0;
  auto pool = JsonReader(*j, "producer stats").child("producer_pool");
  if (!pool.ok()) return 0;
  auto overhead = pool->number("bytes_used_per_payload_byte");
  return overhead.ok() ? *overhead : 0;
}

// One connector's row: a producer process and a consumer here, `requests` timed loads.
Status measure(const ConnectorBenchOptions& o, const std::string& exe, const json& extra,
               const std::string& tag, ConnectorRow& row) {
  std::string kind = row.connector.substr(0, row.connector.find(':'));
  json producer_extra = extra;
  producer_extra["engine_id"] = "bench-e-" + tag;
  if (!o.peer_netns.empty()) producer_extra["tcp_host"] = o.peer_host;
  ECX_ASSIGN_OR_RETURN(
      Producer producer,
      Producer::start(exe, {{"connector", kind}, {"role", "producer"}, {"extra", producer_extra}},
                      o.peer_netns));
  connector::ConnectorConfig cc;
  cc.connector = kind;
  cc.role = connector::Role::kConsumer;
  cc.extra = extra;
  cc.extra["engine_id"] = "bench-pd-" + tag;
  if (!o.peer_netns.empty()) cc.extra["tcp_host"] = o.consumer_host;
  cc.extra["failure_policy"] = "fail";
  ECX_ASSIGN_OR_RETURN(auto consumer, connector::create_connector(cc));
  ECX_ASSIGN_OR_RETURN(auto samples, time_requests(o, producer, *consumer, tag));
  LatencySummary s = summarize(samples);
  row.p50_us = s.p50_us;
  row.p99_us = s.p99_us;
  row.mean_us = s.mean_us;
  for (int64_t ns : samples) row.samples_us.push_back(std::round(ns / 100.0) / 10.0);  // 0.1 us
  row.gbps = gbps(o.item_bytes * o.items * static_cast<uint64_t>(o.requests), s.total_seconds);
  row.control_rtts_per_item = control_rtts(row.connector, o.items);
  row.bytes_used_per_payload_byte = producer_pool_overhead(producer);
  return Status::Ok();
}

ConnectorRow run_one(const ConnectorBenchOptions& o, const std::string& exe,
                     const std::string& name, int index, const std::string& security) {
  ConnectorRow row;
  row.connector = name;
  row.security = security;
  row.cold_cache = o.cold_cache;
  row.items = o.items;
  row.item_bytes = o.item_bytes;
  row.requests = o.requests;
  std::string tag = std::to_string(::getpid()) + "-" + std::to_string(index);
  auto root = std::filesystem::temp_directory_path() / ("ecx-bench-disk-" + tag);
  Status measured =
      !o.peer_netns.empty() && security == "off"
          ? Status(StatusCode::kFailedPrecondition,
                   "security off: agents without a secret listen on loopback only, out of reach "
                   "of network namespace " +
                       o.peer_netns)
          : measure(o, exe, connector_extra(o, name, tag, root, security), tag, row);
  if (!measured.ok()) row.error = measured.message();
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return row;
}

}  // namespace

std::vector<ConnectorRow> run_connector_bench(const ConnectorBenchOptions& o,
                                              const std::string& exe) {
  std::vector<std::string> names, modes;
  std::stringstream ss(o.connectors), sec(o.security);
  for (std::string name; std::getline(ss, name, ',');) {
    if (!name.empty()) names.push_back(name);
  }
  for (std::string m; std::getline(sec, m, ',');) {
    if (m == "on" || m == "off") modes.push_back(m);
  }
  if (modes.empty()) modes.push_back("on");
  std::vector<ConnectorRow> rows;
  int index = 0;
  for (int round = 0; round < std::max(1, o.rounds); ++round) {
    for (const auto& name : names) {
      for (const auto& mode : modes) {  // alternated: loopback noise hits both alike
        rows.push_back(run_one(o, exe, name, index++, mode));
        rows.back().round = round;
      }
    }
  }
  return rows;
}

namespace {

// Median over rounds of p50(on) / p50(off) for `connector`; 0 if not measured both ways.
double security_ratio(const std::vector<ConnectorRow>& rows, const std::string& connector) {
  std::map<int, std::pair<double, double>> by_round;
  for (const auto& r : rows) {
    if (r.connector != connector || !r.error.empty()) continue;
    (r.security == "on" ? by_round[r.round].first : by_round[r.round].second) = r.p50_us;
  }
  std::vector<double> ratios;
  for (const auto& [round, p] : by_round) {
    if (p.first > 0 && p.second > 0) ratios.push_back(p.first / p.second);
  }
  if (ratios.empty()) return 0;
  std::sort(ratios.begin(), ratios.end());
  size_t n = ratios.size();
  return n % 2 ? ratios[n / 2] : (ratios[n / 2 - 1] + ratios[n / 2]) / 2;
}

}  // namespace

void print_connector_rows(const std::vector<ConnectorRow>& rows) {
  double pull_2step = 0;
  for (const auto& r : rows) {
    if (r.connector == "p2p:pull-2step" && r.error.empty()) pull_2step = r.p50_us;
  }
  std::printf("\n%-15s %4s %6s %9s %9s %10s %10s %8s %6s %10s  %s\n", "connector", "sec", "items",
              "item", "requests", "p50(us)", "p99(us)", "GB/s", "ctrl", "pool B/B",
              "p50 vs pull-2step");
  for (const auto& r : rows) {
    if (!r.error.empty()) {
      std::printf("%-15s skipped: %s\n", r.connector.c_str(), r.error.c_str());
      continue;
    }
    std::printf("%-15s %4s %6d %9s %9d %10.1f %10.1f %8.2f %6.1f %10.4f  ", r.connector.c_str(),
                r.security.c_str(), r.items, format_bytes(r.item_bytes).c_str(), r.requests,
                r.p50_us, r.p99_us, r.gbps, r.control_rtts_per_item, r.bytes_used_per_payload_byte);
    if (pull_2step > 0) std::printf("%.2fx", r.p50_us / pull_2step);
    std::printf("\n");
  }
  std::set<std::string> done;
  for (const auto& r : rows) {
    if (!done.insert(r.connector).second) continue;
    double ratio = security_ratio(rows, r.connector);
    if (ratio > 0) {
      std::printf(
          "%s: p50 with authentication and grant checks / without: %.3fx (median over "
          "rounds)\n",
          r.connector.c_str(), ratio);
    }
  }
}

json connector_rows_json(const std::vector<ConnectorRow>& rows) {
  json out = json::array();
  for (const auto& r : rows) {
    json j = {{"connector", r.connector},
              {"security", r.security},
              {"cold_cache", r.cold_cache},
              {"round", r.round},
              {"items", r.items},
              {"item_bytes", r.item_bytes},
              {"requests", r.requests},
              {"p50_us", r.p50_us},
              {"p99_us", r.p99_us},
              {"mean_us", r.mean_us},
              {"gbps", r.gbps},
              {"control_rtts_per_item", r.control_rtts_per_item},
              {"bytes_used_per_payload_byte", r.bytes_used_per_payload_byte},
              {"samples_us", r.samples_us}};
    if (!r.error.empty()) j["error"] = r.error;
    out.push_back(j);
  }
  return out;
}

}  // namespace ecx::bench
