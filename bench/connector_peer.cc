#include "connector_peer.h"

#include <iostream>
#include <map>
#include <sstream>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "ecx/common/checksum.h"
#include "ecx/connector/ec_connector.h"
#include "ecx/transfer/agent.h"

namespace ecx::bench {
namespace {

using connector::EcConnector;
using nlohmann::json;

Result<TensorMeta> parse_meta(const std::string& dtype, const std::string& dims) {
  TensorMeta meta;
  ECX_ASSIGN_OR_RETURN(meta.dtype, dtype_from_name(dtype));
  std::stringstream ss(dims);
  std::string d;
  while (std::getline(ss, d, ',')) meta.shape.push_back(std::stoll(d));
  ECX_RETURN_IF_ERROR(meta.validate());
  return meta;
}

void reply(const Status& s) {
  std::cout << "error " << status_code_name(s.code()) << " " << s.message() << std::endl;
}

void reply_ok(const std::string& payload = "") {
  std::cout << "ok" << (payload.empty() ? "" : " " + payload) << std::endl;
}

}  // namespace

int run_connector_peer(const std::string& config_json) {
  // stdout carries the command protocol: logs go to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("connector-peer"));
  auto config = connector::ConnectorConfig::parse(config_json);
  if (!config.ok()) {
    std::cerr << "connector peer: " << config.status().to_string() << "\n";
    return 2;
  }
  auto created = connector::create_connector(*config);
  if (!created.ok()) {
    std::cerr << "connector peer: " << created.status().to_string() << "\n";
    return 1;
  }
  std::unique_ptr<EcConnector> conn = std::move(*created);
  std::unique_ptr<transfer::Agent> reader;  // for "read": a bare consumer agent
  std::map<std::string, connector::SaveSlot> begun;
  reply_ok(conn->name());  // ready

  std::string line;
  while (std::getline(std::cin, line)) {
    std::stringstream ss(line);
    std::string cmd;
    ss >> cmd;
    try {
      if (cmd == "save" || cmd == "begin") {
        std::string hash, dtype, dims;
        uint64_t seed = 0;
        ss >> hash;
        if (cmd == "save") ss >> seed;
        ss >> dtype >> dims;
        auto mm_hash = MmHash::parse(hash);
        auto meta = mm_hash.ok() ? parse_meta(dtype, dims) : Result<TensorMeta>(mm_hash.status());
        if (!meta.ok()) {
          reply(meta.status());
          continue;
        }
        auto slot = conn->begin_save(*mm_hash, *meta);
        if (cmd == "save" && slot.status().code() == StatusCode::kAlreadyExists) {
          // Saved before: fresh params for it, as an encoder answers a repeated image.
          auto again = conn->saved_params(*mm_hash);
          again.ok() ? reply_ok(again->to_json().dump()) : reply(again.status());
          continue;
        }
        if (!slot.ok()) {
          reply(slot.status());
          continue;
        }
        if (cmd == "begin") {
          begun[hash] = *slot;
          reply_ok();
          continue;
        }
        fill_pattern(slot->payload.data(), slot->payload.size(), seed);
        auto params = conn->commit_save(*slot);
        params.ok() ? reply_ok(params->to_json().dump()) : reply(params.status());
      } else if (cmd == "commit") {
        std::string hash;
        uint64_t seed = 0;
        ss >> hash >> seed;
        auto it = begun.find(hash);
        if (it == begun.end()) {
          reply(NotFound("nothing begun for " + hash));
          continue;
        }
        fill_pattern(it->second.payload.data(), it->second.payload.size(), seed);
        auto params = conn->commit_save(it->second);
        begun.erase(it);
        params.ok() ? reply_ok(params->to_json().dump()) : reply(params.status());
      } else if (cmd == "read") {
        std::string rest;
        std::getline(ss, rest);
        auto params = connector::EcTransferParams::from_json(json::parse(rest, nullptr, false));
        if (!params.ok()) {
          reply(params.status());
          continue;
        }
        if (!reader) {
          transfer::AgentConfig ac;
          ac.name = "bare-reader";
          ac.compat_hash = params->compat_hash;
          reader = std::move(transfer::Agent::create(ac).value());
        }
        auto meta = transfer::AgentMetadata::parse(params->agent);
        Status s = meta.ok() ? reader->connect(*meta).status() : meta.status();
        std::vector<std::byte> buf(params->length);
        if (s.ok()) {
          auto cap = transfer::Capability::parse_hex(params->capability);
          transfer::TransferDescriptor d{buf.data(), params->region, params->offset, params->length,
                                         cap.ok() ? *cap : transfer::Capability{}};
          auto h = reader->read(params->engine_id, {&d, 1});
          s = h.ok() ? h->wait(Deadline::after_ms(10000)) : h.status();
        }
        s.ok() ? reply_ok() : reply(s);
      } else if (cmd == "stats") {
        reply_ok(connector::to_json(conn->stats()).dump());
      } else if (cmd == "wait-unpinned") {
        int64_t ms = 0;
        ss >> ms;
        Status s = conn->wait_for_readers(Deadline::after_ms(ms));
        s.ok() ? reply_ok() : reply(s);
      } else if (cmd == "quit" || cmd.empty()) {
        if (cmd == "quit") break;
      } else {
        reply(InvalidArgument("unknown command '" + cmd + "'"));
      }
    } catch (const std::exception& e) {
      reply(InvalidArgument(std::string("bad command: ") + e.what()));
    }
  }
  return 0;
}

}  // namespace ecx::bench
