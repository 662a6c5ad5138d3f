#include "support/service_process.h"

#include <signal.h>

#include <nlohmann/json.hpp>

#include "ecx/engine/image.h"
#include "ecx/serve/services.h"
#include "http_server/http_server.h"

namespace ecx::testing {

using nlohmann::json;

httplib::Client Service::client(int timeout_s) const {
  httplib::Client cli(host, port);
  cli.set_read_timeout(std::chrono::seconds(timeout_s));
  return cli;
}

Status Service::kill_now() {
  ECX_RETURN_IF_ERROR(process->kill(SIGKILL));
  return process->wait(Deadline::after_ms(20000)).status();
}

Status start(Service& s, const std::string& role, std::vector<std::string> flags) {
  std::vector<std::string> argv = {ECX_BINARY, "serve", role};
  argv.insert(argv.end(), flags.begin(), flags.end());
  ECX_ASSIGN_OR_RETURN(serve::RunningService r,
                       serve::spawn_service(argv, Deadline::after_ms(60000)));
  ECX_ASSIGN_OR_RETURN(auto host_port, serve::parse_url(r.url));
  s.process.emplace(std::move(r.process));
  s.url = r.url;
  s.host = host_port.first;
  s.port = host_port.second;
  return Status::Ok();
}

std::string image_request(uint64_t seed, int max_tokens, bool stream) {
  auto png = engine::encode_png(engine::synthetic_image(112, 112, seed)).value();
  json content = json::array(
      {{{"type", "text"}, {"text", "Describe:"}},
       {{"type", "image_url"}, {"image_url", {{"url", engine::make_data_url(png, "image/png")}}}}});
  return json{{"model", "ecx-tiny-vl"},
              {"messages", json::array({{{"role", "user"}, {"content", content}}})},
              {"max_tokens", max_tokens},
              {"ignore_eos", true},
              {"stream", stream}}
      .dump();
}

httplib::Result chat(const Service& proxy, const std::string& body) {
  return proxy.client().Post("/v1/chat/completions", body, "application/json");
}

}  // namespace ecx::testing
