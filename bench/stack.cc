#include "stack.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "ecx/common/json_reader.h"
#include "ecx/serve/services.h"
#include "netns.h"
#include "wire/socket.h"

namespace ecx::bench {

using nlohmann::json;

Proc::~Proc() {
  if (p) serve::stop_service(*p, Deadline::after_ms(15000));
}

namespace {

Status launch(Proc& proc, std::vector<std::string> argv) {
  ECX_ASSIGN_OR_RETURN(serve::RunningService r,
                       serve::spawn_service(argv, Deadline::after_ms(120000)));
  proc.p.emplace(std::move(r.process));
  proc.url = r.url;
  return Status::Ok();
}

}  // namespace

namespace {

// Where each service of a stack runs: the proxy on the first host, then one host per
// E and PD, round robin over the others.
class Placement {
 public:
  explicit Placement(const std::vector<std::string>& hosts) : hosts_(hosts) {}

  struct Where {
    std::string netns;    // empty: this namespace
    std::string address;  // what the service binds and advertises
  };
  Result<Where> proxy() { return at(0); }
  Result<Where> next() {
    if (hosts_.size() <= 1) return at(0);
    return at(1 + (next_++ % (hosts_.size() - 1)));
  }

 private:
  Result<Where> at(size_t i) {
    if (hosts_.empty()) return Where{"", "127.0.0.1"};
    ECX_ASSIGN_OR_RETURN(std::string address, netns_address(hosts_[i]));
    return Where{hosts_[i], address};
  }
  const std::vector<std::string>& hosts_;
  size_t next_ = 0;
};

std::string join_urls(const std::vector<std::unique_ptr<Proc>>& procs) {
  std::string out;
  for (const auto& p : procs) out += (out.empty() ? "" : ",") + p->url;
  return out;
}

}  // namespace

Status start_stack(const std::string& connector, const std::string& pool_bytes,
                   const std::string& redis, const std::filesystem::path& dir, StackProcs& s,
                   const StackLayout& layout) {
  // The services are `ecx serve`: the ecx binary beside this one (ecx-bench has no serve).
  const std::string exe = sibling_executable("ecx");
  bool local = connector == "local";
  // Each stack's services share a secret of their own, in a file they are given.
  ECX_ASSIGN_OR_RETURN(serve::StackSecret secret, serve::StackSecret::create());
  s.secret.emplace(std::move(secret));
  const std::vector<std::string> secret_flags = s.secret->flags();
  json ec = {{"connector", connector.substr(0, connector.find(':'))},
             {"extra", {{"pool_bytes", pool_bytes}}}};
  if (!layout.extra_json.empty()) {
    auto extra = parse_json_object(layout.extra_json, "--ec-extra");
    if (!extra.ok()) return extra.status();
    ec["extra"].update(*extra);
  }
  if (connector.find(':') != std::string::npos)
    ec["extra"]["mode"] = connector.substr(connector.find(':') + 1);
  if (connector == "disk") ec["extra"]["root"] = (dir / "disk").string();
  if (connector == "store") ec["extra"]["redis"] = redis;
  Placement place(layout.hosts);
  auto service = [&](const std::string& role, const Placement::Where& where) {
    json config = ec;
    config["extra"]["tcp_host"] = where.address;
    std::vector<std::string> argv = {exe,           "serve",       role,   "--host",
                                     where.address, "--port",      "0",    "--ec-config",
                                     config.dump(), "--log-level", "error"};
    argv.insert(argv.end(), secret_flags.begin(), secret_flags.end());
    return in_netns(where.netns, argv);
  };
  for (int i = 0; !local && i < layout.encoders; ++i) {
    ECX_ASSIGN_OR_RETURN(auto where, place.next());
    s.encoders.push_back(std::make_unique<Proc>());
    ECX_RETURN_IF_ERROR(launch(*s.encoders.back(), service("encoder", where))
                            .with_context(connector + " encoder " + std::to_string(i)));
  }
  for (int i = 0; i < layout.pds; ++i) {
    ECX_ASSIGN_OR_RETURN(auto where, place.next());
    s.pds.push_back(std::make_unique<Proc>());
    ECX_RETURN_IF_ERROR(launch(*s.pds.back(), service("pd", where))
                            .with_context(connector + " pd " + std::to_string(i)));
  }
  ECX_ASSIGN_OR_RETURN(auto where, place.proxy());
  std::vector<std::string> proxy_argv =
      in_netns(where.netns,
               {exe, "serve", "proxy", "--host", where.address, "--port", "0", "--pd",
                join_urls(s.pds), "--connector", local ? "local" : "p2p", "--log-level", "error"});
  if (!local) {
    proxy_argv.insert(proxy_argv.end(), {"--encoders", join_urls(s.encoders), "--encoder-routing",
                                         layout.encoder_routing});
  }
  proxy_argv.insert(proxy_argv.end(), secret_flags.begin(), secret_flags.end());
  return launch(s.proxy, proxy_argv).with_context(connector + " proxy");
}

bool redis_answers(const std::string& address, int64_t timeout_ms) {
  Deadline deadline = Deadline::after_ms(timeout_ms);
  auto host_port = transfer::parse_host_port(address);
  if (!host_port.ok()) return false;
  auto fd = transfer::connect_tcp(*host_port, deadline);
  if (!fd.ok()) return false;
  static const char kPing[] = "PING\r\n";
  if (!transfer::send_all(fd->get(), kPing, sizeof(kPing) - 1, deadline, "redis PING").ok()) {
    return false;
  }
  char reply[7] = {};
  if (!transfer::recv_all(fd->get(), reply, sizeof(reply), deadline, "redis PONG").ok()) {
    return false;
  }
  return std::string(reply, sizeof(reply)) == "+PONG\r\n";
}

Result<RedisForBench> RedisForBench::ensure(const std::string& address,
                                            const std::filesystem::path& dir,
                                            const std::string& netns) {
  RedisForBench redis;
  if (netns.empty() && redis_answers(address, 1000)) {
    redis.address_ = address;
    return redis;
  }
  std::string exe;
  for (const char* candidate : {"/usr/bin/redis-server", "/usr/local/bin/redis-server"}) {
    if (::access(candidate, X_OK) == 0) {
      exe = candidate;
      break;
    }
  }
  if (exe.empty()) {
    return Unavailable("no Redis at " + address +
                       ", and no redis-server to start (Debian package redis-server)");
  }
  Status last = Unavailable("no redis-server started");
  std::string host = "127.0.0.1";
  if (!netns.empty()) {
    ECX_ASSIGN_OR_RETURN(host, netns_address(netns));
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    // A free port here; in a namespace of its own, any port is free.
    std::string port = "6399";
    if (netns.empty()) {
      ECX_ASSIGN_OR_RETURN(auto listener, transfer::listen_tcp("127.0.0.1", 0));
      port = std::to_string(listener.second);
      listener.first.reset();  // free the port for redis-server (retried if taken meanwhile)
    }
    std::vector<std::string> argv = {exe, "--port",       port, "--bind", host,        "--save",
                                     "",  "--appendonly", "no", "--dir",  dir.string()};
    // On a test host's address Redis refuses other hosts unless told (a private link).
    if (!netns.empty()) argv.insert(argv.end(), {"--protected-mode", "no"});
    auto server = Subprocess::spawn(in_netns(netns, argv));
    if (!server.ok()) {
      return Unavailable("no Redis at " + address + ", and redis-server could not start: " +
                         server.status().message() + " (Debian package redis-server)");
    }
    // It logs "Ready to accept connections" once it listens.
    while (true) {
      auto line = server->read_line(Deadline::after_ms(10000));
      if (!line.ok()) break;
      if (line->find("Ready to accept connections") != std::string::npos) {
        redis.address_ = host + ":" + port;
        redis.server_ = std::make_unique<Subprocess>(std::move(*server));
        return redis;
      }
    }
    last = Unavailable("redis-server on port " + port + " did not become ready");
  }
  return last;
}

RedisForBench::~RedisForBench() {
  if (!server_) return;
  server_->kill(SIGTERM).ignore_error();
  if (!server_->wait(Deadline::after_ms(5000)).ok()) server_->kill(SIGKILL).ignore_error();
}

}  // namespace ecx::bench
