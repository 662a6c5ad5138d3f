// E and PD in etcd (docs/SERVING.md, "Membership (etcd)"): with --etcd, an instance
// registers {id, url, role, model, compat_hash} under a lease once it listens, keeps the
// lease alive while it serves, and deregisters on SIGTERM before it drains.
#pragma once

#include <string>

#include "ecx/common/status.h"
#include "ecx/directory/etcd_client.h"
#include "ecx/serve/services.h"
#include "serve/http_server.h"

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

// How E, PD and the proxy reach etcd (--etcd-cacert, --etcd-user, and the password from
// ECX_ETCD_PASSWORD or --etcd-password-file, a file only its owner can read).
Result<directory::EtcdAccess> etcd_access(const DirectoryConfig& directory);

}  // namespace ecx::serve
