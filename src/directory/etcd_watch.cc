#include "ecx/directory/etcd_watch.h"

#include "directory/etcd_json.h"
#include "ecx/common/deadline.h"
#include "ecx/common/json_reader.h"
#include "http/http_client.h"

namespace ecx::directory {

using nlohmann::json;

// One message of the stream is a few KiB per event; a line past this ends the watch.
constexpr size_t kMaxLineBytes = size_t{64} << 20;

EtcdWatch::EtcdWatch(EtcdEndpoint endpoint, std::string prefix, int64_t start_revision,
                     std::chrono::milliseconds connect_timeout,
                     std::chrono::milliseconds idle_timeout, std::string token, std::string ca_file)
    : endpoint_(std::move(endpoint)),
      prefix_(std::move(prefix)),
      start_revision_(start_revision),
      connect_timeout_(connect_timeout),
      idle_timeout_(idle_timeout),
      token_(std::move(token)),
      ca_file_(std::move(ca_file)),
      client_(std::make_unique<http::HttpClient>(http::HttpClient::Options{.threads = 1})) {}

EtcdWatch::~EtcdWatch() { cancel(); }

void EtcdWatch::cancel(std::chrono::milliseconds wait) {
  std::shared_ptr<http::Cancellation> in_flight;
  {
    MutexLock lock(&mu_);
    cancelled_ = true;
    in_flight = in_flight_;
  }
  if (in_flight) in_flight->cancel();  // the call ends at once, its connection closed
  MutexLock lock(&mu_);
  cv_.wait_for(&mu_, wait, [this]() ECX_REQUIRES(mu_) { return !running_; });
}

bool EtcdWatch::handle_line(const std::string& line, const OnEvents& events, Status* ended) {
  std::string what = "etcd watch on " + endpoint_.url();
  if (line.find_first_not_of(" \r\t") == std::string::npos) return true;
  auto doc = parse_json_object(line, what + " message", JsonLimits{kMaxLineBytes, 32});
  if (!doc.ok()) {
    *ended = Unavailable(doc.status().message());
    return false;
  }
  auto error = doc->find("error");
  if (error != doc->end()) {
    *ended = Unavailable(what + ": " + safe_dump(*error).substr(0, 300));
    return false;
  }
  auto result = doc->find("result");
  if (result == doc->end() || !result->is_object()) return true;
  auto canceled = result->find("canceled");
  if (canceled != result->end() && canceled->is_boolean() && canceled->get<bool>()) {
    auto compact = read_int64(*result, "compact_revision");
    std::string reason = read_string(*result, "cancel_reason");
    *ended = NotFound(what + ": etcd cancelled the watch (compact_revision " +
                      std::to_string(compact.ok() ? *compact : 0) + (reason.empty() ? "" : ", ") +
                      reason + ")");
    return false;
  }
  auto created = result->find("created");
  if (created != result->end() && created->is_boolean() && created->get<bool>()) created_ = true;
  int64_t revision = 0;
  auto header = result->find("header");
  if (header != result->end() && header->is_object()) {
    auto r = read_int64(*header, "revision");
    if (r.ok()) revision = *r;
  }
  auto list = result->find("events");
  if (list == result->end() || !list->is_array() || list->empty()) return true;
  std::vector<WatchEvent> batch;
  for (const auto& e : *list) {
    if (!e.is_object()) continue;
    auto kv = e.find("kv");
    if (kv == e.end()) continue;
    auto parsed = read_key_value(*kv);
    if (!parsed.ok()) {
      *ended = Unavailable(what + ": " + parsed.status().message());
      return false;
    }
    WatchEvent event;
    event.type = read_string(e, "type") == "DELETE" ? WatchEvent::kDelete : WatchEvent::kPut;
    event.kv = std::move(*parsed);
    batch.push_back(std::move(event));
  }
  events(batch, revision);
  return true;
}

// One run()'s stream: what has arrived and how it ended.
struct EtcdWatch::Stream {
  std::string what;
  int http_status = 0;
  std::string buffer;  // bytes of the line not yet complete
  Status ended;        // set by a message that ends the watch
  bool stopped_by_message = false;
};

http::ClientRequest EtcdWatch::watch_request() const {
  json create = {{"key", base64_encode(prefix_)},
                 {"range_end", base64_encode(prefix_range_end(prefix_))},
                 {"start_revision", std::to_string(start_revision_)}};
  http::ClientRequest request;
  request.target = "/v3/watch";
  request.body = json{{"create_request", create}}.dump();
  request.connect_timeout = connect_timeout_;
  request.timeout = idle_timeout_;  // streamed: until the headers, then between two pieces
  if (!token_.empty()) request.headers.emplace_back("Authorization", token_);
  request.tls = endpoint_.tls;
  request.ca_file = ca_file_;
  return request;
}

bool EtcdWatch::receive(Stream& stream, const char* data, size_t n, const OnEvents& events) {
  if (cancelled_) return false;
  stream.buffer.append(data, n);
  if (stream.http_status != 200) return stream.buffer.size() < 4096;  // the error, kept short
  size_t start = 0;
  for (size_t end; (end = stream.buffer.find('\n', start)) != std::string::npos; start = end + 1) {
    bool go_on = false;
    try {  // nothing a peer sends may escape the client's receiver as an exception
      go_on = handle_line(stream.buffer.substr(start, end - start), events, &stream.ended);
    } catch (const std::exception& e) {
      stream.ended = Unavailable(stream.what + ": a message ecx cannot read: " + e.what());
    }
    if (!go_on) {
      stream.stopped_by_message = true;
      return false;
    }
  }
  stream.buffer.erase(0, start);
  if (stream.buffer.size() > kMaxLineBytes) {
    stream.ended =
        Unavailable(stream.what + ": a message longer than " + std::to_string(kMaxLineBytes));
    stream.stopped_by_message = true;
    return false;
  }
  return true;
}

Status EtcdWatch::outcome(const Stream& stream, const http::ClientResult& result) const {
  if (cancelled_) return Status::Ok();
  if (stream.stopped_by_message) return stream.ended;
  if (stream.http_status != 0 && stream.http_status != 200) {
    return Unavailable(stream.what + " answered " + std::to_string(stream.http_status) + ": " +
                       stream.buffer.substr(0, 300));
  }
  if (result.ok()) return Unavailable(stream.what + ": the stream ended");
  if (result.error == http::ClientError::kTimeout && created_) {
    return DeadlineExceeded(stream.what + ": no message for " +
                            std::to_string(idle_timeout_.count()) + " ms");
  }
  return Unavailable(stream.what + ": " + result.message);
}

Status EtcdWatch::run(const OnEvents& events) {
  auto cancel = std::make_shared<http::Cancellation>();
  {
    MutexLock lock(&mu_);
    if (cancelled_) return Status::Ok();
    in_flight_ = cancel;
    running_ = true;
  }
  Stream stream;
  stream.what = "etcd watch on " + endpoint_.url();
  http::ClientRequest request = watch_request();
  request.cancel = cancel;
  http::ClientStreaming streaming;
  streaming.on_headers = [&stream](int status) {
    stream.http_status = status;
    return true;  // an error's body comes to receive() too, kept short there
  };
  streaming.on_body = [&](std::string_view piece, const std::function<void()>&) {
    return receive(stream, piece.data(), piece.size(), events) ? http::BodyFlow::kContinue
                                                               : http::BodyFlow::kStop;
  };
  http::ClientResult result =
      client_->call(endpoint_.host, endpoint_.port, std::move(request), std::move(streaming));
  {
    MutexLock lock(&mu_);
    in_flight_.reset();
    running_ = false;
  }
  cv_.notify_all();
  return outcome(stream, result);
}

}  // namespace ecx::directory
