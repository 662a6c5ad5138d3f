// Every metric family a service exports, declared once: name, type, help and, for a
// histogram, its buckets. The names are a contract (docs/SERVING.md lists them).
#pragma once

#include <array>

#include "http_server/metrics.h"

namespace ecx::serve::metric {

// Latency buckets, seconds: 1 ms to 2 min, for encodes, EC loads, TTFT and requests.
inline constexpr std::array<double, 16> kSecondsBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};

using enum MetricType;

// Encoder (E).
inline constexpr MetricFamily kEncodeRequests{"ecx_encode_requests_total", kCounter,
                                              "images encoded or found cached, by cache"};
inline constexpr MetricFamily kEncodeChatRequests{"ecx_encode_chat_requests_total", kCounter,
                                                  "chat requests encoded by the encoder itself"};
inline constexpr MetricFamily kEncodeFailures{"ecx_encode_failures_total", kCounter,
                                              "encode requests that failed, by reason"};
inline constexpr MetricFamily kEcBytesSaved{"ecx_ec_bytes_saved_total", kCounter,
                                            "bytes of encoder output saved for loading"};
inline constexpr MetricFamily kEncodeSeconds{"ecx_encode_seconds", kHistogram,
                                             "time to encode one request's image", kSecondsBuckets};
inline constexpr MetricFamily kPoolCapacityBytes{"ecx_pool_capacity_bytes", kGauge,
                                                 "bytes of the producer pool"};
inline constexpr MetricFamily kPoolUsedBytes{"ecx_pool_used_bytes", kGauge,
                                             "bytes of the producer pool in use"};
inline constexpr MetricFamily kPoolEntries{"ecx_pool_entries", kGauge,
                                           "items the producer pool holds"};
inline constexpr MetricFamily kPoolPins{"ecx_pool_pins", kGauge,
                                        "pins on the producer pool's items (readers to come)"};
inline constexpr MetricFamily kPoolEvictions{"ecx_pool_evictions_total", kCounter,
                                             "items the producer pool evicted since start"};

// Prefill/decode (PD).
inline constexpr MetricFamily kRequests{"ecx_requests_total", kCounter,
                                        "chat completions answered, by status"};
inline constexpr MetricFamily kRequestFailures{"ecx_request_failures_total", kCounter,
                                               "chat completions that failed, by reason"};
inline constexpr MetricFamily kRequestSeconds{"ecx_request_seconds", kHistogram,
                                              "time to answer a chat completion", kSecondsBuckets};
inline constexpr MetricFamily kTimeToFirstToken{
    "ecx_time_to_first_token_seconds", kHistogram,
    "time from a chat completion's arrival to its first token (EC load and prefill included)",
    kSecondsBuckets};
inline constexpr MetricFamily kEcLoadSeconds{
    "ecx_ec_load_seconds", kHistogram, "time to load a request's encoder outputs", kSecondsBuckets};
inline constexpr MetricFamily kEcBytesLoaded{"ecx_ec_bytes_loaded_total", kCounter,
                                             "bytes of encoder output loaded"};
inline constexpr MetricFamily kItemsRecomputed{"ecx_items_recomputed_total", kCounter,
                                               "images encoded here because a load failed"};
inline constexpr MetricFamily kGeneratedTokens{"ecx_generated_tokens_total", kCounter,
                                               "tokens generated"};
inline constexpr MetricFamily kClientDisconnects{"ecx_client_disconnects_total", kCounter,
                                                 "requests whose client left before the answer"};
inline constexpr MetricFamily kCacheCapacityBytes{"ecx_cache_capacity_bytes", kGauge,
                                                  "bytes of the consumer cache"};
inline constexpr MetricFamily kCacheUsedBytes{"ecx_cache_used_bytes", kGauge,
                                              "bytes of the consumer cache in use"};
inline constexpr MetricFamily kCacheEntries{"ecx_cache_entries", kGauge,
                                            "items the consumer cache holds"};
inline constexpr MetricFamily kCachePins{"ecx_cache_pins", kGauge,
                                         "pins on the consumer cache's items"};
inline constexpr MetricFamily kCacheEvictions{"ecx_cache_evictions_total", kCounter,
                                              "items the consumer cache evicted since start"};
inline constexpr MetricFamily kEcNacks{"ecx_ec_nacks_total", kCounter,
                                       "item loads that failed since start, by code"};
inline constexpr MetricFamily kEcParamsRejected{
    "ecx_ec_params_rejected_total", kCounter,
    "ec_transfer_params refused: unsigned, not signed by this deployment, or not this item's"};

// Both roles.
inline constexpr MetricFamily kTransferConnects{"ecx_transfer_connects_total", kCounter,
                                                "connections opened to peers, by backend"};
// The agent's batches (ecx/transfer/types.h LatencyHistogram): its buckets are these.
inline constexpr auto kTransferBuckets = transfer::kLatencyBounds;
inline constexpr MetricFamily kTransferSeconds{
    "ecx_transfer_seconds", kHistogram,
    "seconds from a transfer batch's submission to its end (moved or failed), by op",
    kTransferBuckets};

