// Deployment secrets and message authentication: the pieces of the trust model
// (docs/SECURITY.md) that every layer shares. HMAC-SHA256 and random bytes from OpenSSL.
//
// The secret is never sent: agents prove they know it by answering a challenge, and
// encoders sign the ec_transfer_params they issue with a key derived from it.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "ecx/common/status.h"

namespace ecx {

using Mac = std::array<uint8_t, 32>;

// HMAC-SHA256 over the concatenation of `parts`, each preceded by its length (so
// ("ab","c") and ("a","bc") differ). An empty key is allowed: a deployment without a
// secret still runs the same handshake, and two such agents agree.
Mac hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts);
// Lower-case hex of a MAC, and its inverse (nullopt-like error on bad input).
std::string mac_hex(const Mac& mac);
Result<Mac> parse_mac_hex(std::string_view hex);
// Constant-time equality (CRYPTO_memcmp).
bool macs_equal(const Mac& a, const Mac& b);
// `n` bytes from the OS's cryptographic random source.
std::string random_bytes(size_t n);

// Where an agent's secret comes from, in this order: an explicit token, a file holding
// it (trailing whitespace ignored), or nothing. A file that is readable by others than
// its owner is refused: a secret anyone can read is no secret.
Result<std::string> load_secret(std::string_view token, const std::string& token_file);

}  // namespace ecx
