// A connector in a separate process (`ecx bench connector-peer`), driven line by line.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "ecx/common/subprocess.h"
#include "ecx/connector/ec_connector.h"

namespace ecx::testing {

class ConnectorPeer {
 public:
  static Result<ConnectorPeer> start(const nlohmann::json& config);

  // Sends one command; returns the text after "ok" or the error as a Status.
  Result<std::string> command(const std::string& line,
                              Deadline deadline = Deadline::after_ms(60000));
  Result<connector::EcTransferParams> save(const MmHash& mm_hash, uint64_t seed,
                                           const TensorMeta& meta);
  Status begin(const MmHash& mm_hash, const TensorMeta& meta);
  Result<connector::EcTransferParams> commit(const MmHash& mm_hash, uint64_t seed);
  Result<nlohmann::json> stats();
  // The peer connector's agent metadata (JSON).
  Result<std::string> metadata() { return command("metadata"); }
  Subprocess& process() { return process_; }

 private:
  explicit ConnectorPeer(Subprocess p) : process_(std::move(p)) {}
  Subprocess process_;
};

std::string meta_args(const TensorMeta& meta);  // "BF16 400,2048"

}  // namespace ecx::testing
