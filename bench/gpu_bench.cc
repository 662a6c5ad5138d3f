// `ecx bench gpu-transfer`. The consumer (this process) and a producer (`ecx bench
// transfer-peer --memory cuda`) each register device memory with a ucx agent; the
// consumer READs the producer's VRAM into its own VRAM, checks every byte (through a host
// copy), and prints JSON rows next to cudaMemcpy of the same bytes on the same device.
#include "gpu_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <vector>

#include "bench_stats.h"
#include "ecx/common/bytes.h"
#include "ecx/common/checksum.h"
#include "ecx/common/json_reader.h"
#include "ecx/common/subprocess.h"
#include "ecx/transfer/agent.h"
#include "ecx/transfer/cuda_memory.h"
#include "transfer_peer.h"

namespace ecx::bench {
namespace {

using nlohmann::json;
namespace cuda = transfer::cuda;

struct GpuBenchOptions {
  std::string sizes = "1600KiB,8MiB";
  std::string batches = "1,8";
  int iters = 200;
  // UCX_TLS of both agents: CUDA IPC moves the bytes between the processes, cuda_copy
  // detects device memory, shared memory (and tcp) carry UCX's wire-up.
  std::string tls = "cuda_copy,cuda_ipc,posix,cma,tcp";
  std::string library = "wheel";
  std::string json_path;
  double target_ratio = 0.8;
};

constexpr uint64_t kSeed = 20261201;

// Device memory freed when it goes out of scope.
struct DeviceBuffer {
  void* data = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cuda::device_free(data); }
  Status allocate(uint64_t length) {
    ECX_ASSIGN_OR_RETURN(data, cuda::device_alloc(length));
    return cuda::fill(data, 0, length);
  }
  std::byte* bytes() const { return static_cast<std::byte*>(data); }
};

class GpuTransferBench {
 public:
  explicit GpuTransferBench(GpuBenchOptions options) : options_(std::move(options)) {}
  int run();

 private:
  Status parse();
  Status start_producer();
  Status start_consumer();
  Result<json> measure(uint64_t size, int batch);
  Result<json> memcpy_baseline(uint64_t size, int batch);
  Status verify(uint64_t bytes);
  int emit(json out, int code) const;

