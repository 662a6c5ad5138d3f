#include "netns.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "ecx/common/subprocess.h"
#include "wire/socket.h"

namespace ecx::bench {
namespace {

// iproute2's `ip` (posix_spawn does not search PATH).
std::string ip_binary() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(path, X_OK) == 0) return path;
  }
  return "/usr/sbin/ip";
}

}  // namespace

std::vector<std::string> in_netns(const std::string& netns, std::vector<std::string> argv) {
  if (netns.empty()) return argv;
  std::vector<std::string> wrapped = {ip_binary(), "netns", "exec", netns};
  wrapped.insert(wrapped.end(), argv.begin(), argv.end());
  return wrapped;
}

Result<std::string> netns_address(const std::string& netns) {
  ECX_ASSIGN_OR_RETURN(Subprocess ip, Subprocess::spawn({ip_binary(), "-n", netns, "-4", "-o",
                                                         "addr", "show", "scope", "global"}));
  ip.close_stdin();
  // One line per address: "2: eth0    inet 10.77.0.2/24 brd ... scope global eth0 ...".
  std::string address;
  for (int lines = 0; lines < 256; ++lines) {
    auto line = ip.read_line(Deadline::after_ms(10000));
    if (!line.ok()) break;  // its stdout closed: no more addresses
    std::stringstream words(*line);
    for (std::string w; address.empty() && words >> w;) {
      if (w == "inet" && words >> w) address = w.substr(0, w.find('/'));
    }
  }
  auto exited = ip.wait(Deadline::after_ms(10000));
  if (!exited.ok() || *exited != 0) {
    return Unavailable("network namespace '" + netns + "': `ip -n " + netns +
                       " addr` failed (is it up? scripts/hosts up N)");
  }
  if (address.empty()) {
    return NotFound("network namespace '" + netns + "' has no global IPv4 address");
  }
  return address;
}

Result<std::string> local_address_towards(const std::string& address) {
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(9);
  if (::inet_pton(AF_INET, address.c_str(), &to.sin_addr) != 1) {
    return InvalidArgument("'" + address + "' is not an IPv4 address");
  }
  transfer::UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("socket", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    return ErrnoError("no route to " + address, errno);
  }
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) {
    return ErrnoError("getsockname", errno);
  }
  std::array<char, INET_ADDRSTRLEN> text{};
  ::inet_ntop(AF_INET, &local.sin_addr, text.data(), text.size());
  return std::string(text.data());
}

Result<SecretFile> SecretFile::write(const std::string& secret) {
  std::string path = (std::filesystem::temp_directory_path() / "ecx-secret-XXXXXX").string();
  int fd = ::mkstemp(path.data());  // mode 600
  if (fd < 0) return ErrnoError("create a secret file in the temp dir", errno);
  SecretFile file(path);
  transfer::UniqueFd owned(fd);
  ssize_t n = ::write(fd, secret.data(), secret.size());  // a few bytes: one write
  if (n != static_cast<ssize_t>(secret.size())) return ErrnoError("write " + path, errno);
  return file;
}

SecretFile& SecretFile::operator=(SecretFile&& other) noexcept {
  if (this != &other) {
    if (!path_.empty()) ::unlink(path_.c_str());
    path_ = std::exchange(other.path_, {});
  }
  return *this;
}

SecretFile::~SecretFile() {
  if (!path_.empty()) ::unlink(path_.c_str());
}

}  // namespace ecx::bench
