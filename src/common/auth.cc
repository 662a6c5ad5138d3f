#include "ecx/common/auth.h"

#include <cstring>

#include "ecx/common/bytes.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ecx {

namespace {

// An HMAC context keyed once per thread and key; each MAC starts from a copy of it, so
// the key schedule is not redone on the load path.
class KeyedHmac {
 public:
  ~KeyedHmac() { EVP_MAC_CTX_free(keyed_); }
  EVP_MAC_CTX* fresh(std::string_view key) {
    if (keyed_ == nullptr || key != key_) {
      static EVP_MAC* const kHmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
      EVP_MAC_CTX_free(keyed_);
      keyed_ = EVP_MAC_CTX_new(kHmac);
      char digest[] = "SHA256";
      OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0), OSSL_PARAM_END};
      if (keyed_ == nullptr ||
          EVP_MAC_init(keyed_, reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                       params) != 1) {
        std::abort();  // a broken crypto library: nothing safe to do but stop
      }
      key_.assign(key);
    }
    return EVP_MAC_CTX_dup(keyed_);
  }

 private:
  EVP_MAC_CTX* keyed_ = nullptr;
  std::string key_;
};

}  // namespace

Mac hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  // No secret still gets a key: two agents without one agree, any agent with one differs.
  static constexpr std::string_view kNoSecret = "ecx: no deployment secret";
  if (key.empty()) key = kNoSecret;
  thread_local KeyedHmac keyed;
  EVP_MAC_CTX* ctx = keyed.fresh(key);
  bool ok = ctx != nullptr;
  for (std::string_view part : parts) {
    uint64_t n = part.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    ok = ok && EVP_MAC_update(ctx, len, sizeof(len)) == 1 &&
         EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(part.data()), part.size()) == 1;
  }
  Mac out{};
  size_t written = 0;
  ok = ok && EVP_MAC_final(ctx, out.data(), &written, out.size()) == 1 && written == out.size();
  EVP_MAC_CTX_free(ctx);
  if (!ok) std::abort();
  return out;
}

std::string mac_hex(const Mac& mac) { return hex_encode(mac.data(), mac.size()); }

Result<Mac> parse_mac_hex(std::string_view hex) {
  if (hex.size() != 64) {
    return InvalidArgument("a MAC is 64 hex digits, got " + std::to_string(hex.size()) +
                           " characters");
  }
  ECX_ASSIGN_OR_RETURN(std::string bytes, hex_decode(hex, "a MAC"));
  Mac mac{};
  std::memcpy(mac.data(), bytes.data(), mac.size());
  return mac;
}

bool macs_equal(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string random_bytes(size_t n) {
  std::string s(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(s.data()), static_cast<int>(n)) != 1) {
    // The OS random source failing is not something to continue past.
    std::abort();
  }
  return s;
}

Result<std::string> load_secret(std::string_view token, const std::string& token_file) {
  if (!token.empty()) return std::string(token);
  if (token_file.empty()) return std::string();
  struct stat st {};
  if (::stat(token_file.c_str(), &st) != 0) {
    return NotFound("auth token file " + token_file + " does not exist");
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return PermissionDenied("auth token file " + token_file +
                            " is readable by group or others (chmod 600 it)");
  }
  std::ifstream in(token_file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string secret = ss.str();
  while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r' ||
                             secret.back() == ' ' || secret.back() == '\t')) {
    secret.pop_back();
  }
  if (secret.empty()) return InvalidArgument("auth token file " + token_file + " is empty");
  return secret;
}

}  // namespace ecx
