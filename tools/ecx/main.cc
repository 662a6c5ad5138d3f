// ecx: one binary, one subcommand per job (DESIGN.md §7).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "bench.h"
#include "ecx/common/log.h"
#include "ecx/engine/model.h"
#include "ecx/serve/services.h"
#include "epd_bench.h"
#include "serve_bench.h"

namespace {

std::string self_exe() {
  char buf[4096] = {};
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "ecx";
}

// Every service flag can also come from a config file (--config) or an ECX_* environment
// variable. Precedence: a flag on the command line, then the file, then the
// environment, then the default shown in --help.
void add_service_flags(CLI::App* app, ecx::serve::ServiceConfig& c) {
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app->add_option("--config", "Read flags from a file of `key = value` lines (keys = flag names)");
  app->add_option("--host", c.host, "Listen address")->envname("ECX_HOST")->capture_default_str();
  app->add_option("--port", c.port, "Listen port (0 = any free port)")
      ->envname("ECX_PORT")
      ->capture_default_str();
  app->add_option("--model", c.model, "Served model name")
      ->envname("ECX_MODEL")
      ->capture_default_str();
  app->add_option("--connector", c.connector, "p2p, p2p:push, p2p:pull-2step, disk, store or local")
      ->envname("ECX_CONNECTOR")
      ->capture_default_str();
  app->add_option("--ec-config", c.ec_config,
                  "Whole connector config JSON (as vLLM's --ec-transfer-config)")
      ->envname("ECX_EC_CONFIG");
  app->add_option("--weights", c.weights, "Model weights (safetensors); default: seeded")
      ->envname("ECX_WEIGHTS");
  app->add_option("--allowed-root", c.allowed_root, "Folder local image files may come from")
      ->envname("ECX_ALLOWED_ROOT");
  app->add_option("--threads", c.threads, "HTTP worker threads")
      ->envname("ECX_THREADS")
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
  app->add_option("--max-model-len", c.max_model_len, "Prompt + generated tokens limit")
      ->envname("ECX_MAX_MODEL_LEN")
      ->capture_default_str();
  app->add_option("--request-timeout-ms", c.request_timeout_ms, "Deadline of a request")
      ->envname("ECX_REQUEST_TIMEOUT_MS")
      ->capture_default_str();
  app->add_option("--auth-token-file", c.auth_token_file,
                  "File holding the deployment secret (mode 600); or set ECX_AUTH_TOKEN")
      ->envname("ECX_AUTH_TOKEN_FILE");
  // The secret itself only from the environment: a command line is visible to `ps`.
  if (const char* token = std::getenv("ECX_AUTH_TOKEN")) c.auth_token = token;
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ecx: encoder-cache transfer for EPD-disaggregated LLM serving"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();
  int exit_code = 0;

  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  ecx::bench::add_transfer_commands(*bench, &exit_code);
  ecx::bench::add_serve_command(*bench, &exit_code);
  ecx::bench::add_epd_command(*bench, &exit_code);
  ecx::bench::add_eval_command(app, &exit_code);

  CLI::App* serve = app.add_subcommand("serve", "Run one service: encoder, pd or proxy");
  serve->require_subcommand(1);
  ecx::serve::ServiceConfig cfg;
  std::string encoders, pds;
  for (const char* role : {"encoder", "pd", "proxy"}) {
    CLI::App* s = serve->add_subcommand(role, std::string("The ") + role + " service");
    add_service_flags(s, cfg);
    s->add_option("--log-level", log_level, "trace, debug, info, warn, error, off");
    if (std::string(role) == "proxy") {
      s->add_option("--encoders", encoders, "Encoder URLs, comma-separated")
          ->envname("ECX_ENCODERS");
      s->add_option("--pd", pds, "Prefill/decode URLs, comma-separated")
          ->envname("ECX_PD")
          ->required();
      s->add_option("--encode-timeout-ms", cfg.encode_timeout_ms, "Deadline of one encode")
          ->capture_default_str();
    }
    std::string r = role;
    s->callback([&, r] {
      auto split = [](const std::string& t) {
        std::vector<std::string> out;
        std::stringstream ss(t);
        std::string x;
        while (std::getline(ss, x, ',')) {
          if (!x.empty()) out.push_back(x);
        }
        return out;
      };
      cfg.encoders = split(encoders);
      cfg.pd = split(pds);
      ecx::set_log_level(log_level).ignore_error();
      exit_code = r == "encoder" ? ecx::serve::run_encoder_service(cfg)
                  : r == "pd"    ? ecx::serve::run_pd_service(cfg)
                                 : ecx::serve::run_proxy_service(cfg);
    });
  }

  ecx::serve::DemoOptions demo;
  CLI::App* d =
      app.add_subcommand("demo", "All-in-one on loopback: proxy + 1 E + 1 PD, sample requests");
  d->add_option("--connector", demo.connector, "Connector to demonstrate")->capture_default_str();
  d->add_option("--requests", demo.requests, "Requests to send")->capture_default_str();
  d->add_option("--images", demo.images_per_request, "Images per request")->capture_default_str();
  d->add_option("--max-tokens", demo.max_tokens, "Tokens per answer")->capture_default_str();
  d->add_option("--bench-prompts", demo.bench_prompts,
                "Requests in the closing bench serve run (0 = none)")
      ->capture_default_str();
  d->callback([&] { exit_code = ecx::serve::run_demo(demo, self_exe()); });

  CLI::App* weights = app.add_subcommand("weights", "Model weights");
  weights->require_subcommand(1);
  std::string out_path;
  CLI::App* exp =
      weights->add_subcommand("export", "Write the seeded reference weights as safetensors");
  exp->add_option("--out", out_path, "Output file")->required();
  exp->callback([&] {
    ecx::engine::ModelConfig mc;
    ecx::Status s = ecx::engine::Weights::seeded(mc).save(out_path);
    if (!s.ok()) {
      std::cerr << "ecx weights export: " << s.to_string() << "\n";
      exit_code = 1;
    } else {
      std::cout << "wrote " << out_path << "\n";
    }
  });

  app.parse_complete_callback([&] {
    ecx::Status s = ecx::set_log_level(log_level);
    if (!s.ok()) {
      std::cerr << "ecx: " << s.message() << "\n";
      std::exit(2);
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
