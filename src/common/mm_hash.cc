#include "ecx/common/mm_hash.h"

#include <openssl/evp.h>

#include <cctype>
#include <cstdint>
#include <memory>

namespace ecx {

Result<MmHash> MmHash::parse(std::string_view text) {
  if (text.empty() || text.size() > 128) {
    return InvalidArgument("mm_hash must be 1..128 characters, got " + std::to_string(text.size()));
  }
  if (text.front() == '.') return InvalidArgument("mm_hash must not start with '.'");
  for (char c : text) {
    bool allowed =
        std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == ':';
    if (!allowed) {
      return InvalidArgument("mm_hash contains a character outside [A-Za-z0-9_.:-]: '" +
                             std::string(text.substr(0, 64)) + "'");
    }
  }
  return MmHash(std::string(text));
}

MmHash MmHash::sha256_of(std::initializer_list<std::string_view> parts) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr);
  for (std::string_view part : parts) {
    uint64_t len = part.size();
    EVP_DigestUpdate(ctx.get(), &len, sizeof(len));
    EVP_DigestUpdate(ctx.get(), part.data(), part.size());
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &digest_len);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(digest_len * 2);
  for (unsigned int i = 0; i < digest_len; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return MmHash(std::move(hex));
}

}  // namespace ecx
