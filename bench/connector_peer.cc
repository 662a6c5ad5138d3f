#include "connector_peer.h"
#include "ecx/common/json_reader.h"

#include <cstdio>
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

// One write, newline included: a log line of the connector (stdout, other threads)
// cannot cut an answer the driving process parses.
void write_line(const std::string& text) {
  const std::string line = text + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
}

void reply(const Status& s) {
  write_line("error " + std::string(status_code_name(s.code())) + " " + s.message());
}

void reply_ok(const std::string& payload = "") {
  write_line("ok" + (payload.empty() ? std::string() : " " + payload));
}

// The peer's state across commands; each command answers one line.
class ConnectorPeer {
 public:
  explicit ConnectorPeer(std::unique_ptr<EcConnector> conn) : conn_(std::move(conn)) {}

  // Runs one command line; false once it is "quit".
  bool run_command(const std::string& line);

 private:
  void save(std::stringstream& args, bool commit);
  void commit(std::stringstream& args);
  void read(std::stringstream& args);
  void load(std::stringstream& args);
  Status read_block(const connector::EcTransferParams& params);

  std::unique_ptr<EcConnector> conn_;
  std::unique_ptr<transfer::Agent> reader_;  // for "read": a bare consumer agent
  std::map<std::string, connector::SaveSlot> begun_;
};

bool ConnectorPeer::run_command(const std::string& line) {
  std::stringstream ss(line);
  std::string cmd;
  ss >> cmd;
  try {
    if (cmd == "save" || cmd == "begin") {
      save(ss, cmd == "save");
    } else if (cmd == "commit") {
      commit(ss);
    } else if (cmd == "read") {
      read(ss);
    } else if (cmd == "load") {
      load(ss);
    } else if (cmd == "stats") {
      reply_ok(connector::to_json(conn_->stats()).dump());
    } else if (cmd == "metadata") {
      reply_ok(conn_->agent_metadata());
    } else if (cmd == "wait-unpinned") {
      int64_t ms = 0;
      ss >> ms;
      Status s = conn_->wait_for_readers(Deadline::after_ms(ms));
      s.ok() ? reply_ok() : reply(s);
    } else if (cmd == "quit") {
      return false;
    } else if (!cmd.empty()) {
      reply(InvalidArgument("unknown command '" + cmd + "'"));
    }
  } catch (const std::exception& e) {
    reply(InvalidArgument(std::string("bad command: ") + e.what()));
  }
  return true;
}

// save <mm_hash> <seed> <dtype> <dims> (commit = true), or begin <mm_hash> <dtype> <dims>.
void ConnectorPeer::save(std::stringstream& args, bool commit) {
  std::string hash, dtype, dims;
  uint64_t seed = 0;
  args >> hash;
  if (commit) args >> seed;
  args >> dtype >> dims;
  auto mm_hash = MmHash::parse(hash);
  auto meta = mm_hash.ok() ? parse_meta(dtype, dims) : Result<TensorMeta>(mm_hash.status());
  if (!meta.ok()) return reply(meta.status());
  auto slot = conn_->begin_save(*mm_hash, *meta);
  if (commit && slot.status().code() == StatusCode::kAlreadyExists) {
    // Saved before: fresh params for it, as an encoder answers a repeated image.
    auto again = conn_->saved_params(*mm_hash);
    return again.ok() ? reply_ok(again->to_json().dump()) : reply(again.status());
  }
  if (!slot.ok()) return reply(slot.status());
  if (!commit) {
    begun_[hash] = *slot;
    return reply_ok();
  }
  fill_pattern(slot->payload.data(), slot->payload.size(), seed);
  auto params = conn_->commit_save(*slot);
  params.ok() ? reply_ok(params->to_json().dump()) : reply(params.status());
}

// commit <mm_hash> <seed>: fills and commits an entry begun before.
void ConnectorPeer::commit(std::stringstream& args) {
  std::string hash;
  uint64_t seed = 0;
  args >> hash >> seed;
  auto it = begun_.find(hash);
  if (it == begun_.end()) return reply(NotFound("nothing begun for " + hash));
  fill_pattern(it->second.payload.data(), it->second.payload.size(), seed);
  auto params = conn_->commit_save(it->second);
  begun_.erase(it);
  params.ok() ? reply_ok(params->to_json().dump()) : reply(params.status());
}

// read <params-json>: READs the block as a bare consumer agent, without releasing it.
void ConnectorPeer::read(std::stringstream& args) {
  std::string rest;
  std::getline(args, rest);
  auto j = parse_json_object(rest, "params");
  if (!j.ok()) return reply(j.status());
  auto params = connector::EcTransferParams::from_json(*j);
  if (!params.ok()) return reply(params.status());
  Status s = read_block(*params);
  s.ok() ? reply_ok() : reply(s);
}

// load <request_id> <params-json>: loads one item into this (consumer) connector and
// keeps what the request holds (no request_finished): a reader that dies holding it.
void ConnectorPeer::load(std::stringstream& args) {
  std::string id, rest;
  args >> id;
  std::getline(args, rest);
  auto j = parse_json_object(rest, "params");
  if (!j.ok()) return reply(j.status());
  auto params = connector::EcTransferParams::from_json(*j);
  if (!params.ok()) return reply(params.status());
  auto out = conn_->load({.request_id = id, .items = {{params->mm_hash, params->meta, *params}}},
                         Deadline::after_ms(10000));
  out.status.ok() ? reply_ok(connector::to_json(conn_->stats()).dump()) : reply(out.status);
}

Status ConnectorPeer::read_block(const connector::EcTransferParams& params) {
  if (!reader_) {
    transfer::AgentConfig ac;
    ac.name = "bare-reader";
    ac.compat_hash = params.compat_hash;
    reader_ = std::move(transfer::Agent::create(ac).value());
  }
  ECX_ASSIGN_OR_RETURN(auto meta, transfer::AgentMetadata::parse(params.agent));
  ECX_RETURN_IF_ERROR(reader_->connect(meta).status());
  std::vector<std::byte> buf(params.length);
  auto cap = transfer::Capability::parse_hex(params.capability);
  transfer::TransferDescriptor d{buf.data(), params.region, params.offset, params.length,
                                 cap.ok() ? *cap : transfer::Capability{}};
  ECX_ASSIGN_OR_RETURN(auto h, reader_->read(params.engine_id, {&d, 1}));
  return h.wait(Deadline::after_ms(10000));
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
  std::string name = (*created)->name();
  ConnectorPeer peer(std::move(*created));
  reply_ok(name);  // ready
  std::string line;
  while (std::getline(std::cin, line) && peer.run_command(line)) {
  }
  return 0;
}

}  // namespace ecx::bench
