// The proxy: the OpenAI-compatible front. Sends a request's images to encode
// instances concurrently (rendezvous hashing on the image bytes, so a repeated image
// lands on the E that has it cached), merges their ec_transfer_params into the request,
// forwards it to the least-loaded PD and streams the answer back.
//
// Availability: a prober keeps a reachable flag per upstream (serve/upstream.h). An
// image whose encoder fails goes to the next live encoder; when none can encode it,
// the request goes to the PD without params for it and the PD encodes it itself. A PD
// that refuses the connection is skipped for the next one. /health reads the flags only.
//
// Membership: the upstreams are one snapshot (serve/upstream_set.h) that each request
// reads once. With --etcd, the encoders and PDs registered for the proxy's model join and
// leave it as etcd says (directory/membership.h), the prober following; GET /v1/upstreams
// lists them.
//
// Pins: every params an encoder issued pins its block there until the PD that reads it
// releases it. A request abandoned before a PD took it (no PD reachable, the PD
// answered an error, a bad image among its others) gives its params back to their
// encoders (encoder_client.h).
//
// Threads: none per request. A request is one C++20 coroutine (Proxy::chat) on the
// threads of the proxy's HTTP client, not the server's I/O threads (which keep answering
// /health): it reads in order, parse -> encode_all -> forward_to_pd -> relay, and each
// co_await gives its thread back until an answer comes. Every call upstream (encode,
// forward to a PD, release) goes through one asynchronous HTTP client with a pool of
// keep-alive connections per upstream (http/http_client.h). A streamed answer is relayed
// piece by piece; while the client's buffer is full, the PD's connection is not read.
//
// --upstream-api vllm: each image goes to its encoder as the chat completion vLLM's EPD
// proxy sends, keyed by a uuid the PD's copy of the image carries too; the entries of the
// answer's ec_transfer_params travel to the PD unchanged. Everything else is the same.
#include <thread>

#include "serve/proxy.h"

