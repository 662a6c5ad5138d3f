// The reference EPD stack: encoder (E), prefill/decode (PD) and proxy HTTP services,
// OpenAI-compatible at the proxy and PD. Each runs until SIGTERM/SIGINT, then drains
// in-flight requests. On start each prints one line to stdout:
//   "ecx serve <role> listening on http://HOST:PORT"
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ecx/common/deadline.h"
#include "ecx/common/status.h"
#include "ecx/common/subprocess.h"

namespace ecx::serve {

// What every service has: where it listens, what it serves, and what one request may
// hold (413 past a limit).
struct CommonServiceConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;               // 0 = any free port (printed on start)
  std::string model = "ecx-tiny-vl";  // the served model name
  std::string log_level = "warn";     // trace, debug, info, warn, error, off
  int workers = 0;                    // threads running queued work; 0 = the role's default
  // /health says degraded (503) once every worker has been on one request this long.
  int stuck_after_s = 30;
  int io_threads = 2;          // threads holding every connection (Asio)
  uint64_t max_queued = 1024;  // waiting requests past which new ones get 503
  // Client connections held at once; past it (or past what the open-files limit leaves),
  // a new connection gets /health, /metrics and /v1/models but 503 for work, then closes.
  // 0 = as many as the open-files limit leaves.
  uint64_t max_connections = 10000;
  int idle_timeout_s = 60;                // a keep-alive connection with no request is closed
  uint64_t max_body_bytes = 64ull << 20;  // one request's body (413 past it)
  // Request bodies held at once, all connections together (being read, waiting or
  // running); a request that would pass it gets 503. 0 = a quarter of physical memory.
  uint64_t max_buffered_bytes = 0;
  int max_images = 8;  // per chat request
  uint64_t max_image_bytes = 20ull << 20;
  uint64_t max_image_pixels = 4096ull * 4096;
  int max_tokens_limit = 4096;  // the largest max_tokens a chat request may ask for
  std::string allowed_root;     // local image files must be under this folder
};

// What E and PD run: the reference model's weights and an EC connector.
struct EngineConfig {
  std::string connector = "p2p";  // p2p | p2p:push | p2p:pull-2step | disk | store | local
  std::string ec_config;          // whole connector config JSON (overrides `connector`)
  std::string weights;            // safetensors file; empty = seeded weights
  // The deployment secret for E and PD agents (see docs/SECURITY.md): from the
  // ECX_AUTH_TOKEN environment variable, or a file only its owner can read.
  std::string auth_token;
  std::string auth_token_file;
};

// Membership through etcd (docs/SERVING.md, "Membership (etcd)"): E and PD register
// under a lease, <etcd_prefix>/<model>/instances/<role>/<id>; the proxy watches its
// model's instances. Without `etcd`, none of it: the proxy's --encoders/--pd alone.
struct DirectoryConfig {
  std::string etcd;                  // "http://host:port[,...]"; empty = no etcd
  std::string etcd_prefix = "/ecx";  // the key layout's root
  int etcd_ttl_s = 3;                // E/PD: the lease; a dead instance is gone after it
  // E/PD: the URL others reach this instance at; empty = http://HOST:PORT as it listens
  // (required when HOST is 0.0.0.0 or ::).
  std::string advertise_url;
  // etcd over https:// (the CA that signed its certificate), and etcd's own
  // authentication when it is on: a user, and its password from ECX_ETCD_PASSWORD or a
  // file only its owner can read.
  std::string etcd_cacert;
  std::string etcd_user;
  std::string etcd_password;
  std::string etcd_password_file;
};

struct EncoderServiceConfig {
  CommonServiceConfig common;
  EngineConfig engine;
  DirectoryConfig directory;
  // The model's context (prompt + generated tokens), as the PDs have it: images whose
  // tokens could never fit are refused before they are encoded.
  int64_t max_model_len = 16384;
};

struct PdServiceConfig {
  CommonServiceConfig common;
  EngineConfig engine;
  DirectoryConfig directory;
  int64_t max_model_len = 16384;        // prompt + generated tokens
  int64_t request_timeout_ms = 120000;  // deadline of the EC load
};

// What the proxy's upstreams speak: ecx's own encoder API, or vLLM's (what its EPD proxy
// sends; docs/SERVING.md).
enum class UpstreamApi {
  kEcx,   // POST /v1/encode per image; POST /v1/ec/release gives params back
  kVllm,  // POST /v1/chat/completions holding the image, answered with ec_transfer_params
};

// How the proxy picks an image's encoder.
enum class EncoderRouting {
  kContent,     // by the image's bytes (rendezvous hashing): a repeated image meets the
                // encoder that holds it
  kRoundRobin,  // the next encoder, whatever the image (what vLLM's example proxy does)
};

