// EcTransferParams: what travels, per mm_hash, from the encoder (E) through the proxy to
// prefill/decode (PD) in `ec_transfer_params`. Parsed from untrusted JSON: every field
// is checked before it is used.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/common/tensor_meta.h"

namespace ecx::connector {

struct EcTransferParams {
  std::string connector;    // "p2p", "disk", "store"
  std::string mode;         // p2p: "pull", "pull-2step", "push"; else empty
  std::string engine_id;    // the producer instance (its agent name)
  std::string agent;        // p2p: the producer agent's metadata (JSON)
  std::string compat_hash;  // the producer's compatibility hash
  MmHash mm_hash;
  TensorMeta meta;
  uint64_t num_tokens = 0;
  // p2p location of the block (header + payload). region == 0: location unknown, the
  // consumer looks the mm_hash up at the producer (lookup by key).
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t generation = 0;
  uint64_t pin = 0;  // the producer-side pin the consumer releases after reading
  // p2p: the grant that lets its bearer READ the block, look it up and release the pin
  // (transfer::Capability, 32 hex digits).
  std::string capability;
  // HMAC of every other field under the deployment secret, set by the producer (sign):
  // a consumer uses params only when verify() passes, so a client cannot choose a
  // producer, a location or embeddings.
  std::string signature;

  bool has_location() const { return region != 0; }
  nlohmann::json to_json() const;
  static Result<EcTransferParams> from_json(const nlohmann::json& j);

  void sign(std::string_view secret);
  // kPermissionDenied when the signature is missing or does not match.
  Status verify(std::string_view secret) const;
};

}  // namespace ecx::connector
