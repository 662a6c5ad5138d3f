// Fuzz target: EcTransferParams::from_json, what PD accepts per mm_hash in a request's
// ec_transfer_params (untrusted JSON relayed by the proxy).
// Invariants: from_json never throws; what it accepts survives to_json -> text -> parse
// -> from_json. The location fields (offset, length, generation, pin) travel only with
// a region (to_json omits them when region == 0, where they mean nothing), so they are
// compared only then; the second round trip must be exact.
#include <nlohmann/json.hpp>
#include <string_view>

#include "ecx/connector/ec_transfer_params.h"
#include "fuzz/fuzz_target.h"

namespace {

using ecx::connector::EcTransferParams;
using nlohmann::json;

bool same(const EcTransferParams& a, const EcTransferParams& b, bool compare_location) {
  bool same_fields = a.connector == b.connector && a.mode == b.mode && a.engine_id == b.engine_id &&
                     a.agent == b.agent && a.compat_hash == b.compat_hash &&
                     a.mm_hash == b.mm_hash && a.meta == b.meta && a.num_tokens == b.num_tokens &&
                     a.region == b.region;
  if (!same_fields || !compare_location) return same_fields;
  return a.offset == b.offset && a.length == b.length && a.generation == b.generation &&
         a.pin == b.pin;
}

// to_json, dumped to text and parsed again, as it travels between services.
EcTransferParams round_trip(const EcTransferParams& p) {
  json j = json::parse(p.to_json().dump(), nullptr, /*allow_exceptions=*/false);
  ECX_FUZZ_CHECK(!j.is_discarded(), "to_json().dump() is not valid JSON");
  auto back = EcTransferParams::from_json(j);
  ECX_FUZZ_CHECK(back.ok(), "to_json of accepted params is rejected by from_json");
  return *back;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  auto parsed = EcTransferParams::from_json(j);
  if (!parsed.ok()) return 0;
  ECX_FUZZ_CHECK(parsed->meta.validate().ok(), "accepted params with an invalid tensor meta");
  ECX_FUZZ_CHECK(!parsed->mm_hash.empty(), "accepted params with an empty mm_hash");
  EcTransferParams once = round_trip(*parsed);
  ECX_FUZZ_CHECK(same(once, *parsed, parsed->has_location()),
                 "params changed in a to_json -> from_json round trip");
  EcTransferParams twice = round_trip(once);
  ECX_FUZZ_CHECK(same(twice, once, /*compare_location=*/true),
                 "params changed in a second round trip");
  return 0;
}
