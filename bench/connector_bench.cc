#include "connector_bench.h"

#include <unistd.h>

#include <algorithm>
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

namespace ecx::bench {
namespace {

using connector::EcTransferParams;
using nlohmann::json;

// Control round trips an item needs before its data can move.
double control_rtts(const std::string& name) { return name == "p2p:pull-2step" ? 1.0 : 0.0; }

class Producer {
 public:
  static Result<Producer> start(const std::string& exe, const json& config) {
    ECX_ASSIGN_OR_RETURN(Subprocess p, Subprocess::spawn({exe, "bench", "connector-peer",
                                                          "--config", config.dump()}));
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

ConnectorRow run_one(const ConnectorBenchOptions& o, const std::string& exe,
                     const std::string& name, int index, const std::string& security) {
  ConnectorRow row;
  row.connector = name;
  row.security = security;
  row.items = o.items;
  row.item_bytes = o.item_bytes;
  row.requests = o.requests;
  auto colon = name.find(':');
  std::string kind = name.substr(0, colon);
  std::string tag = std::to_string(::getpid()) + "-" + std::to_string(index);
  auto root = std::filesystem::temp_directory_path() / ("ecx-bench-disk-" + tag);
  uint64_t pool = std::max<uint64_t>(64ull << 20, 8ull * o.items * (o.item_bytes + 4096));
  json extra = {{"pool_bytes", pool}, {"load_timeout_ms", 30000}, {"compat_hash", "bench"}};
  if (kind == "p2p") {
    extra["mode"] = colon == std::string::npos ? "pull" : name.substr(colon + 1);
    extra["backend"] = o.backend;
  }
  if (kind == "disk") {
    extra["root"] = root.string();
    extra["delete_on_release"] = true;
  }
  if (kind == "store") extra["redis"] = o.redis;
  if (security == "on") {
    extra["auth_token"] = "bench-" + tag + "-" + std::to_string(::getpid());
  } else {
    extra["require_grants"] = false;
  }
  json producer_extra = extra;
  producer_extra["engine_id"] = "bench-e-" + tag;
  auto producer =
      Producer::start(exe, {{"connector", kind}, {"role", "producer"}, {"extra", producer_extra}});
  if (!producer.ok()) {
    row.error = producer.status().message();
    return row;
  }
  connector::ConnectorConfig cc;
  cc.connector = kind;
  cc.role = connector::Role::kConsumer;
  cc.extra = extra;
  cc.extra["engine_id"] = "bench-pd-" + tag;
  cc.extra["failure_policy"] = "fail";
  auto consumer = connector::create_connector(cc);
  if (!consumer.ok()) {
    row.error = consumer.status().message();
    return row;
  }
  // Items of the seed's geometry when sizes allow: bf16 [tokens, 2048].
  TensorMeta meta = o.item_bytes % 4096 == 0
                        ? TensorMeta{DType::kBF16, {int64_t(o.item_bytes / 4096), 2048}}
                        : TensorMeta{DType::kU8, {int64_t(o.item_bytes)}};
  std::string dims;
  for (size_t i = 0; i < meta.shape.size(); ++i) {
    // Appended piecewise: `"," + std::to_string(...)` trips GCC 12's false -Wrestrict at -O3.
    if (i > 0) dims += ',';
    dims += std::to_string(meta.shape[i]);
  }
  std::vector<int64_t> samples;
  std::vector<std::byte> expected(meta.byte_size());
  int warmup = 3;
  for (int r = 0; r < o.requests + warmup; ++r) {
    connector::LoadRequest req;
    req.request_id = "bench-" + std::to_string(r);
    std::vector<uint64_t> seeds;
    for (int i = 0; i < o.items; ++i) {
      MmHash h = MmHash::sha256_of({"bench", tag, std::to_string(r), std::to_string(i)});
      uint64_t seed = 1000003ull * r + i;
      auto saved = producer->command("save " + h.str() + " " + std::to_string(seed) + " " +
                                     std::string(dtype_name(meta.dtype)) + " " + dims);
      if (!saved.ok()) {
        row.error = saved.status().message();
        return row;
      }
      auto params = EcTransferParams::from_json(json::parse(*saved, nullptr, false));
      if (!params.ok()) {
        row.error = params.status().message();
        return row;
      }
      req.items.push_back({h, meta, *params});
      seeds.push_back(seed);
    }
    auto t0 = Clock::now();
    auto out = (*consumer)->load(req, Deadline::after_ms(30000));
    auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    if (!out.status.ok()) {
      row.error = out.status.to_string();
      return row;
    }
    // Verify outside the timed region.
    for (int i = 0; i < o.items; ++i) {
      fill_pattern(expected.data(), expected.size(), seeds[i]);
      auto ref = (*consumer)->loaded(req.request_id, req.items[i].mm_hash);
      if (!ref.ok() || std::memcmp(ref->payload(), expected.data(), expected.size()) != 0) {
        row.error =
            "wrong bytes for item " + std::to_string(i) + " of request " + std::to_string(r);
        return row;
      }
    }
    (*consumer)->request_finished(req.request_id);
    if (r >= warmup) samples.push_back(elapsed);
  }
  LatencySummary s = summarize(samples);
  row.p50_us = s.p50_us;
  row.p99_us = s.p99_us;
  row.mean_us = s.mean_us;
  row.gbps = gbps(o.item_bytes * o.items * static_cast<uint64_t>(o.requests), s.total_seconds);
  row.control_rtts_per_item = control_rtts(name);
  if (auto stats = producer->command("stats"); stats.ok()) {
    json j = json::parse(*stats, nullptr, false);
    if (!j.is_discarded() && j.contains("producer_pool")) {
      row.bytes_used_per_payload_byte =
          j["producer_pool"]["bytes_used_per_payload_byte"].get<double>();
    }
  }
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
              {"round", r.round},
              {"items", r.items},
              {"item_bytes", r.item_bytes},
              {"requests", r.requests},
              {"p50_us", r.p50_us},
              {"p99_us", r.p99_us},
              {"mean_us", r.mean_us},
              {"gbps", r.gbps},
              {"control_rtts_per_item", r.control_rtts_per_item},
              {"bytes_used_per_payload_byte", r.bytes_used_per_payload_byte}};
    if (!r.error.empty()) j["error"] = r.error;
    out.push_back(j);
  }
  return out;
}

}  // namespace ecx::bench