  GpuBenchOptions options_;
  std::vector<uint64_t> sizes_;
  std::vector<int> batches_;
  uint64_t region_bytes_ = 0;
  std::optional<Subprocess> producer_;
  transfer::AgentMetadata peer_;
  uint32_t source_region_ = 0;
  // Destroyed in reverse order: the agent (and its registration of dest_) before dest_.
  DeviceBuffer dest_, copy_src_;
  std::unique_ptr<transfer::Agent> agent_;
  std::vector<std::byte> expected_;
};

Status GpuTransferBench::parse() {
  ECX_ASSIGN_OR_RETURN(sizes_, parse_byte_list(options_.sizes));
  std::stringstream in(options_.batches);
  for (std::string b; std::getline(in, b, ',');) {
    int v = std::atoi(b.c_str());
    if (v < 1 || v > 64) return InvalidArgument("--batch: '" + b + "' is not in 1..64");
    batches_.push_back(v);
  }
  if (sizes_.empty() || batches_.empty() || options_.iters < 1) {
    return InvalidArgument("--sizes and --batch need a value each, --iters at least 1");
  }
  region_bytes_ = *std::max_element(sizes_.begin(), sizes_.end()) *
                  static_cast<uint64_t>(*std::max_element(batches_.begin(), batches_.end()));
  if (region_bytes_ > (8ull << 30)) return InvalidArgument("sizes x batch over 8 GiB");
  return Status::Ok();
}

Status GpuTransferBench::start_producer() {
  TransferPeerOptions peer{.name = "gpu-producer",
                           .region_bytes = region_bytes_,
                           .seed = kSeed,
                           .ucx = options_.tls.empty() ? "default" : options_.tls,
                           .ucx_library = options_.library,
                           .memory = "cuda"};
  ECX_ASSIGN_OR_RETURN(auto child,
                       Subprocess::spawn(transfer_peer_command(current_executable(), peer)));
  producer_.emplace(std::move(child));
  auto line = producer_->read_line(Deadline::after_ms(60000));
  if (!line.ok()) return line.status().with_context("the producer (ecx bench transfer-peer)");
  auto ready = parse_json_object(*line, "producer's ready line");
  if (!ready.ok()) return Internal("the producer printed no JSON: " + *line);
  JsonReader r(*ready, "producer's ready line");
  ECX_ASSIGN_OR_RETURN(std::string metadata, r.string("metadata", Presence::kRequired, 1 << 24));
  ECX_ASSIGN_OR_RETURN(peer_, transfer::AgentMetadata::parse(metadata));
  ECX_ASSIGN_OR_RETURN(uint64_t region, r.u64("source_region", Presence::kRequired, UINT32_MAX));
  source_region_ = static_cast<uint32_t>(region);
  expected_.resize(region_bytes_);
  fill_pattern(expected_.data(), expected_.size(), kSeed);
  return Status::Ok();
}

Status GpuTransferBench::start_consumer() {
  transfer::AgentConfig config{.name = "gpu-consumer"};
  config.ucx = {.enable = true, .library = options_.library, .tls = options_.tls};
  ECX_ASSIGN_OR_RETURN(agent_, transfer::Agent::create(config));
  ECX_RETURN_IF_ERROR(dest_.allocate(region_bytes_));
  ECX_RETURN_IF_ERROR(copy_src_.allocate(region_bytes_));
  ECX_RETURN_IF_ERROR(cuda::copy(copy_src_.data, expected_.data(), region_bytes_));
  ECX_RETURN_IF_ERROR(
      agent_->register_memory(dest_.data, region_bytes_, transfer::MemoryKind::kCuda).status());
  return agent_->connect(peer_, {.backend = transfer::Backend::kUcx}).status();
}

// Every byte READ into dest_ equals the producer's pattern (checked on a host copy).
Status GpuTransferBench::verify(uint64_t bytes) {
  std::vector<std::byte> host(bytes);
  ECX_RETURN_IF_ERROR(cuda::copy(host.data(), dest_.data, bytes));
  if (std::memcmp(host.data(), expected_.data(), bytes) != 0) {
    return Status(StatusCode::kDataLoss,
                  "the " + format_bytes(bytes) + " READ into VRAM differ from the producer's");
  }
  return Status::Ok();
}

Result<json> GpuTransferBench::measure(uint64_t size, int batch) {
  std::vector<transfer::TransferDescriptor> descs;
  for (int i = 0; i < batch; ++i) {
    uint64_t off = static_cast<uint64_t>(i) * size;
    descs.push_back({dest_.bytes() + off, source_region_, off, size});
  }
  const uint64_t bytes = size * static_cast<uint64_t>(batch);
  ECX_RETURN_IF_ERROR(cuda::fill(dest_.data, 0, bytes));
  ECX_ASSIGN_OR_RETURN(auto samples, time_iterations(options_.iters, [&]() -> Status {
                         ECX_ASSIGN_OR_RETURN(auto h, agent_->read(peer_.name, descs));
                         return h.wait(Deadline::after_ms(30000));
                       }));
  ECX_RETURN_IF_ERROR(verify(bytes));
  LatencySummary ecx = summarize(samples);
  ECX_ASSIGN_OR_RETURN(json base, memcpy_baseline(size, batch));
  double ecx_gbps = gbps(bytes * options_.iters, ecx.total_seconds);
  double ratio = base["gbps"].get<double>() > 0 ? ecx_gbps / base["gbps"].get<double>() : 0;
  return json{
      {"size_bytes", size},
      {"batch", batch},
      {"iters", options_.iters},
      {"ecx_ucx_read", {{"gbps", ecx_gbps}, {"p50_us", ecx.p50_us}, {"p99_us", ecx.p99_us}}},
      {"cuda_memcpy_d2d", base},
      {"ratio", ratio},
      {"meets_target", ratio >= options_.target_ratio}};
}

// cudaMemcpy device-to-device of the same bytes, in one call, on the same device.
Result<json> GpuTransferBench::memcpy_baseline(uint64_t size, int batch) {
  const uint64_t bytes = size * static_cast<uint64_t>(batch);
  ECX_ASSIGN_OR_RETURN(auto samples, time_iterations(options_.iters, [&]() -> Status {
                         return cuda::copy(dest_.data, copy_src_.data, bytes);
                       }));
  ECX_RETURN_IF_ERROR(verify(bytes));
  LatencySummary s = summarize(samples);
  return json{{"gbps", gbps(bytes * options_.iters, s.total_seconds)},
              {"p50_us", s.p50_us},
              {"p99_us", s.p99_us}};
}

int GpuTransferBench::emit(json out, int code) const {
  std::cout << out.dump(2) << std::endl;
  if (!options_.json_path.empty()) {
    std::ofstream f(options_.json_path);
    f << out.dump(2) << "\n";
    if (!f) {
      std::cerr << "bench gpu-transfer: cannot write " << options_.json_path << "\n";
      return 1;
    }
  }
  return code;
}

int GpuTransferBench::run() {
  json out = {{"bench", "gpu-transfer"},
              {"tls", options_.tls},
              {"ucx_library", options_.library},
              {"target_ratio", options_.target_ratio}};
  if (Status s = parse(); !s.ok()) {
    std::cerr << "bench gpu-transfer: " << s.to_string() << "\n";
    return 2;
  }
  auto device = cuda::describe_device();
  if (!device.ok()) {
    out["skipped"] = device.status().message();
    return emit(out, kNoGpuExitCode);
  }
  out["device"] = *device;
  Status s = start_producer();
  if (s.ok()) s = start_consumer();
  json rows = json::array();
  for (uint64_t size : sizes_) {
    for (int batch : batches_) {
      if (!s.ok()) break;
      auto row = measure(size, batch);
      if (!row.ok()) {
        s = row.status().with_context(format_bytes(size) + " x " + std::to_string(batch));
        break;
      }
      std::cerr << "gpu-transfer " << format_bytes(size) << " x " << batch << ": ecx "
                << (*row)["ecx_ucx_read"]["gbps"].get<double>() << " GB/s, cudaMemcpy "
                << (*row)["cuda_memcpy_d2d"]["gbps"].get<double>() << " GB/s\n";
      rows.push_back(*row);
    }
  }
  out["results"] = rows;
  if (agent_) agent_->disconnect(peer_.name);
  if (producer_) {
    producer_->close_stdin();
    producer_->wait(Deadline::after_ms(10000)).status().ignore_error();
  }
  if (!s.ok()) out["error"] = s.to_string();
  return emit(out, s.ok() ? 0 : 1);
}

}  // namespace

void add_gpu_transfer_command(CLI::App& bench, int* exit_code) {
  auto options = std::make_shared<GpuBenchOptions>();
  CLI::App* g = bench.add_subcommand(
      "gpu-transfer",
      "VRAM -> VRAM READ over ucx between two processes vs cudaMemcpy (needs a GPU; exit 77 "
      "without one)");
  g->add_option("--sizes", options->sizes, "Item sizes")->capture_default_str();
  g->add_option("--batch", options->batches, "Items per READ")->capture_default_str();
  g->add_option("--iters", options->iters, "Timed iterations per case")->capture_default_str();
  g->add_option("--tls", options->tls, "UCX_TLS of both agents")->capture_default_str();
  g->add_option("--ucx-library", options->library, "system, wheel or a libucp path")
      ->capture_default_str();
  g->add_option("--target", options->target_ratio, "Target ratio to cudaMemcpy")
      ->capture_default_str();
  g->add_option("--json", options->json_path, "Also write the JSON to this file");
  g->callback([options, exit_code] { *exit_code = GpuTransferBench(*options).run(); });
}

}  // namespace ecx::bench
