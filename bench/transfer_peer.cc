#include "transfer_peer.h"

#include "ecx/common/json_reader.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <list>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "ecx/common/auth.h"
#include "ecx/common/checksum.h"
#include "ecx/common/log.h"
#include "ecx/transfer/agent.h"
#include "ecx/transfer/cuda_memory.h"
#include "wire/socket.h"

namespace ecx::bench {
namespace {

using nlohmann::json;
using transfer::Agent;
using transfer::LocalRegion;
using transfer::UniqueFd;

// The tcp-socket baseline: one plain blocking stream per connection, default buffers.
// Request: 8-byte length. Reply: that many bytes of the source region.
void serve_baseline(int listen_fd, const LocalRegion& source) {
  std::list<std::thread> threads;
  while (true) {
    auto accepted = transfer::accept_connection(listen_fd);
    if (!accepted.ok() || !accepted->valid()) break;
    int fd = accepted->release();
    threads.emplace_back([fd, source] {
      UniqueFd conn(fd);
      uint64_t length = 0;
      while (transfer::recv_all(fd, &length, sizeof(length), Deadline::never(), "baseline request")
                 .ok()) {
        if (length > source.length) break;
        if (!transfer::send_all(fd, source.data, length, Deadline::never(), "baseline reply").ok())
          break;
      }
    });
  }
  for (auto& t : threads) t.join();
}

Result<json> parse_request(std::string_view text) {
  auto j = parse_json_object(text, "bench peer request");
  if (!j.ok() || !JsonReader(*j, "bench peer request").string("op", Presence::kRequired).ok()) {
    return InvalidArgument("bench peer: request is not a JSON object with an 'op'");
  }
  return j;
}

Result<transfer::AgentConfig> agent_config(const TransferPeerOptions& options) {
  transfer::AgentConfig config{.name = options.name,
                               .compat_hash = options.compat_hash,
                               .tcp_host = options.tcp_host,
                               .tcp_slice_bytes = options.tcp_slice_bytes,
                               .tcp_streams = options.tcp_streams};
  ECX_ASSIGN_OR_RETURN(config.auth_secret, load_secret("", options.auth_token_file));
  if (!options.ucx.empty()) {
    config.ucx = {.enable = true,
                  .library = options.ucx_library,
                  .tls = options.ucx == "default" ? std::string() : options.ucx,
                  .error_mode = options.ucx_error_mode};
  }
  return config;
}

// What the producer serves: its agent, a source region filled with the pattern, a sink
// region peers may write, and the verdicts on the notifications that arrived so far.
struct Producer {
  Agent* agent = nullptr;
  LocalRegion source, sink;
  bool source_on_gpu = false;  // the source is CUDA device memory (--memory cuda)
  std::atomic<uint64_t> notified_ok{0}, notified_bad{0};
};

// Whether a notification {"offset","length","checksum"} matches the sink's bytes now.
bool notification_matches(const LocalRegion& sink, const std::string& message) {
  auto j = parse_json_object(message, "notification");
  if (!j.ok()) return false;
  JsonReader r(*j, "notification");
  auto off = r.u64("offset", Presence::kRequired);
  auto len = r.u64("length", Presence::kRequired);
  auto sum = r.u64("checksum", Presence::kRequired);
  if (!off.ok() || !len.ok() || !sum.ok()) return false;
  bool fits = *off <= sink.length && *len <= sink.length - *off;
  return fits && checksum64(sink.data + *off, *len) == *sum;
}

Result<std::string> connect_back(Agent* agent, const json& req) {
  ECX_ASSIGN_OR_RETURN(auto meta,
                       transfer::AgentMetadata::parse(req.at("metadata").get<std::string>()));
  ECX_ASSIGN_OR_RETURN(auto backend, transfer::parse_backend(req.value("backend", "auto")));
  agent->disconnect(meta.name);
  ECX_RETURN_IF_ERROR(agent->connect(meta, {.backend = backend}).status());
  return std::string("ok");
}

Result<std::string> push_items(Agent* agent, const LocalRegion& src, const json& req) {
  std::vector<transfer::TransferDescriptor> descs;
  for (const auto& item : req.at("items")) {
    uint64_t s = item.at("src"), len = item.at("len");
    if (s > src.length || len > src.length - s)
      return OutOfRange("push: source range outside region");
    descs.push_back(
        {src.data + s, item.at("dst_region").get<uint32_t>(), item.at("dst").get<uint64_t>(), len});
  }
  ECX_ASSIGN_OR_RETURN(auto handle, agent->write(req.at("peer").get<std::string>(), descs));
  ECX_RETURN_IF_ERROR(handle.wait(Deadline::after_ms(30000)));
  return std::string("ok");
}

Result<std::string> item_address(const LocalRegion& src, const json& req) {
  uint64_t item = req.at("item"), size = req.at("size");
  if (size == 0 || item >= src.length / size)
    return NotFound("addr: no item " + std::to_string(item));
  return json{{"region", src.id}, {"offset", item * size}, {"length", size}}.dump();
}

Result<std::string> region_checksum(const Producer& p, const json& req) {
  uint32_t region = req.at("region");
  uint64_t off = req.at("offset"), len = req.at("length");
  const LocalRegion& r = region == p.source.id ? p.source : p.sink;
  if (region != p.source.id && region != p.sink.id) return NotFound("checksum: no such region");
  if (off > r.length || len > r.length - off) return OutOfRange("checksum: range outside region");
  if (region == p.source.id && p.source_on_gpu) {
    std::vector<std::byte> host(len);  // device bytes are hashed from a host copy
    ECX_RETURN_IF_ERROR(transfer::cuda::copy(host.data(), r.data + off, len));
    return json{{"checksum", checksum64(host.data(), len)}}.dump();
  }
  return json{{"checksum", checksum64(r.data + off, len)}}.dump();
}

// A source region in CUDA device memory (--memory cuda), freed after the agent is gone.
class DeviceSource {
 public:
  DeviceSource() = default;
  DeviceSource(const DeviceSource&) = delete;
  DeviceSource& operator=(const DeviceSource&) = delete;
  ~DeviceSource() { transfer::cuda::device_free(data_); }

