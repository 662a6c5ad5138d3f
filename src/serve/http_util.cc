#include "serve/http_util.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#include "ecx/common/log.h"
#include "ecx/engine/image.h"

namespace ecx::serve {

using nlohmann::json;

void send_error(httplib::Response& res, int http_status, const std::string& type,
                const std::string& message) {
  res.status = http_status;
  res.set_content(
      safe_dump(json{{"error", {{"message", message}, {"type", type}, {"code", http_status}}}}),
      "application/json");
}

int http_status_for(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return 400;
    case StatusCode::kNotFound:
      return 404;
    case StatusCode::kResourceExhausted:
      return 413;
    case StatusCode::kDeadlineExceeded:
      return 504;
    case StatusCode::kUnavailable:
    case StatusCode::kIncompatible:
    case StatusCode::kEvicted:
    case StatusCode::kNotReady:
      return 502;
    default:
      return 500;
  }
}

void send_status(httplib::Response& res, const Status& s) {
  send_error(res, http_status_for(s), std::string(status_code_name(s.code())), s.message());
}

void Metrics::add(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name][labels] += value;
}

void Metrics::set(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name][labels] = value;
}

void Metrics::observe(const std::string& name, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  values_[name + "_sum"][labels] += value;
  values_[name + "_count"][labels] += 1;
}

std::string Metrics::render(const std::string& help_prefix) const {
  std::lock_guard lock(mu_);
  std::ostringstream out;
  for (const auto& [name, series] : values_) {
    out << "# HELP " << name << " " << help_prefix << "\n";
    out << "# TYPE " << name
        << (name.ends_with("_total") || name.ends_with("_count") || name.ends_with("_sum")
                ? " counter\n"
                : " gauge\n");
    for (const auto& [labels, v] : series) {
      out << name << (labels.empty() ? "" : "{" + labels + "}") << " " << v << "\n";
    }
  }
  return out.str();
}

int ChatRequest::image_count() const {
  int n = 0;
  for (const auto& m : messages) {
    for (const auto& p : m.parts) n += p.kind == ContentPart::kImage;
  }
  return n;
}

namespace {

std::optional<RequestError> bad(const std::string& message, int status = 400) {
  return RequestError{status, status == 413 ? "request_too_large" : "invalid_request_error",
                      message};
}

// Resolves an image URL to its bytes: data: URLs and files under the allowed root.
std::optional<RequestError> resolve_image(const std::string& url, const ServiceConfig& config,
                                          std::string* bytes) {
  if (url.rfind("data:", 0) == 0) {
    if (url.size() > config.max_image_bytes * 4 / 3 + 256) {
      return bad("image data URL exceeds " + std::to_string(config.max_image_bytes) + " bytes",
                 413);
    }
    auto decoded = engine::decode_data_url(url);
    if (!decoded.ok()) return bad("image_url: " + decoded.status().message());
    *bytes = std::move(*decoded);
  } else if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    return bad("image_url: remote URLs are not fetched; send a data: URL or a local file");
  } else {
    std::string path = url.rfind("file://", 0) == 0 ? url.substr(7) : url;
    if (config.allowed_root.empty())
      return bad("image_url: local files are not allowed (no --allowed-root)");
    std::error_code ec;
    auto root = std::filesystem::weakly_canonical(config.allowed_root, ec);
    auto file = std::filesystem::weakly_canonical(path, ec);
    auto rel = file.lexically_relative(root);
    if (ec || rel.empty() || rel.native().rfind("..", 0) == 0 ||
        !std::filesystem::is_regular_file(file, ec)) {
      return bad("image_url: '" + path.substr(0, 200) + "' is not a file under the allowed root");
    }
    if (std::filesystem::file_size(file, ec) > config.max_image_bytes) {
      return bad("image file exceeds " + std::to_string(config.max_image_bytes) + " bytes", 413);
    }
    std::ifstream in(file, std::ios::binary);
    bytes->assign(std::istreambuf_iterator<char>(in), {});
  }
  if (bytes->size() > config.max_image_bytes) {
    return bad("image of " + std::to_string(bytes->size()) + " bytes exceeds " +
                   std::to_string(config.max_image_bytes),
               413);
  }
  return std::nullopt;
}

}  // namespace

