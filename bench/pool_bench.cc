#include "pool_bench.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/common/checksum.h"

namespace ecx::bench {
namespace {

using json = nlohmann::json;

struct ReaderSamples {
  std::vector<int64_t> find_ns;
  std::vector<int64_t> pin_ns;
  uint64_t failures = 0;
};

int64_t ns_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count();
}

MmHash key(const char* kind, uint64_t i) { return MmHash::sha256_of({kind, std::to_string(i)}); }

void read_loop(cache::EncoderCachePool& pool, const PoolBenchOptions& o, int reader,
               const std::atomic<bool>& stop, ReaderSamples& out) {
  const std::string holder = "reader-" + std::to_string(reader);
  for (uint64_t i = reader; !stop.load(std::memory_order_relaxed); ++i) {
    MmHash h = key("small", i % static_cast<uint64_t>(o.entries));
    auto t0 = Clock::now();
    Result<cache::BlockRef> found = pool.find(h);
    out.find_ns.push_back(ns_since(t0));
    t0 = Clock::now();
    Result<cache::Pin> pin = pool.pin(h, holder);
    out.pin_ns.push_back(ns_since(t0));
    if (!found.ok() || !pin.ok() || !pool.unpin(pin->pin_id).ok()) out.failures++;
    if (o.reader_pause_us > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(o.reader_pause_us));
  }
}

// Saves items of o.item_bytes until `stop`; returns how many.
uint64_t write_loop(cache::EncoderCachePool& pool, const PoolBenchOptions& o,
                    const std::atomic<bool>& stop, uint64_t& failures) {
  const TensorMeta meta{DType::kU8, {static_cast<int64_t>(o.item_bytes)}};
  std::vector<std::byte> payload(o.item_bytes);
  fill_pattern(payload.data(), payload.size(), 7);
  uint64_t saved = 0;
  for (uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
    if (pool.put(key("large", i), meta, payload).ok()) {
      saved++;
    } else {
      failures++;
    }
  }
  return saved;
}

// Percentiles of latencies in ns, in microseconds. A save that holds the pool's lock
// stalls each reader once, so the stalls are a few samples among millions: the tail
// (p99.9, max) and the count of samples over 100 us show them; p99 alone may not.
json summary_json(const char* name, std::vector<int64_t> ns) {
  std::sort(ns.begin(), ns.end());
  auto at = [&ns](double q) {
    if (ns.empty()) return 0.0;
    size_t i = std::min(ns.size() - 1, static_cast<size_t>(q * static_cast<double>(ns.size())));
    return static_cast<double>(ns[i]) / 1000.0;
  };
  auto over = std::count_if(ns.begin(), ns.end(), [](int64_t v) { return v > 100'000; });
  return {{name,
           {{"samples", ns.size()},
            {"p50_us", at(0.50)},
            {"p99_us", at(0.99)},
            {"p999_us", at(0.999)},
            {"max_us", ns.empty() ? 0.0 : static_cast<double>(ns.back()) / 1000.0},
            {"over_100us", over}}}};
}

}  // namespace

int run_pool_bench(const PoolBenchOptions& o) {
  transfer::AgentConfig agent_config;
  agent_config.name = "pool-bench";
  auto agent = transfer::Agent::create(agent_config);
  if (!agent.ok()) {
    std::cerr << "ecx bench pool: " << agent.status().to_string() << "\n";
    return 1;
  }
  const uint64_t capacity = 24 * o.item_bytes + (64ull << 20);
  auto pool =
      cache::EncoderCachePool::create(agent->get(), {.name = "bench", .capacity_bytes = capacity});
  if (!pool.ok()) {
    std::cerr << "ecx bench pool: " << pool.status().to_string() << "\n";
    return 1;
  }
  const TensorMeta small{DType::kBF16, {16, 1024}};
  std::vector<std::byte> bytes(small.byte_size());
  for (int i = 0; i < o.entries; ++i) {
    if (!(*pool)->put(key("small", i), small, bytes).ok()) return 1;
  }
  std::atomic<bool> stop{false};
  std::vector<ReaderSamples> samples(o.readers);
  std::vector<std::thread> readers;
  for (int r = 0; r < o.readers; ++r) {
    readers.emplace_back([&, r] { read_loop(**pool, o, r, stop, samples[r]); });
  }
  uint64_t write_failures = 0;
  uint64_t saved = 0;
  std::thread writer([&] { saved = write_loop(**pool, o, stop, write_failures); });
  std::this_thread::sleep_for(std::chrono::duration<double>(o.seconds));
  stop = true;
  writer.join();
  for (auto& t : readers) t.join();

  ReaderSamples all;
  for (auto& s : samples) {
    all.find_ns.insert(all.find_ns.end(), s.find_ns.begin(), s.find_ns.end());
    all.pin_ns.insert(all.pin_ns.end(), s.pin_ns.begin(), s.pin_ns.end());
    all.failures += s.failures;
  }
  json out = {{"bench", "pool-contention"},
              {"readers", o.readers},
              {"reader_pause_us", o.reader_pause_us},
              {"seconds", o.seconds},
              {"item_bytes", o.item_bytes},
              {"saves", saved},
              {"saves_per_s", static_cast<double>(saved) / o.seconds},
              {"read_failures", all.failures},
              {"write_failures", write_failures}};
  out.update(summary_json("find", std::move(all.find_ns)));
  out.update(summary_json("pin", std::move(all.pin_ns)));
  std::cout << out.dump(2) << "\n";
  if (!o.json_path.empty()) std::ofstream(o.json_path) << out.dump(2) << "\n";
  return all.failures == 0 && write_failures == 0 ? 0 : 1;
}

void add_pool_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<PoolBenchOptions>();
  CLI::App* c = bench.add_subcommand(
      "pool", "Pool contention: readers find and pin while a writer saves large items");
  c->add_option("--readers", o->readers, "Reader threads")->capture_default_str();
  c->add_option("--seconds", o->seconds, "How long to run")->capture_default_str();
  c->add_option("--reader-pause-us", o->reader_pause_us,
                "Each reader's pause between operations (0: readers spin, and on a machine with "
                "fewer cores than threads the figures measure the scheduler)")
      ->capture_default_str();
  c->add_option("--item-bytes", o->item_bytes, "Bytes of each item the writer saves")
      ->capture_default_str();
  c->add_option("--json", o->json_path, "Write the figures here");
  c->callback([o, exit_code] { *exit_code = run_pool_bench(*o); });
}

}  // namespace ecx::bench
