// The p2p connector's control messages (src/connector/control_messages.h): a lookup, load,
// params or renew CALL body, a reply and a release notification, as a peer could send
// them. The first byte picks the reader; the rest is the message. Anything accepted must
// survive a round trip through to_json unchanged.
#include <string_view>
#include <variant>

#include "connector/control_messages.h"
#include "fuzz/fuzz_target.h"

namespace {

using namespace ecx::connector;

void check_request(std::string_view text) {
  auto parsed = parse_control_request(text);
  if (!parsed.ok()) return;
  if (auto* lookup = std::get_if<LookupRequest>(&*parsed)) {
    auto again = parse_control_request(to_json(*lookup));
    ECX_FUZZ_CHECK(again.ok(), "a lookup we wrote does not parse");
    const auto& back = std::get<LookupRequest>(*again);
    ECX_FUZZ_CHECK(back.items.size() == lookup->items.size(), "lookup items changed");
    for (size_t i = 0; i < back.items.size(); ++i) {
      ECX_FUZZ_CHECK(back.items[i].mm_hash == lookup->items[i].mm_hash, "mm_hash changed");
      ECX_FUZZ_CHECK(back.items[i].capability == lookup->items[i].capability, "capability changed");
    }
    return;
  }
  if (auto* params = std::get_if<ParamsRequest>(&*parsed)) {
    auto again = parse_control_request(to_json(*params));
    ECX_FUZZ_CHECK(again.ok(), "a params request we wrote does not parse");
    ECX_FUZZ_CHECK(std::get<ParamsRequest>(*again).items == params->items, "params items changed");
    return;
  }
  if (auto* renew = std::get_if<RenewRequest>(&*parsed)) {
    auto again = parse_control_request(to_json(*renew));
    ECX_FUZZ_CHECK(again.ok(), "a renew we wrote does not parse");
    const auto& back = std::get<RenewRequest>(*again);
    ECX_FUZZ_CHECK(back.items.size() == renew->items.size(), "renew items changed");
    for (size_t i = 0; i < back.items.size(); ++i) {
      ECX_FUZZ_CHECK(back.items[i].mm_hash == renew->items[i].mm_hash, "mm_hash changed");
      ECX_FUZZ_CHECK(back.items[i].pin == renew->items[i].pin, "pin changed");
      ECX_FUZZ_CHECK(back.items[i].capability == renew->items[i].capability, "capability changed");
    }
    return;
  }
  const auto& load = std::get<LoadBlocksRequest>(*parsed);
  auto again = parse_control_request(to_json(load));
  ECX_FUZZ_CHECK(again.ok(), "a load we wrote does not parse");
  const auto& back = std::get<LoadBlocksRequest>(*again);
  ECX_FUZZ_CHECK(back.items.size() == load.items.size(), "load items changed");
  for (size_t i = 0; i < back.items.size(); ++i) {
    ECX_FUZZ_CHECK(back.items[i].dst_offset == load.items[i].dst_offset, "dst_offset changed");
    ECX_FUZZ_CHECK(back.items[i].dst_capability == load.items[i].dst_capability,
                   "dst_capability changed");
  }
}

void check_reply(std::string_view text, size_t expected) {
  auto parsed = parse_items_reply(text, expected);
  if (!parsed.ok()) return;
  ECX_FUZZ_CHECK(parsed->items.size() == expected, "reply item count not enforced");
  auto again = parse_items_reply(to_json(*parsed), expected);
  ECX_FUZZ_CHECK(again.ok(), "a reply we wrote does not parse");
  for (size_t i = 0; i < expected; ++i) {
    ECX_FUZZ_CHECK(again->items[i].status.code() == parsed->items[i].status.code(),
                   "status changed");
  }
}

// A notification: a release or an offer; what we write of one parses back the same.
void check_notification(std::string_view text) {
  auto parsed = parse_notification(text);
  if (!parsed.ok()) return;
  if (const auto* release = std::get_if<ReleaseNotice>(&*parsed)) {
    auto again = parse_notification(to_json(*release));
    ECX_FUZZ_CHECK(again.ok(), "a release we wrote does not parse");
    ECX_FUZZ_CHECK(std::get<ReleaseNotice>(*again).pins.size() == release->pins.size(),
                   "released pins changed");
    return;
  }
  const auto& offer = std::get<OfferNotice>(*parsed);
  ECX_FUZZ_CHECK(offer.items.size() <= kMaxOfferItems, "offer item count not enforced");
  auto again = parse_notification(to_json(offer));
  ECX_FUZZ_CHECK(again.ok(), "an offer we wrote does not parse");
  ECX_FUZZ_CHECK(std::get<OfferNotice>(*again).items.size() == offer.items.size(),
                 "offered items changed");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      check_request(text);
      break;
    case 1:
      check_reply(text, data[0] / 3 % 5);
      break;
    default:
      check_notification(text);
      break;
  }
  return 0;
}