std::optional<RequestError> parse_chat_request(const std::string& body, const ServiceConfig& config,
                                               ChatRequest* out) {
  if (json_too_deep(body)) return bad("request body nests deeper than 64 levels");
  json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) return bad("request body is not valid JSON");
  if (!j.is_object()) return bad("request body must be a JSON object");
  out->raw = j;
  if (!j.contains("model") || !j["model"].is_string()) return bad("'model' must be a string");
  out->model = j["model"];
  if (out->model != config.model) {
    return RequestError{400, "model_not_found",
                        "model '" + out->model.substr(0, 100) + "' is not served here (this is '" +
                            config.model + "')"};
  }
  if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty()) {
    return bad("'messages' must be a non-empty array");
  }
  if (j.contains("stream") && !j["stream"].is_boolean()) return bad("'stream' must be a boolean");
  out->stream = j.value("stream", false);
  if (j.contains("stream_options")) {
    if (!j["stream_options"].is_object()) return bad("'stream_options' must be an object");
    const json& so = j["stream_options"];
    if (so.contains("include_usage") && !so["include_usage"].is_boolean()) {
      return bad("'stream_options.include_usage' must be a boolean");
    }
    out->include_usage = so.value("include_usage", false);
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (j.contains(key) && !j[key].is_null()) {
      if (!j[key].is_number_integer()) return bad(std::string("'") + key + "' must be an integer");
      int64_t v = j[key].get<int64_t>();
      if (v < 1 || v > config.max_tokens_limit) {
        return bad(std::string("'") + key + "' must be between 1 and " +
                   std::to_string(config.max_tokens_limit));
      }
      out->max_tokens = static_cast<int>(v);
    }
  }
  if (j.contains("ignore_eos") && !j["ignore_eos"].is_boolean())
    return bad("'ignore_eos' must be a boolean");
  out->ignore_eos = j.value("ignore_eos", false);
  if (j.contains("ec_transfer_params")) {
    if (!j["ec_transfer_params"].is_object())
      return bad("'ec_transfer_params' must be an object keyed by mm_hash");
    out->ec_transfer_params = j["ec_transfer_params"];
  }
  for (const auto& m : j["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      return bad("every message needs a string 'role'");
    }
    ChatMessage msg;
    msg.role = m["role"];
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant") {
      return bad("unknown role '" + msg.role.substr(0, 50) + "'");
    }
    const json& content = m.contains("content") ? m["content"] : json();
    if (content.is_string()) {
      msg.parts.push_back({ContentPart::kText, content.get<std::string>(), "", ""});
    } else if (content.is_array()) {
      for (const auto& part : content) {
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
          return bad("every content part needs a string 'type'");
        }
        std::string type = part["type"];
        if (type == "text") {
          if (!part.contains("text") || !part["text"].is_string())
            return bad("text part needs a string 'text'");
          msg.parts.push_back({ContentPart::kText, part["text"], "", ""});
        } else if (type == "image_url") {
          const json& iu = part.contains("image_url") ? part["image_url"] : json();
          std::string url;
          if (iu.is_string()) {
            url = iu;
          } else if (iu.is_object() && iu.contains("url") && iu["url"].is_string()) {
            url = iu["url"];
          } else {
            return bad("image_url part needs 'image_url': {'url': string}");
          }
          ContentPart p{ContentPart::kImage, "", url, ""};
          if (auto err = resolve_image(url, config, &p.image_bytes)) return err;
          msg.parts.push_back(std::move(p));
        } else {
          return bad("unsupported content part type '" + type.substr(0, 50) + "'");
        }
      }
    } else {
      return bad("'content' must be a string or an array of parts");
    }
    out->messages.push_back(std::move(msg));
    if (out->image_count() > config.max_images) {
      return bad("more than " + std::to_string(config.max_images) + " images in one request", 413);
    }
  }
  return std::nullopt;
}