struct ProxyServiceConfig {
  CommonServiceConfig common;
  UpstreamApi upstream_api = UpstreamApi::kEcx;
  EncoderRouting encoder_routing = EncoderRouting::kContent;
  // "local": the PDs encode images themselves and the encoders are not used.
  std::string connector = "p2p";
  std::vector<std::string> encoders;  // E URLs (static; etcd may add more)
  std::vector<std::string> pd;        // PD URLs (static; etcd may add more)
  DirectoryConfig directory;          // with etcd: the encoders and PDs registered there
  // The compatibility hash instances found through etcd must carry; empty = the
  // reference model's for --model (what E and PD use unless --ec-config sets another).
  std::string compat_hash;
  // The deployment secret: instances found in etcd must prove they hold it (their
  // signed record, and an answer to the proxy's challenge) before they get traffic.
  std::string auth_token;
  std::string auth_token_file;
  int64_t encode_timeout_ms = 30000;    // proxy -> E, per image
  int64_t request_timeout_ms = 120000;  // proxy -> PD
  // The served model is learnt from the PDs (GET /v1/models, by the prober) rather than
  // common.model: a request must name one of the models its PDs serve (`ecx serve proxy
  // --upstream-api vllm` without --model).
  bool learn_model = false;
};

// The sidecar (`ecx serve sidecar`) of an engine that cannot join ecx's membership
// itself (a `vllm serve` E or PD; docs/VLLM.md, "Membership"): beside the engine, it
// registers the engine's URL in etcd under a lease while the engine's /health answers
// 200, deregisters it when it does not, and answers the proxies' challenges for it
// (GET /v1/ecx/prove, with the deployment secret the engine's ECXConnector uses).
struct SidecarServiceConfig {
  CommonServiceConfig common;  // where the sidecar itself listens (the challenges)
  DirectoryConfig directory;   // required: etcd, and the sidecar's advertised URL
  std::string role;            // the engine's: "encoder" or "pd"
  std::string instance_url;    // the engine's: http://host:port
  // What the proxies filter members on; empty = the reference model's for --model (the
  // proxy's default).
  std::string compat_hash;
  std::string auth_token;  // the deployment secret: ECX_AUTH_TOKEN, or a file
  std::string auth_token_file;
  int64_t health_interval_ms = 500;  // between checks of the engine's /health
};

// A service started as a child process, once it listens.
struct RunningService {
  Subprocess process;
  std::string url;     // "http://HOST:PORT"
  std::string before;  // what it printed before that line (log lines), one per line
};
// Starts `argv` (an `ecx serve ...` command line) and waits, until `deadline`, for its
// "listening on http://HOST:PORT" line.
Result<RunningService> spawn_service(const std::vector<std::string>& argv, Deadline deadline);
// A fresh deployment secret for the stack a process starts (`ecx demo`, `ecx bench epd`):
// random, in a file of its own (mode 600, in a directory only its owner can enter,
// both removed with this object). The services get it as `--auth-token-file` (flags()):
// no environment variable hands it to every child the process starts.
class StackSecret {
 public:
  static Result<StackSecret> create();
  StackSecret(StackSecret&& other) noexcept;
  StackSecret& operator=(StackSecret&& other) noexcept;
  StackSecret(const StackSecret&) = delete;
  StackSecret& operator=(const StackSecret&) = delete;
  ~StackSecret();

  const std::string& path() const { return path_; }
  // {"--auth-token-file", path()}: what gives a service the secret.
  std::vector<std::string> flags() const { return {"--auth-token-file", path_}; }

 private:
  StackSecret(std::string dir, std::string path) : dir_(std::move(dir)), path_(std::move(path)) {}
  std::string dir_;
  std::string path_;
};
// SIGTERM (drain), then SIGKILL if it has not exited by `deadline`.
void stop_service(Subprocess& process, Deadline deadline);

// A chat completion body (JSON text): `text`, then one 560x560 synthetic PNG per seed,
// greedy with ignore_eos. What the demo and `ecx eval` send.
std::string sample_chat_request(const std::string& text, const std::vector<uint64_t>& image_seeds,
                                int max_tokens);

// Each returns the process exit code.
int run_encoder_service(const EncoderServiceConfig& config);
int run_pd_service(const PdServiceConfig& config);
int run_sidecar_service(const SidecarServiceConfig& config);
int run_proxy_service(const ProxyServiceConfig& config);

struct DemoOptions {
  std::string connector = "p2p";
  int requests = 4;
  int images_per_request = 2;
  int max_tokens = 24;
  int bench_prompts = 12;  // the short `ecx bench serve` run at the end (0 = none)
};
int run_demo(const DemoOptions& options, const std::string& self_exe);

}  // namespace ecx::serve
