// `ecx bench peers`: ecx side by side with the engines users would otherwise pick, on
// this machine, in one run, with the same two-process layout and the same items:
//   ecx        p2p pull (the connector, producer in its own process) over shm and tcp;
//   memcpy, tcp-socket   the physical limits (from `ecx bench transfer`'s baselines);
//   nixl, nixl-2step, nixl-eccpu, mooncake   the real engines through their own Python APIs,
//              run by bench/python/peers.py from the project venv (installed on demand, pinned):
//              nixl-2step is the seed's protocol on real NIXL (per item an address query, then
//              a READ), nixl-eccpu vLLM's ECCPUConnector protocol on real NIXL (per item a ZMQ
//              XferReq/XferAck carrying the producer's descriptors, then a READ of its blocks).
// A row that cannot run keeps its place with `error` set; the command fails only on its
// own errors.
#include "peers_bench.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "charts.h"
#include "connector_bench.h"
#include "ecx/common/bytes.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/subprocess.h"
#include "progress.h"
#include "python_harness.h"

namespace ecx::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct PeersOptions {
  std::string json_path = "bench_peers.json";
  std::string venv;  // default: .venv at the repository root
  int iters = 100;
  std::string systems = "ecx,memcpy,tcp-socket,nixl,nixl-2step,nixl-eccpu,mooncake";
};

// The request shapes: 1 and 3 items of 1600 KiB (the seed's request), and 8 MiB.
struct Shape {
  int items;
  uint64_t item_bytes;
};
constexpr Shape kShapes[] = {{1, 1600 * 1024}, {3, 1600 * 1024}, {1, 8ull << 20}};

json row(const std::string& system, const std::string& transport, const std::string& variant,
         const Shape& shape) {
  return {{"system", system},
          {"transport", transport},
          {"variant", variant},
          {"items", shape.items},
          {"item_bytes", shape.item_bytes},
          {"p50_us", nullptr},
          {"p99_us", nullptr},
          {"gbps", nullptr},
          {"control_rtts_per_item", 0},
          {"verified_bytes", 0},
          {"error", nullptr}};
}

bool wanted(const PeersOptions& o, const std::string& system) {
  return ("," + o.systems + ",").find("," + system + ",") != std::string::npos;
}

// ecx: the p2p connector's pull, producer in its own process, per shape and transport;
// on shm also the zero-copy pull ("view": the consumer reads E's block in place).
void ecx_rows(const PeersOptions& o, std::vector<json>& rows) {
  for (const char* transport : {"shm", "tcp"}) {
    const bool shm = std::string(transport) == "shm";
    for (const char* variant : {"pull", "view"}) {
      if (!shm && std::string(variant) == "view") continue;
      for (const Shape& shape : kShapes) {
        ConnectorBenchOptions c{
            .connectors = std::string(variant) == "view" ? "p2p:pull-view" : "p2p:pull",
            .items = shape.items,
            .item_bytes = shape.item_bytes,
            .requests = o.iters,
            .backend = shm ? "auto" : "tcp"};
        json r = row("ecx", transport, variant, shape);
        auto measured = run_connector_bench(c, current_executable());
        if (measured.empty() || !measured[0].error.empty()) {
          r["error"] = measured.empty() ? "no result" : measured[0].error;
        } else {
          const ConnectorRow& m = measured[0];
          r["p50_us"] = m.p50_us;
          r["p99_us"] = m.p99_us;
          r["gbps"] = m.gbps;
          r["control_rtts_per_item"] = m.control_rtts_per_item;
          // Every block is checked before use: its header and generation, and over tcp the
          // payload's xxh3; on shm the header again after the copy (untorn), or, for a
          // view, the consumer's own pin taken before the header check.
          r["verified_bytes"] = shape.item_bytes * shape.items * static_cast<uint64_t>(o.iters);
        }
        rows.push_back(std::move(r));
      }
    }
  }
}