void add_common_routes(httplib::Server& server, const ServiceConfig& config,
                       const std::string& role, const std::function<std::string()>& metrics,
                       std::function<HealthReport()> health) {
  // Structured logs: key=value, one line per request.
  spdlog::set_pattern("ts=%Y-%m-%dT%H:%M:%S.%e level=%l service=" + role + " pid=%P %v");
  server.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    spdlog::info("method={} path={} status={} bytes_in={} bytes_out={}", req.method, req.path,
                 res.status, req.body.size(), res.body.size());
  });
  server.Get("/health", [role, health](const httplib::Request&, httplib::Response& res) {
    HealthReport report{200, json{{"status", "ok"}, {"role", role}}};
    if (health) report = health();
    res.status = report.http_status;
    res.set_content(safe_dump(report.body), "application/json");
  });
  server.Get("/v1/models", [config](const httplib::Request&, httplib::Response& res) {
    json model = {{"id", config.model}, {"object", "model"}, {"created", 0}, {"owned_by", "ecx"}};
    res.set_content(json{{"object", "list"}, {"data", json::array({model})}}.dump(),
                    "application/json");
  });
  server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4");
  });
  server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) {
      std::string type = res.status == 404   ? "not_found"
                         : res.status == 413 ? "request_too_large"
                                             : "error";
      send_error(res, res.status, type, "HTTP " + std::to_string(res.status));
    }
  });
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, 500, "internal_error", what);
      });
}

void block_shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int serve_until_signal(httplib::Server& server, const ServiceConfig& config,
                       const std::string& role) {
  // Signals are taken synchronously by this thread; every other thread blocks them.
  block_shutdown_signals();
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int threads = std::max(1, config.threads);
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  server.set_payload_max_length(config.max_body_bytes);
  // The distribution's cpp-httplib listens with a backlog of 5: a burst of concurrent
  // clients (a proxy encoding 24 images at once) overflows it and connections fail.
  // Keep the listening socket and raise its backlog after bind. SO_REUSEADDR only: two
  // servers must never share a port by accident (the library default is SO_REUSEPORT).
  int listen_fd = -1;
  server.set_socket_options([&listen_fd](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  int port = config.port;
  if (port == 0) {
    port = server.bind_to_any_port(config.host);
    if (port < 0) port = 0;
  } else if (!server.bind_to_port(config.host, port)) {
    port = 0;
  }
  if (port == 0) {
    std::cerr << "ecx serve " << role << ": cannot listen on " << config.host << ":" << config.port
              << "\n";
    return 1;
  }
  if (listen_fd >= 0) ::listen(listen_fd, 1024);
  std::thread listener([&] { server.listen_after_bind(); });
  std::cout << "ecx serve " << role << " listening on http://" << config.host << ":" << port
            << std::endl;
  spdlog::info("{} listening on {}:{}", role, config.host, port);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("{}: signal {}, draining in-flight requests", role, sig);
  server.stop();  // stops accepting; the thread pool finishes the requests it has
  listener.join();
  return 0;
}

Result<std::pair<std::string, int>> parse_url(const std::string& url) {
  std::string rest = url;
  if (rest.rfind("http://", 0) == 0) rest = rest.substr(7);
  if (rest.rfind("https://", 0) == 0) return InvalidArgument("https is not supported: " + url);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  auto colon = rest.rfind(':');
  if (colon == std::string::npos) return InvalidArgument("URL needs a port: " + url);
  std::string port_text = rest.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port <= 0 || port > 65535) {
    return InvalidArgument("bad port in URL: " + url);
  }
  return std::make_pair(rest.substr(0, colon), static_cast<int>(port));
}

std::string make_id(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char buf[32];
  std::snprintf(
      buf, sizeof(buf), "%016llx",
      static_cast<unsigned long long>(salt ^ (counter.fetch_add(1) * 0x9e3779b97f4a7c15ULL)));
  return prefix + "-" + buf;
}

}  // namespace ecx::serve
