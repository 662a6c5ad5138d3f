// ecx: one command, one subcommand per job (docs/SERVING.md). The benchmarks (every `bench`
// subcommand but `bench serve`, which the demo runs), `eval` and the test hosts' `relay`
// are built apart, as ecx-bench beside this binary (bench/main.cc), and run there.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "ecx/common/log.h"
#include "ecx/common/subprocess.h"
#include "ecx/engine/model.h"
#include "ecx/serve/services.h"
#include "serve_bench.h"

namespace {

// Every service flag can also come from a config file (--config) or an ECX_* environment
// variable. Precedence: a flag on the command line, then the file, then the
// environment, then the default shown in --help.
void add_common_flags(CLI::App* app, ecx::serve::CommonServiceConfig& c) {
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app->add_option("--config", "Read flags from a file of `key = value` lines (keys = flag names)");
  app->add_option("--host", c.host, "Listen address")->envname("ECX_HOST")->capture_default_str();
  app->add_option("--port", c.port, "Listen port (0 = any free port)")
      ->envname("ECX_PORT")
      ->capture_default_str();
  app->add_option("--model", c.model, "Served model name")
      ->envname("ECX_MODEL")
      ->capture_default_str();
  app->add_option("--allowed-root", c.allowed_root, "Folder local image files may come from")
      ->envname("ECX_ALLOWED_ROOT");
  app->add_option("--workers,--threads", c.workers,
                  "Threads running queued requests (0 = the role's default: pd 4, encoder 4, "
                  "proxy 64)")
      ->envname("ECX_WORKERS")
      ->capture_default_str();
  app->add_option("--stuck-after-s", c.stuck_after_s,
                  "/health answers 503 degraded once every worker has been on one request "
                  "this long")
      ->envname("ECX_STUCK_AFTER_S")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  app->add_option("--io-threads", c.io_threads, "Threads holding every HTTP connection")
      ->envname("ECX_IO_THREADS")
      ->capture_default_str();
  app->add_option("--max-queued", c.max_queued,
                  "Requests that may wait for a worker; past it, 503 with Retry-After")
      ->envname("ECX_MAX_QUEUED")
      ->capture_default_str();
  app->add_option(
         "--max-connections", c.max_connections,
         "Client connections held at once (capped by the open-files limit, raised to "
         "its hard limit; 0 = what that limit leaves); past it, work requests get 503 and the "
         "connection closes")
      ->envname("ECX_MAX_CONNECTIONS")
      ->capture_default_str();
  app->add_option("--max-body-bytes", c.max_body_bytes, "One request's body; past it, 413")
      ->envname("ECX_MAX_BODY_BYTES")
      ->capture_default_str();
  app->add_option("--max-buffered-bytes", c.max_buffered_bytes,
                  "Request bodies held at once, all connections together; past it, 503 (0 = a "
                  "quarter of physical memory)")
      ->envname("ECX_MAX_BUFFERED_BYTES")
      ->capture_default_str();
  app->add_option("--idle-timeout", c.idle_timeout_s,
                  "Seconds a keep-alive connection may stay idle before it is closed")
      ->envname("ECX_IDLE_TIMEOUT")
      ->capture_default_str();
  app->add_option("--max-images", c.max_images, "Images per request")
      ->envname("ECX_MAX_IMAGES")
      ->capture_default_str();
  app->add_option("--max-image-bytes", c.max_image_bytes, "Encoded image size limit")
      ->envname("ECX_MAX_IMAGE_BYTES")
      ->capture_default_str();
  app->add_option("--max-image-pixels", c.max_image_pixels, "Decoded image pixel limit")
      ->envname("ECX_MAX_IMAGE_PIXELS")
      ->capture_default_str();
}

void add_connector_flag(CLI::App* app, std::string& connector) {
  app->add_option("--connector", connector, "p2p, p2p:push, p2p:pull-2step, disk, store or local")
      ->envname("ECX_CONNECTOR")
      ->capture_default_str();
}

// The deployment secret (docs/SECURITY.md): a file, or ECX_AUTH_TOKEN.
void add_secret_flags(CLI::App* app, std::string& token, std::string& token_file) {
  app->add_option("--auth-token-file", token_file,
                  "File holding the deployment secret (mode 600); or set ECX_AUTH_TOKEN")
      ->envname("ECX_AUTH_TOKEN_FILE");
  // The secret itself only from the environment: a command line is visible to `ps`.
  if (const char* t = std::getenv("ECX_AUTH_TOKEN")) token = t;
}

// The model and connector flags of E and PD.
void add_engine_flags(CLI::App* app, ecx::serve::EngineConfig& c) {
  add_connector_flag(app, c.connector);
  app->add_option("--ec-config", c.ec_config,
                  "Whole connector config JSON (as vLLM's --ec-transfer-config)")
      ->envname("ECX_EC_CONFIG");
  app->add_option("--weights", c.weights, "Model weights (safetensors); default: seeded")
      ->envname("ECX_WEIGHTS");
  add_secret_flags(app, c.auth_token, c.auth_token_file);
}

void add_max_model_len_flag(CLI::App* app, int64_t& max_model_len) {
  app->add_option("--max-model-len", max_model_len, "Prompt + generated tokens limit")
      ->envname("ECX_MAX_MODEL_LEN")
      ->capture_default_str();
}

void add_request_timeout_flag(CLI::App* app, int64_t& timeout_ms) {
  app->add_option("--request-timeout-ms", timeout_ms, "Deadline of a request")
      ->envname("ECX_REQUEST_TIMEOUT_MS")
      ->capture_default_str();
}

// Membership through etcd (docs/SERVING.md, "Membership (etcd)"). E and PD register
// there; the proxy takes the ones it finds. `instance`: E or PD (the proxy accepts their
// flags without using them, so one config file serves every role).
void add_directory_flags(CLI::App* app, ecx::serve::DirectoryConfig& c, bool instance,
                         std::string& unused) {
  app->add_option("--etcd", c.etcd,
                  instance ? "etcd endpoints (http://host:port,...): register this instance "
                             "there under a lease"
                           : "etcd endpoints (http://host:port,...): route to the encoders and "
                             "PDs registered there too")
      ->envname("ECX_ETCD");
  app->add_option("--etcd-prefix", c.etcd_prefix,
                  "Root of the keys: <prefix>/<model>/instances/<role>/<id>")
      ->envname("ECX_ETCD_PREFIX")
      ->capture_default_str();
  app->add_option("--etcd-cacert", c.etcd_cacert,
                  "CA bundle (PEM) that signed etcd's certificate, for https:// endpoints")
      ->envname("ECX_ETCD_CACERT");
  app->add_option("--etcd-user", c.etcd_user, "etcd user, when etcd's authentication is on")
      ->envname("ECX_ETCD_USER");
  app->add_option("--etcd-password-file", c.etcd_password_file,
                  "File holding the etcd user's password (mode 600); or set ECX_ETCD_PASSWORD")
      ->envname("ECX_ETCD_PASSWORD_FILE");
  if (const char* password = std::getenv("ECX_ETCD_PASSWORD")) c.etcd_password = password;
  if (!instance) {
    app->add_option("--etcd-ttl,--advertise-url", unused,
                    "Not used by this role (accepted, so one config file can serve every role)");
    return;
  }
  app->add_option("--etcd-ttl", c.etcd_ttl_s,
                  "Lease TTL in seconds: a dead instance leaves the proxies after it")
      ->envname("ECX_ETCD_TTL")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  app->add_option("--advertise-url", c.advertise_url,
                  "URL registered in etcd (default: http://HOST:PORT as listening; required "
                  "with --host 0.0.0.0)")
      ->envname("ECX_ADVERTISE_URL");
}

std::vector<std::string> split_urls(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string url;
  while (std::getline(ss, url, ',')) {
    if (!url.empty()) out.push_back(url);
  }
  return out;
}

// What `ecx serve <role>` fills in: one config per role, and sinks for the flags a role
// accepts without using them (so one config file or environment serves every role).
struct ServeCommands {
  ecx::serve::EncoderServiceConfig encoder;
  ecx::serve::PdServiceConfig pd;
  ecx::serve::ProxyServiceConfig proxy;
  ecx::serve::SidecarServiceConfig sidecar;
  std::string encoder_urls, pd_urls;        // the proxy's, comma-separated
  std::string upstream_api = "ecx";         // the proxy's: ecx | vllm
  std::string encoder_routing = "content";  // the proxy's: content | round-robin
  std::string unused_text;
  int64_t unused_number = 0;
};

constexpr const char* kUnused =
    "Not used by this role (accepted, so one config file can serve every role)";

void add_encoder_command(CLI::App* serve, ServeCommands& cmds, std::string& log_level,
                         int* exit_code) {
  CLI::App* s = serve->add_subcommand("encoder", "The encoder service");
  add_common_flags(s, cmds.encoder.common);
  add_engine_flags(s, cmds.encoder.engine);
  add_directory_flags(s, cmds.encoder.directory, true, cmds.unused_text);
  s->add_option("--compat-hash", cmds.unused_text, kUnused);
  add_max_model_len_flag(s, cmds.encoder.max_model_len);
  s->add_option("--request-timeout-ms", cmds.unused_number, kUnused);
  s->add_option("--log-level", log_level, "trace, debug, info, warn, error, off");
  s->callback([&cmds, &log_level, exit_code] {
    cmds.encoder.common.log_level = log_level;
    *exit_code = ecx::serve::run_encoder_service(cmds.encoder);
  });
}

void add_pd_command(CLI::App* serve, ServeCommands& cmds, std::string& log_level, int* exit_code) {
  CLI::App* s = serve->add_subcommand("pd", "The pd service");
  add_common_flags(s, cmds.pd.common);
  add_engine_flags(s, cmds.pd.engine);
  add_directory_flags(s, cmds.pd.directory, true, cmds.unused_text);
  s->add_option("--compat-hash", cmds.unused_text, kUnused);
  add_max_model_len_flag(s, cmds.pd.max_model_len);
  add_request_timeout_flag(s, cmds.pd.request_timeout_ms);
  s->add_option("--log-level", log_level, "trace, debug, info, warn, error, off");
  s->callback([&cmds, &log_level, exit_code] {
    cmds.pd.common.log_level = log_level;
    *exit_code = ecx::serve::run_pd_service(cmds.pd);
  });
}

// An engine's sidecar (docs/VLLM.md, "Membership"): it listens for the proxies'
// challenges; the engine serves elsewhere (--instance-url).
void add_sidecar_command(CLI::App* serve, ServeCommands& cmds, std::string& log_level,
                         int* exit_code) {
  CLI::App* s = serve->add_subcommand(
      "sidecar",
      "Registers an engine that cannot itself (a vllm serve E or PD) in etcd while its /health "
      "answers, and answers the proxies' challenges for it");
  ecx::serve::SidecarServiceConfig& c = cmds.sidecar;
  c.common.port = 0;
  add_common_flags(s, c.common);
  add_directory_flags(s, c.directory, true, cmds.unused_text);
  add_secret_flags(s, c.auth_token, c.auth_token_file);
  for (const char* flag : {"--connector", "--ec-config", "--weights"}) {
    s->add_option(flag, cmds.unused_text, kUnused);
  }
  s->add_option("--role", c.role, "The engine's role: encoder or pd")
      ->required()
      ->check(CLI::IsMember({"encoder", "pd"}));
  s->add_option("--instance-url", c.instance_url,
                "The engine's URL (http://host:port), as proxies reach it")
      ->required()
      ->envname("ECX_INSTANCE_URL");
  s->add_option("--compat-hash", c.compat_hash,
                "Compatibility hash to register (default: the reference model's for --model, "
                "the proxy's default)")
      ->envname("ECX_COMPAT_HASH");
  s->add_option("--health-interval-ms", c.health_interval_ms,
                "Between checks of the engine's /health")
      ->capture_default_str();
  s->add_option("--log-level", log_level, "trace, debug, info, warn, error, off");
  s->callback([&c, &log_level, exit_code] {
    c.common.log_level = log_level;
    *exit_code = ecx::serve::run_sidecar_service(c);
  });
}

void add_proxy_command(CLI::App* serve, ServeCommands& cmds, std::string& log_level,
                       int* exit_code) {
  CLI::App* s = serve->add_subcommand("proxy", "The proxy service");
  add_common_flags(s, cmds.proxy.common);
  add_connector_flag(s, cmds.proxy.connector);
  for (const char* flag : {"--ec-config", "--weights"}) {
    s->add_option(flag, cmds.unused_text, kUnused);
  }
  add_secret_flags(s, cmds.proxy.auth_token, cmds.proxy.auth_token_file);
  s->add_option("--max-model-len", cmds.unused_number, kUnused);
  add_request_timeout_flag(s, cmds.proxy.request_timeout_ms);
  s->add_option("--log-level", log_level, "trace, debug, info, warn, error, off");
  s->add_option("--encoders", cmds.encoder_urls, "Encoder URLs, comma-separated")
      ->envname("ECX_ENCODERS");
  s->add_option("--pd", cmds.pd_urls,
                "Prefill/decode URLs, comma-separated (required unless --etcd finds them)")
      ->envname("ECX_PD");
  add_directory_flags(s, cmds.proxy.directory, false, cmds.unused_text);
  s->add_option("--compat-hash", cmds.proxy.compat_hash,
                "Compatibility hash instances found in etcd must carry (default: the "
                "reference model's for --model)")
      ->envname("ECX_COMPAT_HASH");
  s->add_option("--encode-timeout-ms", cmds.proxy.encode_timeout_ms, "Deadline of one encode")
      ->capture_default_str();
  s->add_option("--upstream-api", cmds.upstream_api,
                "What the encoders speak: ecx (POST /v1/encode) or vllm (a chat completion "
                "holding the image, as vLLM's EPD proxy sends; see docs/SERVING.md)")
      ->check(CLI::IsMember({"ecx", "vllm"}))
      ->capture_default_str()
      ->envname("ECX_UPSTREAM_API");
  s->add_option("--encoder-routing", cmds.encoder_routing,
                "How an image's encoder is picked: content (by its bytes, so a repeated image "
                "reaches the encoder that holds it) or round-robin")
      ->check(CLI::IsMember({"content", "round-robin"}))
      ->capture_default_str()
      ->envname("ECX_ENCODER_ROUTING");
  s->callback([s, &cmds, &log_level, exit_code] {
    cmds.proxy.common.log_level = log_level;
    // In front of vLLM, the served model is what the PDs say it is unless told.
    cmds.proxy.learn_model = cmds.upstream_api == "vllm" && s->get_option("--model")->empty();
    cmds.proxy.encoders = split_urls(cmds.encoder_urls);
    cmds.proxy.pd = split_urls(cmds.pd_urls);
    cmds.proxy.upstream_api = cmds.upstream_api == "vllm" ? ecx::serve::UpstreamApi::kVllm
                                                          : ecx::serve::UpstreamApi::kEcx;
    cmds.proxy.encoder_routing = cmds.encoder_routing == "round-robin"
                                     ? ecx::serve::EncoderRouting::kRoundRobin
                                     : ecx::serve::EncoderRouting::kContent;
    *exit_code = ecx::serve::run_proxy_service(cmds.proxy);
  });
}

// Expands `--config FILE` into flags placed before the command line's own, so a flag
// given on the command line wins (options take the last value). The file has one
// `key = value` per line (TOML-like; quotes optional; # comments and [sections] ignored).
bool expand_config(std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string path;
    if (args[i] == "--config" && i + 1 < args.size()) {
      path = args[i + 1];
    } else if (args[i].rfind("--config=", 0) == 0) {
      path = args[i].substr(9);
    } else {
      continue;
    }
    std::ifstream in(path);
    if (!in) {
      std::cerr << "ecx: cannot read config file " << path << "\n";
      return false;
    }
    std::vector<std::string> flags;
    std::string line;
    while (std::getline(in, line)) {
      auto hash = line.find('#');
      if (hash != std::string::npos) line.resize(hash);
      auto eq = line.find('=');
      auto trim = [](std::string t) {
        t.erase(0, t.find_first_not_of(" \t\r"));
        t.erase(t.find_last_not_of(" \t\r") + 1);
        if (t.size() >= 2 && (t.front() == '"' || t.front() == '\'') && t.back() == t.front())
          t = t.substr(1, t.size() - 2);
        return t;
      };
      if (eq == std::string::npos || trim(line).rfind('[', 0) == 0) continue;
      flags.push_back("--" + trim(line.substr(0, eq)));
      flags.push_back(trim(line.substr(eq + 1)));
    }
    // Insert after "serve <role>" (the first three arguments) and before the rest.
    size_t at = std::min<size_t>(3, args.size());
    args.insert(args.begin() + static_cast<long>(at), flags.begin(), flags.end());
    return true;
  }
  return true;
}