// memcpy and one blocking tcp socket, the limits, measured by `ecx bench transfer` on
// each request's total size.
void baseline_rows(const PeersOptions& o, const fs::path& dir, std::vector<json>& rows) {
  std::string sizes;
  for (const Shape& s : kShapes)
    sizes += (sizes.empty() ? "" : ",") + format_bytes(s.items * s.item_bytes);
  const std::string out = (dir / "baselines.json").string();
  auto run = Subprocess::spawn({current_executable(), "bench", "transfer", "--backends", "shm",
                                "--modes", "pull", "--sizes", sizes, "--batch", "1", "--iters",
                                std::to_string(o.iters), "--json", out});
  Status status = run.status();
  if (run.ok()) {
    while (run->read_line(Deadline::after_ms(600000)).ok()) {
    }
    auto code = run->wait(Deadline::after_ms(60000));
    if (!code.ok() || *code != 0) status = Internal("bench transfer failed");
  }
  std::ifstream in(out);
  auto parsed = parse_json_object(std::string(std::istreambuf_iterator<char>(in), {}), "baselines");
  for (const char* name : {"memcpy", "tcp-socket"}) {
    if (!wanted(o, name)) continue;
    for (const Shape& shape : kShapes) {
      json r = row(name, std::string(name) == "memcpy" ? "shm" : "tcp", "", shape);
      r["error"] = status.ok() ? json("not measured") : json(status.to_string());
      if (parsed.ok() && (*parsed).contains("baselines")) {
        for (const auto& b : (*parsed)["baselines"]) {
          if (b.value("name", "") != name ||
              b.value("size_bytes", uint64_t{0}) != shape.items * shape.item_bytes) {
            continue;
          }
          r["p50_us"] = b["p50_us"];
          r["p99_us"] = b.contains("p99_us") ? b["p99_us"] : b["p50_us"];
          r["gbps"] = b["gbps"];
          r["error"] = nullptr;  // verified_bytes stays 0: the limits move unchecked bytes
        }
      }
      rows.push_back(std::move(r));
    }
  }
}

// The systems bench/python/peers.py measures, in its order.
constexpr const char* kPeerSystems[] = {"nixl", "nixl-2step", "nixl-eccpu", "mooncake"};

// nixl, nixl-2step, nixl-eccpu and mooncake through bench/python/peers.py; on failure, one row
// per wanted system and shape saying why.
void peer_rows(const PeersOptions& o, const fs::path& dir, std::vector<json>& rows) {
  std::string systems;
  for (const char* s : kPeerSystems) {
    if (wanted(o, s)) systems += (systems.empty() ? "" : ",") + std::string(s);
  }
  if (systems.empty()) return;
  Status status = Status::Ok();
  const std::string out = (dir / "peers.json").string();
  auto venv = find_python_harness("peers.py", o.venv, ".venv");
  if (!venv.ok()) status = venv.status();
  if (status.ok()) {
    auto run = Subprocess::spawn({venv->python.string(), venv->script.string(), "run", "--json",
                                  out, "--systems", systems, "--iters", std::to_string(o.iters),
                                  "--sizes", "1x1600KiB,3x1600KiB,1x8MiB"});
    status = run.status();
    if (run.ok()) {
      while (run->read_line(Deadline::after_ms(1800000)).ok()) {
      }
      auto code = run->wait(Deadline::after_ms(60000));
      if (!code.ok() || *code != 0) status = Internal("bench/python/peers.py run failed");
    }
  }
  std::ifstream in(out);
  auto parsed = parse_json_object(std::string(std::istreambuf_iterator<char>(in), {}), "peers");
  if (status.ok() && parsed.ok() && (*parsed).contains("results")) {
    for (const auto& r : (*parsed)["results"]) rows.push_back(r);
    return;
  }
  std::string why = status.ok() ? "peers.py wrote no results" : status.to_string();
  for (const char* s : kPeerSystems) {
    if (!wanted(o, s)) continue;
    const std::string system = s;
    for (const Shape& shape : kShapes) {
      json r = row(system, "tcp", "", shape);
      r["error"] = why;
      // As peers.py reports them: one control round trip per item before its READ.
      if (system == "nixl-2step" || system == "nixl-eccpu") r["control_rtts_per_item"] = 1;
      rows.push_back(std::move(r));
    }
  }
}