// Proxy.
inline constexpr MetricFamily kProxyRequests{"ecx_proxy_requests_total", kCounter,
                                             "chat completions answered, by HTTP status"};
inline constexpr MetricFamily kProxyFailures{"ecx_proxy_failures_total", kCounter,
                                             "chat completions that failed, by reason"};
inline constexpr MetricFamily kProxyEncodeSeconds{
    "ecx_proxy_encode_seconds", kHistogram, "time to encode a request's images", kSecondsBuckets};
inline constexpr MetricFamily kProxyEncoderErrors{"ecx_proxy_encoder_errors_total", kCounter,
                                                  "encode attempts that failed"};
inline constexpr MetricFamily kProxyEncoderFallbacks{
    "ecx_proxy_encoder_fallbacks_total", kCounter,
    "images the PD encodes itself because no encoder could, by reason"};
inline constexpr MetricFamily kProxyParamsReleased{
    "ecx_proxy_params_released_total", kCounter,
    "params given back to encoders for requests that never reached a PD"};
inline constexpr MetricFamily kProxyClientDisconnects{
    "ecx_proxy_client_disconnects_total", kCounter, "requests whose client left before the answer"};
inline constexpr MetricFamily kProxyMembershipChanges{
    "ecx_proxy_membership_changes_total", kCounter,
    "upstreams added or removed by the directory, by role and change"};
inline constexpr MetricFamily kProxyUpstreams{"ecx_proxy_upstreams", kGauge,
                                              "upstreams the proxy routes over now, by role"};
inline constexpr MetricFamily kProxyUpstreamUp{"ecx_proxy_upstream_up", kGauge,
                                               "1 when the upstream is reachable"};

// The sidecar of an engine (ecx serve sidecar).
inline constexpr MetricFamily kSidecarInstanceUp{"ecx_sidecar_instance_up", kGauge,
                                                 "1 while the engine's /health answers 200"};
inline constexpr MetricFamily kSidecarRegistered{"ecx_sidecar_registered", kGauge,
                                                 "1 while the engine is registered in etcd"};
inline constexpr MetricFamily kSidecarRegistrations{
    "ecx_sidecar_registrations_total", kCounter,
    "times the engine was registered (its first start, and each return after it was down)"};

// Every service: its deployment secret, and its HTTP server.
inline constexpr MetricFamily kAuthSecretConfigured{
    "ecx_auth_secret_configured", kGauge, "1 when the service runs with a deployment secret"};
inline constexpr MetricFamily kHttpAbandoned{
    "ecx_http_abandoned_total", kCounter,
    "queued requests dropped before they ran because their client had left"};
inline constexpr MetricFamily kHttpRejected{
    "ecx_http_rejected_total", kCounter,
    "requests refused with 503 because the queue was full (--max-queued)"};
inline constexpr MetricFamily kHttpQueueDepth{"ecx_http_queue_depth", kGauge,
                                              "requests waiting for a worker"};
inline constexpr MetricFamily kHttpRequestsRunning{"ecx_http_requests_running", kGauge,
                                                   "requests on a worker now"};
inline constexpr MetricFamily kHttpMaxQueued{"ecx_http_max_queued", kGauge,
                                             "the queue bound (--max-queued)"};
inline constexpr MetricFamily kHttpWorkers{
    "ecx_http_workers", kGauge, "worker threads, or async requests run at once (--workers)"};
inline constexpr MetricFamily kHttpIoThreads{"ecx_http_io_threads", kGauge,
                                             "I/O threads (--io-threads)"};
inline constexpr MetricFamily kHttpOpenConnections{"ecx_http_open_connections", kGauge,
                                                   "open client connections"};
inline constexpr MetricFamily kHttpMaxConnections{
    "ecx_http_max_connections", kGauge,
    "connections held before work is refused (--max-connections, open-files limit)"};
inline constexpr MetricFamily kHttpConnectionsRefused{
    "ecx_http_connections_refused_total", kCounter,
    "requests refused with 503 on a connection past the connection limit"};
inline constexpr MetricFamily kHttpConnectionsYielded{
    "ecx_http_connections_yielded_total", kCounter,
    "connections closed while waiting for a request, to make room for a client holding few"};
inline constexpr MetricFamily kHttpBufferedBytes{
    "ecx_http_buffered_bytes", kGauge, "request bodies held now (being read, waiting or running)"};
inline constexpr MetricFamily kHttpMaxBufferedBytes{
    "ecx_http_max_buffered_bytes", kGauge,
    "the budget of request bodies held at once (--max-buffered-bytes)"};
inline constexpr MetricFamily kHttpBufferedRejected{
    "ecx_http_buffered_rejected_total", kCounter,
    "requests refused with 503 because their body would pass --max-buffered-bytes"};
inline constexpr MetricFamily kHttpAcceptErrors{
    "ecx_http_accept_errors_total", kCounter,
    "connections the server could not accept (out of file descriptors, say)"};
inline constexpr MetricFamily kProcessThreads{"ecx_process_threads", kGauge,
                                              "threads of this process"};

}  // namespace ecx::serve::metric
