#include "transfer_peer.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <list>
#include <nlohmann/json.hpp>
#include <thread>

#include "ecx/common/checksum.h"
#include "ecx/common/log.h"
#include "ecx/transfer/agent.h"
#include "transfer/socket.h"

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
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("op") || !j["op"].is_string()) {
    return InvalidArgument("bench peer: request is not a JSON object with an 'op'");
  }
  return j;
}

}  // namespace

int run_transfer_peer(const TransferPeerOptions& options) {
  transfer::AgentConfig config;
  config.name = options.name;
  config.compat_hash = options.compat_hash;
  config.tcp_slice_bytes = options.tcp_slice_bytes;
  config.tcp_streams = options.tcp_streams;
  config.fault_stall_read_after_bytes = options.fault_stall_read_after_bytes;
  auto created = Agent::create(config);
  if (!created.ok()) {
    std::cerr << "bench peer: " << created.status().to_string() << "\n";
    return 1;
  }
  std::unique_ptr<Agent> agent = std::move(*created);
  auto source = agent->allocate(options.region_bytes);
  auto sink = agent->allocate(options.region_bytes, {.remote_read = true, .remote_write = true});
  if (!source.ok() || !sink.ok()) {
    std::cerr << "bench peer: cannot allocate regions\n";
    return 1;
  }
  fill_pattern(source->data, source->length, options.seed);

  std::atomic<uint64_t> notified_ok{0}, notified_bad{0};
  LocalRegion sink_region = *sink;
  // Runs on the connection thread, in order with the sender's calls: a later "notified"
  // call sees every earlier notification's verdict.
  agent->set_notification_handler(
      [&notified_ok, &notified_bad, sink_region](transfer::Notification n) {
        json j = json::parse(n.message, nullptr, false);
        if (j.is_discarded() || !j.contains("offset") || !j.contains("length") ||
            !j.contains("checksum")) {
          notified_bad++;
          return;
        }
        if (!j["offset"].is_number_unsigned() || !j["length"].is_number_unsigned() ||
            !j["checksum"].is_number_unsigned()) {
          notified_bad++;
          return;
        }
        uint64_t off = j["offset"].get<uint64_t>(), len = j["length"].get<uint64_t>();
        bool fits = off <= sink_region.length && len <= sink_region.length - off;
        bool ok = fits && checksum64(sink_region.data + off, len) == j["checksum"].get<uint64_t>();
        (ok ? notified_ok : notified_bad)++;
      });

  Agent* a = agent.get();
  LocalRegion src = *source, dst = *sink;
  agent->set_call_handler([&, a, src, dst](const std::string&,
                                           std::string_view body) -> Result<std::string> {
    ECX_ASSIGN_OR_RETURN(json req, parse_request(body));
    std::string op = req["op"];
    try {
      if (op == "connect") {
        ECX_ASSIGN_OR_RETURN(auto meta,
                             transfer::AgentMetadata::parse(req.at("metadata").get<std::string>()));
        ECX_ASSIGN_OR_RETURN(auto backend, transfer::parse_backend(req.value("backend", "auto")));
        a->disconnect(meta.name);
        ECX_RETURN_IF_ERROR(a->connect(meta, {.backend = backend}).status());
        return std::string("ok");
      }
      if (op == "push") {
        std::vector<transfer::TransferDescriptor> descs;
        for (const auto& item : req.at("items")) {
          uint64_t s = item.at("src"), len = item.at("len");
          if (s > src.length || len > src.length - s)
            return OutOfRange("push: source range outside region");
          descs.push_back({src.data + s, item.at("dst_region").get<uint32_t>(),
                           item.at("dst").get<uint64_t>(), len});
        }
        ECX_ASSIGN_OR_RETURN(auto handle, a->write(req.at("peer").get<std::string>(), descs));
        ECX_RETURN_IF_ERROR(handle.wait(Deadline::after_ms(30000)));
        return std::string("ok");
      }
      if (op == "addr") {
        uint64_t item = req.at("item"), size = req.at("size");
        if (size == 0 || item >= src.length / size)
          return NotFound("addr: no item " + std::to_string(item));
        return json{{"region", src.id}, {"offset", item * size}, {"length", size}}.dump();
      }
      if (op == "checksum") {
        uint32_t region = req.at("region");
        uint64_t off = req.at("offset"), len = req.at("length");
        const LocalRegion& r = region == src.id ? src : dst;
        if (region != src.id && region != dst.id) return NotFound("checksum: no such region");
        if (off > r.length || len > r.length - off)
          return OutOfRange("checksum: range outside region");
        return json{{"checksum", checksum64(r.data + off, len)}}.dump();
      }
      if (op == "stats") {
        auto st = a->stats();
        return json{{"rejected_requests", st.rejected_requests},
                    {"handshakes_rejected", st.handshakes_rejected},
                    {"notifications_received", st.notifications_received}}
            .dump();
      }
      if (op == "notified") {
        return json{{"ok", notified_ok.load()}, {"bad", notified_bad.load()}}.dump();
      }
    } catch (const json::exception& e) {
      return InvalidArgument(std::string("bench peer: malformed request: ") + e.what());
    }
    return InvalidArgument("bench peer: unknown op '" + op + "'");
  });

  auto baseline = transfer::listen_tcp("127.0.0.1", 0);
  if (!baseline.ok()) {
    std::cerr << "bench peer: " << baseline.status().to_string() << "\n";
    return 1;
  }
  int baseline_fd = baseline->first.get();
  std::thread baseline_thread([baseline_fd, src] { serve_baseline(baseline_fd, src); });

  json ready = {{"metadata", agent->metadata().to_json()},
                {"baseline_port", baseline->second},
                {"seed", options.seed},
                {"source_region", src.id},
                {"sink_region", dst.id}};
  std::cout << ready.dump() << std::endl;

  // Serve until the parent closes our stdin (or dies).
  char buf[256];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  ::shutdown(baseline_fd, SHUT_RDWR);
  baseline_thread.join();
  agent.reset();
  return 0;
}

}  // namespace ecx::bench