std::string label(const json& r) {
  std::string variant = r["variant"].is_string() ? r["variant"].get<std::string>() : "";
  return r["system"].get<std::string>() + (variant.empty() ? "" : " " + variant) + " " +
         r["transport"].get<std::string>() + " " + std::to_string(r["items"].get<int>()) + "x" +
         format_bytes(r["item_bytes"].get<uint64_t>());
}

void print_table(const std::vector<json>& rows) {
  std::printf("\n%-34s %10s %10s %8s %6s %s\n", "case", "p50 us", "p99 us", "GB/s", "rtts",
              "verified / error");
  for (const auto& r : rows) {
    if (!r["error"].is_null()) {
      std::printf("%-34s %s\n", label(r).c_str(), r["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("%-34s %10.1f %10.1f %8.2f %6.0f %s\n", label(r).c_str(), r["p50_us"].get<double>(),
                r["p99_us"].get<double>(), r["gbps"].get<double>(),
                r["control_rtts_per_item"].get<double>(),
                format_bytes(r["verified_bytes"].get<uint64_t>()).c_str());
  }
}

void write_chart(const PeersOptions& o, const std::vector<json>& rows) {
  BarChart chart{.title = "ecx bench peers: latency per request (bar p50, whisker p99)",
                 .y_label = "microseconds (log scale)",
                 .log_scale = true};
  for (const auto& r : rows) {
    if (!r["error"].is_null()) continue;
    chart.bars.push_back({label(r), r["p50_us"].get<double>(), r["p99_us"].get<double>()});
  }
  if (chart.bars.empty()) return;
  std::string png = chart_path_for(o.json_path);
  Status s = write_bar_chart(chart, png);
  std::printf("%s\n", s.ok() ? ("wrote " + png).c_str() : s.message().c_str());
}

int run_peers(const PeersOptions& o) {
  fs::path dir = fs::temp_directory_path() / ("ecx-bench-peers-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::vector<json> rows;
  Progress progress("bench peers", 3);
  if (wanted(o, "ecx")) ecx_rows(o, rows);
  progress.advance();
  if (wanted(o, "memcpy") || wanted(o, "tcp-socket")) baseline_rows(o, dir, rows);
  progress.advance();
  peer_rows(o, dir, rows);
  progress.finish();
  std::error_code ec;
  fs::remove_all(dir, ec);
  print_table(rows);
  if (fs::path parent = fs::path(o.json_path).parent_path(); !parent.empty()) {
    fs::create_directories(parent, ec);
  }
  std::ofstream f(o.json_path);
  f << json{{"results", rows}}.dump(2) << "\n";
  if (!f) {
    std::fprintf(stderr, "bench peers: cannot write %s\n", o.json_path.c_str());
    return 1;
  }
  std::printf("\nwrote %s\n", o.json_path.c_str());
  write_chart(o, rows);
  return 0;
}

}  // namespace

void add_peers_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<PeersOptions>();
  CLI::App* s = bench.add_subcommand(
      "peers",
      "ecx next to memcpy, a tcp socket, NIXL (plain, the seed's protocol, vLLM's ECCPUConnector "
      "protocol) and Mooncake, on this machine, in one run");
  s->add_option("--json", o->json_path, "Write the rows here (and a PNG chart beside it)")
      ->capture_default_str();
  s->add_option("--venv", o->venv,
                "Python environment with the peers (default: .venv of the repo)");
  s->add_option("--iters", o->iters, "Timed requests per row")->capture_default_str();
  s->add_option("--systems", o->systems, "Rows to run")->capture_default_str();
  s->callback([o, exit_code] { *exit_code = run_peers(*o); });
}

}  // namespace ecx::bench
