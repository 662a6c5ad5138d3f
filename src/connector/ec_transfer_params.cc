// ec_transfer_params: JSON both ways, and the deployment's signature over them.
#include "ecx/common/auth.h"
#include "ecx/common/json_reader.h"
#include "ecx/connector/ec_connector.h"

namespace ecx::connector {

using nlohmann::json;

json EcTransferParams::to_json() const {
  json j = {{"connector", connector},
            {"engine_id", engine_id},
            {"compat_hash", compat_hash},
            {"mm_hash", mm_hash.str()},
            {"dtype", std::string(dtype_name(meta.dtype))},
            {"shape", meta.shape},
            {"num_tokens", num_tokens}};
  if (!mode.empty()) j["mode"] = mode;
  if (!agent.empty()) j["agent"] = agent;
  if (region != 0) {
    j["region"] = region;
    j["offset"] = offset;
    j["length"] = length;
    j["generation"] = generation;
    j["pin"] = pin;
  }
  if (!capability.empty()) j["capability"] = capability;
  if (!signature.empty()) j["signature"] = signature;
  return j;
}

namespace {

Mac params_mac(const EcTransferParams& p, std::string_view secret) {
  // Every field but the signature, each length-prefixed by hmac_sha256: no JSON on the
  // load path.
  std::string shape;
  for (int64_t d : p.meta.shape) shape += std::to_string(d) + ",";
  const std::string n[] = {std::to_string(p.num_tokens), std::to_string(p.region),
                           std::to_string(p.offset),     std::to_string(p.length),
                           std::to_string(p.generation), std::to_string(p.pin)};
  return hmac_sha256(secret, {"ecx-ec-transfer-params-v1", p.connector, p.mode, p.engine_id,
                              p.agent, p.compat_hash, p.mm_hash.str(), dtype_name(p.meta.dtype),
                              shape, n[0], n[1], n[2], n[3], n[4], n[5], p.capability});
}

}  // namespace

void EcTransferParams::sign(std::string_view secret) {
  signature = mac_hex(params_mac(*this, secret));
}

Status EcTransferParams::verify(std::string_view secret) const {
  auto given = parse_mac_hex(signature);
  if (!given.ok() || !macs_equal(*given, params_mac(*this, secret))) {
    return PermissionDenied("ec_transfer_params for " + mm_hash.str() + " from '" + engine_id +
                            "' are not signed by an encoder of this deployment");
  }
  return Status::Ok();
}

Result<EcTransferParams> EcTransferParams::from_json(const json& j) {
  JsonReader r(j, "ec_transfer_params");
  if (!j.is_object()) return InvalidArgument("ec_transfer_params entry must be a JSON object");
  constexpr Presence kOpt = Presence::kOptional;
  EcTransferParams p;
  ECX_ASSIGN_OR_RETURN(p.connector, r.string("connector", Presence::kRequired, 32));
  ECX_ASSIGN_OR_RETURN(p.mode, r.string("mode", kOpt, 32));
  ECX_ASSIGN_OR_RETURN(p.engine_id, r.string("engine_id", kOpt, 256));
  ECX_ASSIGN_OR_RETURN(p.agent, r.string("agent", kOpt, 1 << 20));
  ECX_ASSIGN_OR_RETURN(p.compat_hash, r.string("compat_hash", kOpt, 256));
  ECX_ASSIGN_OR_RETURN(std::string hash, r.string("mm_hash", Presence::kRequired, 256));
  ECX_ASSIGN_OR_RETURN(p.mm_hash, MmHash::parse(hash));
  ECX_ASSIGN_OR_RETURN(p.meta, TensorMeta::from_json(j));
  ECX_ASSIGN_OR_RETURN(p.num_tokens, r.u64("num_tokens", kOpt, 1ull << 32));
  ECX_ASSIGN_OR_RETURN(uint64_t region, r.u64("region", kOpt, UINT32_MAX));
  p.region = static_cast<uint32_t>(region);
  ECX_ASSIGN_OR_RETURN(p.offset, r.u64("offset", kOpt, 1ull << 48));
  ECX_ASSIGN_OR_RETURN(p.length, r.u64("length", kOpt, 1ull << 48));
  ECX_ASSIGN_OR_RETURN(p.generation, r.u64("generation", kOpt));
  ECX_ASSIGN_OR_RETURN(p.pin, r.u64("pin", kOpt));
  ECX_ASSIGN_OR_RETURN(p.capability, r.string("capability", kOpt, 32));
  ECX_ASSIGN_OR_RETURN(p.signature, r.string("signature", kOpt, 64));
  return p;
}

}  // namespace ecx::connector