void add_demo_command(CLI::App& app, ecx::serve::DemoOptions& demo, int* exit_code) {
  CLI::App* d =
      app.add_subcommand("demo", "All-in-one on loopback: proxy + 1 E + 1 PD, sample requests");
  d->add_option("--connector", demo.connector, "Connector to demonstrate")->capture_default_str();
  d->add_option("--requests", demo.requests, "Requests to send")->capture_default_str();
  d->add_option("--images", demo.images_per_request, "Images per request")->capture_default_str();
  d->add_option("--max-tokens", demo.max_tokens, "Tokens per answer")->capture_default_str();
  d->add_option("--bench-prompts", demo.bench_prompts,
                "Requests in the closing bench serve run (0 = none)")
      ->capture_default_str();
  d->callback(
      [&demo, exit_code] { *exit_code = ecx::serve::run_demo(demo, ecx::current_executable()); });
}

void add_weights_command(CLI::App& app, std::string& out_path, int* exit_code) {
  CLI::App* weights = app.add_subcommand("weights", "Model weights");
  weights->require_subcommand(1);
  CLI::App* exp =
      weights->add_subcommand("export", "Write the seeded reference weights as safetensors");
  exp->add_option("--out", out_path, "Output file")->required();
  exp->callback([&out_path, exit_code] {
    ecx::engine::ModelConfig mc;
    ecx::Status s = ecx::engine::Weights::seeded(mc).save(out_path);
    if (!s.ok()) {
      std::cerr << "ecx weights export: " << s.to_string() << "\n";
      *exit_code = 1;
    } else {
      std::cout << "wrote " << out_path << "\n";
    }
  });
}

