// Benchmark peers in another network namespace (a test host of scripts/hosts,
// docs/HOSTS.md): how to start them there and which addresses reach them.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ecx/common/status.h"

namespace ecx::bench {

// `argv` as run in network namespace `netns` (`ip netns exec NETNS argv...`); `argv`
// unchanged when `netns` is empty.
std::vector<std::string> in_netns(const std::string& netns, std::vector<std::string> argv);

// The first global IPv4 address of namespace `netns` (`ip -n NETNS -4 addr`), where a
// peer started there listens. Errors name the namespace.
Result<std::string> netns_address(const std::string& netns);

// This namespace's address on the route to `address`: where a peer there reaches us.
// (A UDP socket connected to it; nothing is sent.)
Result<std::string> local_address_towards(const std::string& address);

// A deployment secret in a file only its owner can read (mode 600, in the temp dir),
// for a peer started with --auth-token-file: a command line is visible to `ps`.
// The file is removed when this object goes.
class SecretFile {
 public:
  static Result<SecretFile> write(const std::string& secret);
  SecretFile(SecretFile&& other) noexcept : path_(std::exchange(other.path_, {})) {}
  SecretFile& operator=(SecretFile&& other) noexcept;
  SecretFile(const SecretFile&) = delete;
  SecretFile& operator=(const SecretFile&) = delete;
  ~SecretFile();
  const std::string& path() const { return path_; }

 private:
  explicit SecretFile(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace ecx::bench
