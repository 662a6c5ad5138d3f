// What the p2p connector's files share (p2p_connector.h): the limits of its protocol and
// the small conversions both halves make.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

#include "connector/control_messages.h"
#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/connector/ec_transfer_params.h"

namespace ecx::connector::p2p {

// Longest a producer holds a lookup open waiting for a not-ready entry.
inline constexpr int64_t kMaxLookupWaitMs = 2000;

// The capability the params carry, parsed; an error names the item.
inline Result<transfer::Capability> params_capability(const EcTransferParams& p) {
  auto cap = transfer::Capability::parse_hex(p.capability);
  if (!cap.ok()) return cap.status().with_context("ec_transfer_params for " + p.mm_hash.str());
  return cap;
}

// How long a consumer lets the producer wait for not-ready entries before `deadline`.
inline int64_t lookup_wait_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline.remaining()).count();
  return std::min<int64_t>(left, kMaxLookupWaitMs);
}

// A block's place at a producer, for error messages.
inline std::string describe(const BlockLocation& loc, const std::string& producer) {
  return "region " + std::to_string(loc.region) + " offset " + std::to_string(loc.offset) +
         " on agent " + producer;
}

}  // namespace ecx::connector::p2p
