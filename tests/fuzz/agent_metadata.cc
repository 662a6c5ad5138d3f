// Fuzz target: AgentMetadata::parse, the handshake payload a peer sends (untrusted JSON).
// Invariants: parse never throws; what it accepts is within its documented limits and
// survives to_json -> parse unchanged.
#include <string_view>

#include "ecx/transfer/metadata.h"
#include "fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using ecx::transfer::AgentMetadata;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = AgentMetadata::parse(text);
  if (!parsed.ok()) return 0;
  ECX_FUZZ_CHECK(!parsed->name.empty() && parsed->name.size() <= 256, "name outside 1..256");
  ECX_FUZZ_CHECK(parsed->endpoint(ecx::transfer::Backend::kShm).size() <= 107,
                 "shm endpoint longer than sun_path");
  ECX_FUZZ_CHECK(parsed->regions.size() <= 65536, "more regions than the limit");
  auto again = AgentMetadata::parse(parsed->to_json());
  ECX_FUZZ_CHECK(again.ok(), "to_json of accepted metadata does not parse");
  ECX_FUZZ_CHECK(*again == *parsed, "metadata changed in a to_json -> parse round trip");
  return 0;
}
