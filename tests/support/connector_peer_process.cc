#include "support/connector_peer_process.h"

#include <unistd.h>

namespace ecx::testing {

Result<ConnectorPeer> ConnectorPeer::start(const nlohmann::json& config) {
  ECX_ASSIGN_OR_RETURN(Subprocess p, Subprocess::spawn({ECX_BINARY, "bench", "connector-peer",
                                                        "--config", config.dump()}));
  ConnectorPeer peer(std::move(p));
  ECX_ASSIGN_OR_RETURN(std::string ready, peer.process_.read_line(Deadline::after_ms(30000)));
  if (ready.rfind("ok", 0) != 0) return Internal("connector peer did not start: " + ready);
  return peer;
}

Result<std::string> ConnectorPeer::command(const std::string& line, Deadline deadline) {
  // Write the command to the child's stdin (it reads one line per command).
  std::string text = line + "\n";
  ECX_RETURN_IF_ERROR(process_.write_stdin(text));
  ECX_ASSIGN_OR_RETURN(std::string reply, process_.read_line(deadline));
  if (reply.rfind("ok", 0) == 0) return reply.size() > 3 ? reply.substr(3) : std::string();
  if (reply.rfind("error ", 0) == 0) {
    std::string rest = reply.substr(6);
    auto space = rest.find(' ');
    auto code = status_code_from_name(rest.substr(0, space)).value_or(StatusCode::kInternal);
    return Status(code, space == std::string::npos ? "" : rest.substr(space + 1));
  }
  return Internal("connector peer said: " + reply);
}

std::string meta_args(const TensorMeta& meta) {
  std::string dims;
  for (size_t i = 0; i < meta.shape.size(); ++i) {
    // Appended piecewise: `"," + std::to_string(...)` trips GCC 12's false -Wrestrict at -O3.
    if (i > 0) dims += ',';
    dims += std::to_string(meta.shape[i]);
  }
  return std::string(dtype_name(meta.dtype)) + " " + dims;
}

Result<connector::EcTransferParams> ConnectorPeer::save(const MmHash& mm_hash, uint64_t seed,
                                                        const TensorMeta& meta) {
  ECX_ASSIGN_OR_RETURN(std::string text, command("save " + mm_hash.str() + " " +
                                                 std::to_string(seed) + " " + meta_args(meta)));
  return connector::EcTransferParams::from_json(nlohmann::json::parse(text, nullptr, false));
}

Status ConnectorPeer::begin(const MmHash& mm_hash, const TensorMeta& meta) {
  return command("begin " + mm_hash.str() + " " + meta_args(meta)).status();
}

Result<connector::EcTransferParams> ConnectorPeer::commit(const MmHash& mm_hash, uint64_t seed) {
  ECX_ASSIGN_OR_RETURN(std::string text,
                       command("commit " + mm_hash.str() + " " + std::to_string(seed)));
  return connector::EcTransferParams::from_json(nlohmann::json::parse(text, nullptr, false));
}

Result<nlohmann::json> ConnectorPeer::stats() {
  ECX_ASSIGN_OR_RETURN(std::string text, command("stats"));
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) return Internal("stats is not JSON: " + text);
  return j;
}

}  // namespace ecx::testing
