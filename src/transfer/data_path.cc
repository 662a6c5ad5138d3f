// The control dials every engine chooses between (data_path.h).
#include "transfer/data_path.h"

namespace ecx::transfer {
namespace {

Result<std::string> listener(const AgentMetadata& peer, Backend backend) {
  const std::string& endpoint = peer.endpoint(backend);
  if (endpoint.empty()) {
    return Unavailable("agent '" + peer.name + "' has no " + std::string(backend_name(backend)) +
                       " endpoint");
  }
  return endpoint;
}

}  // namespace

Result<ControlSocket> dial_unix_control(const AgentMetadata& peer, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(std::string endpoint, listener(peer, Backend::kShm));
  ECX_ASSIGN_OR_RETURN(UniqueFd fd, connect_unix(endpoint, deadline));
  return ControlSocket{std::move(fd), /*unix_socket=*/true};
}

Result<ControlSocket> dial_tcp_control(const AgentMetadata& peer, Deadline deadline) {
  ECX_ASSIGN_OR_RETURN(std::string endpoint, listener(peer, Backend::kTcp));
  ECX_ASSIGN_OR_RETURN(HostPort address, parse_host_port(endpoint));
  ECX_ASSIGN_OR_RETURN(UniqueFd fd, connect_tcp(address, deadline));
  return ControlSocket{std::move(fd), /*unix_socket=*/false};
}

}  // namespace ecx::transfer