  Result<LocalRegion> create(Agent& agent, const std::vector<std::byte>& pattern) {
    ECX_ASSIGN_OR_RETURN(data_, transfer::cuda::device_alloc(pattern.size()));
    ECX_RETURN_IF_ERROR(transfer::cuda::copy(data_, pattern.data(), pattern.size()));
    return agent.register_memory(data_, pattern.size(), transfer::MemoryKind::kCuda);
  }

 private:
  void* data_ = nullptr;
};

// Answers one CALL (the ops listed in transfer_peer.h).
Result<std::string> answer_call(Producer& p, std::string_view body) {
  ECX_ASSIGN_OR_RETURN(json req, parse_request(body));
  std::string op = req["op"];
  try {
    if (op == "connect") return connect_back(p.agent, req);
    if (op == "push") return push_items(p.agent, p.source, req);
    if (op == "addr") return item_address(p.source, req);
    if (op == "checksum") return region_checksum(p, req);
    if (op == "stats") {
      auto st = p.agent->stats();
      return json{{"rejected_requests", st.rejected_requests},
                  {"handshakes_rejected", st.handshakes_rejected},
                  {"notifications_received", st.notifications_received}}
          .dump();
    }
    if (op == "notified") {
      return json{{"ok", p.notified_ok.load()}, {"bad", p.notified_bad.load()}}.dump();
    }
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("bench peer: malformed request: ") + e.what());
  }
  return InvalidArgument("bench peer: unknown op '" + op + "'");
}

// The producer's source (host, or a GPU copy of `pattern`, which the baseline then
// serves from the host) and its sink, both filled in `producer`.
Status set_up_regions(Agent& agent, const TransferPeerOptions& options, DeviceSource& device,
                      std::vector<std::byte>& pattern, Producer& producer) {
  const bool on_gpu = options.memory == "cuda";
  fill_pattern(pattern.data(), pattern.size(), options.seed);
  auto source = on_gpu ? device.create(agent, pattern) : agent.allocate(options.region_bytes);
  auto sink = agent.allocate(options.region_bytes, {.remote_read = true, .remote_write = true});
  if (!source.ok() || !sink.ok()) return source.ok() ? sink.status() : source.status();
  if (!on_gpu) fill_pattern(source->data, source->length, options.seed);
  producer.agent = &agent;
  producer.source = *source;
  producer.source_on_gpu = on_gpu;
  producer.sink = *sink;
  return Status::Ok();
}

}  // namespace

int run_transfer_peer(const TransferPeerOptions& options,
                      const std::function<void(transfer::Agent&)>& prepare) {
  Producer producer;    // outlives the agent, whose handlers use it
  DeviceSource device;  // likewise: the agent deregisters it before it is freed
  auto config = agent_config(options);
  if (!config.ok()) {
    std::cerr << "bench peer: " << config.status().to_string() << "\n";
    return 1;
  }
  auto created = Agent::create(*config);
  if (!created.ok()) {
    std::cerr << "bench peer: " << created.status().to_string() << "\n";
    return 1;
  }
  std::unique_ptr<Agent> agent = std::move(*created);
  if (prepare) prepare(*agent);
  const bool on_gpu = options.memory == "cuda";
  std::vector<std::byte> pattern(on_gpu ? options.region_bytes : 0);
  if (Status s = set_up_regions(*agent, options, device, pattern, producer); !s.ok()) {
    std::cerr << "bench peer: cannot allocate regions: " << s.to_string() << "\n";
    return 1;
  }
  // Runs on the connection thread, in order with the sender's calls: a later "notified"
  // call sees every earlier notification's verdict.
  agent->set_notification_handler([&producer](transfer::Notification n) {
    (notification_matches(producer.sink, n.message) ? producer.notified_ok
                                                    : producer.notified_bad)++;
  });
  agent->set_call_handler([&producer](const transfer::Caller&, std::string_view body) {
    return answer_call(producer, body);
  });

  const std::string host = agent->config().tcp_host;  // loopback unless it has a secret
  auto baseline = transfer::listen_tcp(host, 0);
  if (!baseline.ok()) {
    std::cerr << "bench peer: " << baseline.status().to_string() << "\n";
    return 1;
  }
  int baseline_fd = baseline->first.get();
  LocalRegion src = producer.source;
  if (on_gpu) src.data = pattern.data();
  std::thread baseline_thread([baseline_fd, src] { serve_baseline(baseline_fd, src); });

  json ready = {{"metadata", agent->metadata().to_json()}, {"host", host},
                {"baseline_port", baseline->second},       {"seed", options.seed},
                {"source_region", producer.source.id},     {"sink_region", producer.sink.id}};
  // One write, newline included: an agent's log line (stdout, other threads) cannot cut it.
  const std::string line = ready.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);

  // Serve until the parent closes our stdin (or dies).
  char buf[256];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  ::shutdown(baseline_fd, SHUT_RDWR);
  baseline_thread.join();
  agent.reset();  // deregisters the device source before `device` frees it
  return 0;
}

}  // namespace ecx::bench
