#include "connector/offers.h"

#include "ecx/common/log.h"
#include "wire/socket.h"

namespace ecx::connector {

Result<std::string> parse_offer_address(const std::string& text) {
  std::string_view rest = text;
  if (rest.starts_with("tcp://")) rest.remove_prefix(6);
  if (rest.empty() || rest.size() > 261) {
    return InvalidArgument("consumer address '" + text + "': expected host:port");
  }
  auto hp = transfer::parse_host_port(std::string(rest));
  if (!hp.ok()) return hp.status().with_context("consumer address");
  for (char c : hp->host) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-';
    if (!ok) {
      return InvalidArgument("consumer address '" + text +
                             "': the host is an IPv4 address or a name, not '" + hp->host + "'");
    }
  }
  return hp->host + ":" + std::to_string(hp->port);
}

OfferSender::OfferSender(std::string name, transfer::Agent* agent)
    : name_(std::move(name)), agent_(agent) {}

OfferSender::~OfferSender() { stop(); }

bool OfferSender::push(std::string address, std::string notice) {
  {
    MutexLock lock(&mu_);
    if (stopping_ || queue_.size() >= kMaxQueued) {
      failed_++;
      return false;
    }
    queue_.push_back({std::move(address), std::move(notice)});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  cv_.notify_one();
  return true;
}

void OfferSender::stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    failed_ += queue_.size();
    queue_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void OfferSender::run() {
  while (true) {
    Queued offer;
    {
      MutexLock lock(&mu_);
      cv_.wait(&mu_, [this]() ECX_REQUIRES(mu_) { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      offer = std::move(queue_.front());
      queue_.pop_front();
    }
    Status sent = send(offer);
    if (sent.ok()) {
      sent_++;
      continue;
    }
    failed_++;
    spdlog::warn("connector {}: an offer to {} was not delivered: {}", name_, offer.address,
                 sent.to_string());
  }
}

// The consumer is dialed by its address alone: the handshake, which proves the deployment
// secret both ways, tells who it is. Its connection is kept under a name of the address.
Status OfferSender::send(const Queued& offer) {
  auto skipped = unreachable_.find(offer.address);
  if (skipped != unreachable_.end()) {
    if (!skipped->second.expired()) {
      return Unavailable("not dialed again before " + std::to_string(kRetryMs) +
                         " ms after it could not be reached");
    }
    unreachable_.erase(skipped);
  }
  transfer::AgentMetadata self = agent_->metadata();
  transfer::AgentMetadata consumer;
  consumer.name = "offer@" + offer.address;
  consumer.protocol_version = self.protocol_version;
  consumer.compat_hash = self.compat_hash;
  consumer.endpoints[transfer::Backend::kTcp] = offer.address;
  auto connected = agent_->connect(consumer, {.backend = transfer::Backend::kTcp,
                                              .deadline = Deadline::after_ms(kConnectMs),
                                              .any_name = true});
  if (!connected.ok()) {
    unreachable_.insert_or_assign(offer.address, Deadline::after_ms(kRetryMs));
    return connected.status();
  }
  Status sent = agent_->notify(consumer.name, offer.notice);
  if (!sent.ok()) agent_->disconnect(consumer.name);  // dialed afresh next time
  return sent;
}

}  // namespace ecx::connector
