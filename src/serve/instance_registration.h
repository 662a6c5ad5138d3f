// E and PD in etcd (docs/SERVING.md, "Membership (etcd)"): with --etcd, an instance
// registers {id, url, role, model, compat_hash} under a lease once it listens, keeps the
// lease alive while it serves, and deregisters on SIGTERM before it drains.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "ecx/common/mutex.h"
#include "ecx/common/status.h"
#include "ecx/directory/etcd_client.h"
#include "ecx/directory/instance.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"

namespace ecx::serve {

// Checks the directory flags of an instance before anything starts: the etcd endpoints
// parse, the TTL is at least 1 s, the advertised URL is http://host:port, and one is
// given when the instance listens on a wildcard address (0.0.0.0, ::).
Status check_instance_directory(const DirectoryConfig& directory,
                                const CommonServiceConfig& common);

// server.serve_until_signal(), registered in etcd meanwhile when `directory.etcd` is set:
// registration starts once the server listens (the listening line is printed after the
// first registration, or after 2 s when etcd does not answer: the instance serves
// anyway and keeps trying), and the lease is revoked on SIGTERM/SIGINT before the drain.
// REQUIRES: check_instance_directory(directory, common) is ok.
//
// The record is signed with the deployment secret (`engine`'s; directory::sign_instance),
// and the server answers proxies' challenges (GET /v1/ecx/prove?nonce=N) with
// directory::prove_instance: only then does a proxy route here.
int serve_registered(HttpServer& server, const DirectoryConfig& directory,
                     const CommonServiceConfig& common, const EngineConfig& engine,
                     const std::string& role, const std::string& compat_hash);

// The URL an instance listening on `port` is reached at: --advertise-url, else
// http://HOST:PORT as it listens.
std::string advertised_url(const DirectoryConfig& directory, const CommonServiceConfig& common,
                           int port);

// Who an instance is once it registered: what it proves to proxies.
struct ProvenSelf {
  Mutex mu;
  std::optional<directory::Instance> self ECX_GUARDED_BY(mu);
};

// GET /v1/ecx/prove?nonce=N: directory::prove_instance of `proven`'s instance under
// `secret`; 503 until it is set, 400 for a malformed nonce.
void add_prove_route(HttpServer& server, std::shared_ptr<ProvenSelf> proven, std::string secret);

// An etcd client for `directory` (its endpoints, access, and a call timeout well inside
// the lease).
Result<directory::EtcdClient> etcd_client(const DirectoryConfig& directory);

// How E, PD and the proxy reach etcd (--etcd-cacert, --etcd-user, and the password from
// ECX_ETCD_PASSWORD or --etcd-password-file, a file only its owner can read).
Result<directory::EtcdAccess> etcd_access(const DirectoryConfig& directory);

}  // namespace ecx::serve