namespace ecx::serve {

using nlohmann::json;

HealthReport Proxy::health() const {
  auto members = upstreams_.snapshot();
  const UpstreamList& pds = members->pds;
  const UpstreamList& encoders = members->encoders;
  bool use_encoders = use_encoders_ && !encoders.empty();
  json upstreams = json::array();
  int pd_up = 0, encoders_up = 0;
  std::string pd_errors;
  auto describe = [&](const Upstream& u) {
    bool up = u.reachable();
    std::string error = u.last_error();
    upstreams.push_back(
        {{"role", u.role}, {"url", u.url}, {"reachable", up}, {"last_error", error}});
    return std::make_pair(up, error);
  };
  for (const auto& pd : pds) {
    auto [up, error] = describe(*pd);
    pd_up += up;
    if (!up) pd_errors += (pd_errors.empty() ? "" : "; ") + pd->url + ": " + error;
  }
  if (use_encoders) {
    for (const auto& e : encoders) encoders_up += describe(*e).first;
  }
  json body = {{"role", "proxy"},
               {"pd_reachable", pd_up},
               {"pd_total", pds.size()},
               {"encoders_reachable", encoders_up},
               {"encoders_total", use_encoders ? encoders.size() : 0},
               {"upstreams", upstreams}};
  if (pd_up == 0) {
    body["status"] = "unavailable";
    body["reason"] = pds.empty() ? std::string("no PD is known (none registered in etcd yet)")
                                 : "no reachable PD (" + pd_errors + ")";
    return {503, body};
  }
  if (use_encoders && encoders_up == 0) {
    body["status"] = "degraded";
    body["reason"] = "no reachable encoder: PDs encode images themselves";
  } else {
    body["status"] = "ok";
  }
  return {200, body};
}

bool Proxy::apply_membership(const std::vector<directory::Instance>& instances) {
  MembershipChange change = upstreams_.set_discovered(instances);
  for (const auto& [list, what] :
       {std::pair<const UpstreamList*, const char*>{&change.added, "added"},
        std::pair<const UpstreamList*, const char*>{&change.removed, "removed"}}) {
    for (const auto& u : *list) {
      spdlog::info("event=upstream_{} role={} url={} source={}", what, u->role, u->url, u->source);
      metrics_.add(metric::kProxyMembershipChanges, 1, {{"role", u->role}, {"change", what}});
    }
  }
  if (!change.empty()) {
    auto members = upstreams_.snapshot();
    spdlog::info("event=membership encoders={} pds={}", members->encoders.size(),
                 members->pds.size());
  }
  return !change.empty();
}

std::string Proxy::render_metrics() {
  // The members now, rendered here (not kept in metrics_): one that left leaves no series.
  auto members = upstreams_.snapshot();
  Metrics now;
  now.set(metric::kProxyUpstreams, static_cast<double>(members->encoders.size()),
          {{"role", "encoder"}});
  now.set(metric::kProxyUpstreams, static_cast<double>(members->pds.size()), {{"role", "pd"}});
  for (const auto* list : {&members->pds, &members->encoders}) {
    for (const auto& u : *list) {
      now.set(metric::kProxyUpstreamUp, u->reachable() ? 1 : 0,
              {{"role", u->role}, {"url", u->url}});
    }
  }
  return metrics_.render() + now.render();
}

std::string Proxy::upstreams_json() const {
  auto members = upstreams_.snapshot();
  json list = json::array();
  for (const auto* role : {&members->encoders, &members->pds}) {
    for (const auto& u : *role) {
      list.push_back({{"url", u->url},
                      {"role", u->role},
                      {"source", u->source},
                      {"reachable", u->reachable()},
                      {"proven", !u->must_prove() || u->proven()},
                      {"in_flight", u->in_flight.load()},
                      {"last_error", u->last_error()}});
    }
  }
  return safe_dump(json{{"upstreams", list}});
}

namespace {

// Bounds each call to etcd, and how long start-up waits for the first read of members.
constexpr std::chrono::milliseconds kEtcdTimeout{2000};
constexpr std::chrono::milliseconds kEtcdSyncWait{3000};

// One Upstream per URL. Shared: a streaming fetch thread may outlive the handler that
// started it.
Result<UpstreamList> make_upstreams(const std::vector<std::string>& urls, const std::string& role) {
  UpstreamList out;
  for (const auto& url : urls) {
    ECX_ASSIGN_OR_RETURN(auto host_port, parse_url(url));
    out.push_back(std::make_shared<Upstream>(role, url, host_port.first, host_port.second));
  }
  return out;
}

// The instances of the proxy's model registered in etcd, followed into `proxy` and
// `prober` from the first read on (waited for, at most kEtcdSyncWait: without etcd the
// proxy starts with its static upstreams and takes the others when etcd answers).
std::unique_ptr<directory::MembershipWatcher> watch_membership(const ProxyServiceConfig& config,
                                                               directory::EtcdClient etcd,
                                                               const std::string& secret,
                                                               Proxy& proxy,
                                                               UpstreamProber& prober) {
  directory::MembershipOptions options;
  options.secret = secret;  // only records the deployment signed
  options.root = config.directory.etcd_prefix;
  options.model = config.common.model;
  options.compat_hash = config.compat_hash;
  if (options.compat_hash.empty()) {
    engine::ModelConfig reference;
    reference.model_id = config.common.model;
    options.compat_hash = reference.compat_hash();
  }
  spdlog::info("event=watching prefix={} compat_hash={} etcd={}",
               directory::instances_prefix(options.root, options.model), options.compat_hash,
               config.directory.etcd);
  auto watcher = std::make_unique<directory::MembershipWatcher>(
      std::move(etcd), options, [&proxy, &prober](const std::vector<directory::Instance>& all) {
        if (proxy.apply_membership(all)) prober.update(proxy.probed());
      });
  if (!watcher->wait_synced(Deadline::after(kEtcdSyncWait))) {
    spdlog::warn(
        "event=etcd_unreachable etcd={}: serving with the static upstreams until it "
        "answers",
        config.directory.etcd);
  }
  return watcher;
}

// Where the proxy finds its PDs and its model, as the flags say: an error names the flag.
Status check_upstream_flags(const ProxyServiceConfig& config, bool no_static_pd) {
  if (no_static_pd && config.directory.etcd.empty())
    return InvalidArgument("--pd needs at least one URL (or --etcd, to find PDs there)");
  if (config.learn_model && !config.directory.etcd.empty()) {
    return InvalidArgument(
        "--etcd needs --model: instances register under their model's name, which the proxy "
        "must know before it finds them");
  }
  return Status::Ok();
}

void add_proxy_routes(HttpServer& server, Proxy& proxy, const ProxyServiceConfig& config,
                      bool secured) {
  server.async_work("POST", "/v1/chat/completions",
                    [&](std::shared_ptr<HttpRequest> req, std::shared_ptr<AsyncReply> reply) {
                      proxy.handle_chat(std::move(req), std::move(reply));
                    });
  server.fast("GET", "/v1/upstreams", [&](const HttpRequest&, HttpResponse& res) {
    res.set_content(proxy.upstreams_json(), "application/json");
  });
  add_common_routes(
      server, config.common, "proxy", secured, [&] { return proxy.render_metrics(); },
      [&] { return proxy.health(); });
  if (!config.learn_model) return;
  server.fast("GET", "/v1/models", [&proxy](const HttpRequest&, HttpResponse& res) {
    nlohmann::json data = nlohmann::json::array();  // what the PDs serve, not common.model
    for (const auto& m : proxy.served_models()) {
      data.push_back({{"id", m}, {"object", "model"}, {"created", 0}, {"owned_by", "ecx"}});
    }
    res.set_content(nlohmann::json{{"object", "list"}, {"data", data}}.dump(), "application/json");
  });
}

}  // namespace

int run_proxy_service(const ProxyServiceConfig& config) {
  block_shutdown_signals();
  set_log_level(config.common.log_level).ignore_error();
  const bool secured = announce_secret("proxy", config.auth_token, config.auth_token_file);
  auto encoders = make_upstreams(config.encoders, "encoder");
  auto pds = make_upstreams(config.pd, "pd");
  Status usable = !encoders.ok() ? encoders.status()
                  : !pds.ok()    ? pds.status()
                                 : check_upstream_flags(config, pds->empty());
  if (!usable.ok()) {
    std::cerr << "ecx serve proxy: " << usable.message() << "\n";
    return 2;
  }
  auto secret = load_secret(config.auth_token, config.auth_token_file);
  if (!secret.ok()) {
    std::cerr << "ecx serve proxy: " << secret.status().message() << "\n";
    return 2;
  }
  std::optional<directory::EtcdClient> etcd;
  if (!config.directory.etcd.empty()) {
    auto access = etcd_access(config.directory);
    auto client = access.ok()
                      ? directory::EtcdClient::create(config.directory.etcd, kEtcdTimeout, *access)
                      : Result<directory::EtcdClient>(access.status());
    if (!client.ok()) {
      std::cerr << "ecx serve proxy: --etcd: " << client.status().message() << "\n";
      return 2;
    }
    etcd.emplace(std::move(*client));
  }
  Proxy proxy(config, std::move(*encoders), std::move(*pds));
  // Probed every 250 ms until the server has stopped (the prober is destroyed after it),
  // following membership.
  UpstreamProber prober(proxy.probed(), UpstreamProber::Options{
                                            .secret = *secret, .learn_models = config.learn_model});
  // Requests run at once (each waits on E and PD without a thread); the rest queue.
  HttpServer server(config.common, "proxy", 64);
  add_proxy_routes(server, proxy, config, secured);
  // Declared after what its callback uses: it stops first.
  std::unique_ptr<directory::MembershipWatcher> watcher;
  if (etcd) watcher = watch_membership(config, std::move(*etcd), *secret, proxy, prober);
  // Probed once before listening, so /health is right from the first request; a proxy
  // that learns its model waits a little longer for a PD to tell it (PDs still starting:
  // it listens anyway, and answers 503 until one has).
  prober.wait_first_round(Deadline::after_ms(2000));
  for (Deadline known = Deadline::after_ms(5000);
       config.learn_model && proxy.served_models().empty() && !known.expired();) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return server.serve_until_signal();
}

}  // namespace ecx::serve