// Whether the command line is one ecx-bench runs: `eval`, `relay`, or `bench` with any
// subcommand but `serve` (`bench --help` included, so that it lists them all).
bool runs_in_ecx_bench(const std::vector<std::string>& args) {
  size_t i = 1;
  while (i < args.size() && args[i].rfind("--log-level", 0) == 0) {
    i += args[i].find('=') == std::string::npos ? 2 : 1;
  }
  if (i >= args.size()) return false;
  if (args[i] == "eval" || args[i] == "relay") return true;
  return args[i] == "bench" && !(i + 1 < args.size() && args[i + 1] == "serve");
}

// Runs ecx-bench in this process (exec), with the same command line, so that a caller's
// pid, pipes and signals reach the benchmark itself. Returns only when it cannot start.
int exec_ecx_bench(char** argv) {
  const std::string bench = ecx::sibling_executable("ecx-bench");
  ::execv(bench.c_str(), argv);
  std::cerr << "ecx: `ecx bench`, `ecx eval` and `ecx relay` run " << bench
            << ", which cannot start (" << std::strerror(errno)
            << "): build it with `scripts/build release` (or `cmake --build build --target "
               "ecx-bench`)\n";
  return 127;
}

}  // namespace

int main(int argc, char** argv) {
  if (runs_in_ecx_bench(std::vector<std::string>(argv, argv + argc))) return exec_ecx_bench(argv);
  CLI::App app{"ecx: encoder-cache transfer for EPD-disaggregated LLM serving"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
  int exit_code = 0;

  // `bench serve` here; `ecx bench --help` lists the others, which run in ecx-bench.
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks (ecx bench --help lists them)");
  bench->require_subcommand(1);
  ecx::bench::add_serve_command(*bench, &exit_code);
  app.add_subcommand("eval", "Correctness: the same requests through every connector vs local");

  app.add_subcommand("relay",
                     "Delaying TCP relay between test hosts (scripts/hosts; docs/HOSTS.md)");

  CLI::App* serve =
      app.add_subcommand("serve", "Run one service: encoder, pd, proxy, or an engine's sidecar");
  serve->require_subcommand(1);
  ServeCommands serve_commands;
  add_encoder_command(serve, serve_commands, log_level, &exit_code);
  add_pd_command(serve, serve_commands, log_level, &exit_code);
  add_proxy_command(serve, serve_commands, log_level, &exit_code);
  add_sidecar_command(serve, serve_commands, log_level, &exit_code);

  ecx::serve::DemoOptions demo;
  add_demo_command(app, demo, &exit_code);
  std::string weights_out;
  add_weights_command(app, weights_out, &exit_code);

  app.parse_complete_callback([&] {
    ecx::Status s = ecx::set_log_level(log_level);
    if (!s.ok()) {
      std::cerr << "ecx: " << s.message() << "\n";
      std::exit(2);
    }
    // ECX_CHECK_ARGS=1: the command line parsed and checked, nothing run (exit 0): what
    // the tests of the docs' commands run (python/tests/test_doc_commands.py).
    if (std::getenv("ECX_CHECK_ARGS") != nullptr) {
      std::cerr << "ECX_CHECK_ARGS: the command line is valid; nothing was run\n";
      throw CLI::Success();
    }
  });
  std::vector<std::string> args(argv, argv + argc);
  if (args.size() > 2 && args[1] == "serve" && !expand_config(args)) return 2;
  std::reverse(args.begin() + 1, args.end());  // CLI11 parses a reversed vector
  args.erase(args.begin());
  try {
    app.parse(std::move(args));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return exit_code;
}
