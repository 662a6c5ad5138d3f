// The p2p connector's control messages, as structs. Every message that arrives from a
// peer is read here, by one strict reader: wrong types, missing fields, unknown ops or
// too many items become a Status naming the field, never an exception.
//
//   lookup   consumer -> producer CALL   which blocks, by mm_hash + the capability from
//                                        the params (pull-2step, lookup by key)
//            producer -> consumer reply  per item: status, location, pin, capability
//   load     consumer -> producer CALL   push: write these blocks into my grants
//            producer -> consumer reply  per item: status
//   params   scheduler -> producer CALL  the params of items the producer holds, by
//                                        mm_hash (vLLM's scheduler asking its own worker)
//            producer -> scheduler reply per item: status, signed params
//   renew    consumer -> producer CALL   pins to keep another lease (zero-copy views),
//                                        each with its item and capability
//            producer -> consumer reply  per item: status
//   release  consumer -> producer NOTIFY pins to end, each with its capability
//   offer    producer -> consumer NOTIFY params of items a request on its way to the
//                                        consumer will use: it loads them now (vLLM's
//                                        scheduler told early, offers.h)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ecx/common/mm_hash.h"
#include "ecx/common/status.h"
#include "ecx/connector/ec_transfer_params.h"
#include "ecx/transfer/types.h"

namespace ecx::connector {

// Most items one message may carry.
constexpr size_t kMaxMessageItems = 4096;

struct LookupItem {
  MmHash mm_hash;
  transfer::Capability capability;  // proves the consumer was handed this entry
};
struct LookupRequest {
  std::vector<LookupItem> items;
  int64_t wait_ms = 0;  // how long the producer may wait for a not-ready entry
};

struct LoadItemRequest {
  MmHash mm_hash;
  transfer::Capability capability;  // the params' grant at the producer
  uint32_t dst_region = 0;          // the consumer's window for this block
  uint64_t dst_offset = 0;
  uint64_t dst_length = 0;
  transfer::Capability dst_capability;  // the consumer's write grant for the window
  uint64_t generation = 0;              // expected at the producer (0 = any)
  uint64_t pin = 0;                     // params pin to release once written
};
struct LoadBlocksRequest {
  std::string consumer;  // the consumer agent's metadata (JSON)
  transfer::Backend backend = transfer::Backend::kAuto;
  int64_t wait_ms = 0;
  std::vector<LoadItemRequest> items;
};

// Params for items the producer holds, as its saved_params gives them: each pinned for
// whoever is handed them (lease) and signed. Knowing the mm_hash is the proof, as in a
// lookup by key; only authenticated agents of the deployment get this far.
struct ParamsRequest {
  std::vector<MmHash> items;
  int64_t wait_ms = 0;  // how long the producer may wait for a not-ready entry
};

// Pins a consumer still reads through (a zero-copy view): each gets another lease, and
// becomes the caller's (its quota). The capability proves the caller was handed it.
struct RenewItem {
  MmHash mm_hash;
  uint64_t pin = 0;
  transfer::Capability capability;
};
struct RenewRequest {
  std::vector<RenewItem> items;
};

using ControlRequest = std::variant<LookupRequest, LoadBlocksRequest, ParamsRequest, RenewRequest>;

// Where a block is at its producer, the pin that holds it there for the consumer, and
// the capability that lets the consumer read it and release the pin.
struct BlockLocation {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t generation = 0;
  uint64_t pin = 0;
  transfer::Capability capability;
};

// One item of a reply: a status and, for lookups, where the block is.
struct ItemReply {
  MmHash mm_hash;
  Status status;
  BlockLocation where;                     // lookups that succeeded; region 0 otherwise
  std::optional<EcTransferParams> params;  // params requests that succeeded
};
struct ItemsReply {
  std::vector<ItemReply> items;
};

struct ReleasedPin {
  uint64_t pin = 0;
  transfer::Capability capability;
};
struct ReleaseNotice {
  std::vector<ReleasedPin> pins;
};

// Items a consumer is told of before the request that uses them reaches it: each the
// signed params its producer issued for that request (whose pin the request gives back).
struct OfferNotice {
  std::vector<EcTransferParams> items;
};
// Most items one offer carries (a request's items).
constexpr size_t kMaxOfferItems = 256;

using Notification = std::variant<ReleaseNotice, OfferNotice>;

std::string to_json(const LookupRequest& m);
std::string to_json(const LoadBlocksRequest& m);
std::string to_json(const ParamsRequest& m);
std::string to_json(const RenewRequest& m);
std::string to_json(const ItemsReply& m);
std::string to_json(const ReleaseNotice& m);
std::string to_json(const OfferNotice& m);

// A CALL body: a lookup, a load, a params or a renew request, by its "op".
Result<ControlRequest> parse_control_request(std::string_view text);
// A reply to a request of `expected_items` items: exactly that many.
Result<ItemsReply> parse_items_reply(std::string_view text, size_t expected_items);
// A NOTIFY body: a release or an offer, by its "op".
Result<Notification> parse_notification(std::string_view text);

}  // namespace ecx::connector
