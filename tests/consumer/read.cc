// A program outside ecx's tree, built against an installed ecx (find_package(ecx) or
// pkg-config ecx): two agents in one process, one READ of 1 MiB, checked byte by byte.
#include <cstdio>
#include <cstring>
#include <vector>

#include "ecx/transfer/agent.h"

using namespace ecx;
using namespace ecx::transfer;

int main() {
  constexpr uint64_t kBytes = 1 << 20;
  const std::string secret = "consumer-test-secret-0123456789ab";
  auto owner = Agent::create({.name = "e-0", .auth_secret = secret});
  auto reader = Agent::create({.name = "pd-0", .auth_secret = secret});
  if (!owner.ok() || !reader.ok()) {
    std::fprintf(stderr, "create: %s\n",
                 (owner.ok() ? reader.status() : owner.status()).to_string().c_str());
    return 1;
  }
  LocalRegion src = (*owner)->allocate(kBytes).value();
  LocalRegion dst = (*reader)->allocate(kBytes).value();
  auto* bytes = reinterpret_cast<unsigned char*>(src.data);
  for (uint64_t i = 0; i < kBytes; ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  if (auto peer = (*reader)->connect((*owner)->metadata()); !peer.ok()) {
    std::fprintf(stderr, "connect: %s\n", peer.status().to_string().c_str());
    return 1;
  }
  TransferDescriptor d{dst.data, src.id, /*remote_offset=*/0, /*length=*/kBytes};
  auto handle = (*reader)->read("e-0", {&d, 1});
  Status s = handle.ok() ? handle->wait(Deadline::after_ms(5000)) : handle.status();
  if (!s.ok()) {
    std::fprintf(stderr, "read: %s\n", s.to_string().c_str());
    return 1;
  }
  if (std::memcmp(src.data, dst.data, kBytes) != 0) {
    std::fprintf(stderr, "read: the bytes differ\n");
    return 1;
  }
  std::printf("read %llu bytes from e-0: identical\n", static_cast<unsigned long long>(kBytes));
  return 0;
}
