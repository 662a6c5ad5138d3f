#include "stack.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "ecx/serve/services.h"
#include "transfer/socket.h"

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

Status start_stack(const std::string& connector, const std::string& pool_bytes,
                   const std::string& redis, const std::filesystem::path& dir, StackProcs& s) {
  const std::string exe = current_executable();
  bool local = connector == "local";
  serve::use_new_stack_secret();  // each stack's E and PD share a secret of their own
  json ec = {{"connector", connector.substr(0, connector.find(':'))},
             {"extra", {{"pool_bytes", pool_bytes}}}};
  if (connector.find(':') != std::string::npos)
    ec["extra"]["mode"] = connector.substr(connector.find(':') + 1);
  if (connector == "disk") ec["extra"]["root"] = (dir / "disk").string();
  if (connector == "store") ec["extra"]["redis"] = redis;
  std::vector<std::string> common = {"--port",  "0",           "--ec-config",
                                     ec.dump(), "--log-level", "error"};
  if (!local) {
    std::vector<std::string> argv = {exe, "serve", "encoder"};
    argv.insert(argv.end(), common.begin(), common.end());
    ECX_RETURN_IF_ERROR(launch(s.e, argv).with_context(connector + " encoder"));
  }
  std::vector<std::string> pd_argv = {exe, "serve", "pd"};
  pd_argv.insert(pd_argv.end(), common.begin(), common.end());
  ECX_RETURN_IF_ERROR(launch(s.pd, pd_argv).with_context(connector + " pd"));
  std::vector<std::string> proxy_argv = {exe,           "serve",       "proxy",
                                         "--port",      "0",           "--pd",
                                         s.pd.url,      "--connector", local ? "local" : "p2p",
                                         "--log-level", "error"};
  if (!local) proxy_argv.insert(proxy_argv.end(), {"--encoders", s.e.url});
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
                                            const std::filesystem::path& dir) {
  RedisForBench redis;
  if (redis_answers(address, 1000)) {
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
  for (int attempt = 0; attempt < 3; ++attempt) {
    ECX_ASSIGN_OR_RETURN(auto listener, transfer::listen_tcp("127.0.0.1", 0));
    std::string port = std::to_string(listener.second);
    listener.first.reset();  // free the port for redis-server (retried if taken meanwhile)
    auto server = Subprocess::spawn({exe, "--port", port, "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", dir.string()});
    if (!server.ok()) {
      return Unavailable("no Redis at " + address + ", and redis-server could not start: " +
                         server.status().message() + " (Debian package redis-server)");
    }
    // It logs "Ready to accept connections" once it listens.
    while (true) {
      auto line = server->read_line(Deadline::after_ms(10000));
      if (!line.ok()) break;
      if (line->find("Ready to accept connections") != std::string::npos) {
        redis.address_ = "127.0.0.1:" + port;
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
