#include "connector/p2p_connector.h"

#include "connector/p2p_consumer.h"
#include "connector/p2p_producer.h"

namespace ecx::connector {
namespace {

// The p2p driver: a producer (its pool and call service, p2p_producer.h) and a consumer
// (its fetch mode and what the modes share, p2p_consumer.h), side by side. A connector of
// one role leaves the other half idle.
class P2pDriver final : public ConnectorDriver {
 public:
  explicit P2pDriver(ConnectorCore& core) : core_(core), producer_(core), consumer_(core) {}

  Status start() { return producer_.start(); }

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override {
    return producer_.begin_save(mm_hash, meta);
  }
  Result<EcTransferParams> commit_save(const SaveSlot& slot) override {
    return producer_.commit_save(slot);
  }
  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override {
    return producer_.saved_params(mm_hash);
  }
  void abort_save(const SaveSlot& slot) override { producer_.abort_save(slot); }
  Status wait_for_readers(Deadline deadline) override {
    return producer_.wait_for_readers(deadline);
  }
  Status release_params(const EcTransferParams& params) override {
    return producer_.release_params(params);
  }
  bool holds(const MmHash& mm_hash) override { return producer_.holds(mm_hash); }
  bool release_granted(uint64_t pin, const transfer::Capability& capability) override {
    return producer_.release_granted(pin, capability);
  }

  bool can_load(const LoadItem& item) override { return consumer_.can_load(item); }
  void fetch(std::vector<FetchSlot*>& slots, Deadline deadline) override {
    consumer_.fetch(slots, deadline);
  }
  void view(std::vector<FetchSlot*>& slots, Deadline deadline) override {
    consumer_.view(slots, deadline);
  }
  std::vector<Status> renew(std::span<const FetchSlot* const> views, Deadline deadline) override {
    return consumer_.renew(views, deadline);
  }
  void release(std::span<const FinishedLoad> loads) override { consumer_.release(loads); }

  void add_stats(ConnectorStats& s) const override {
    producer_.add_stats(s);
    consumer_.add_stats(s);
    if (transfer::Agent* agent = core_.agent()) {
      transfer::AgentStats a = agent->stats();
      s.transfer_connects = a.connects_by_backend;
      s.peer_failures = a.peer_failures;
      s.transfer_seconds = {{"read", a.read_seconds}, {"write", a.write_seconds}};
    }
  }

 private:
  ConnectorCore& core_;
  P2pProducer producer_;
  P2pConsumer consumer_;
};

}  // namespace

Result<std::unique_ptr<EcConnector>> create_p2p_connector(ConnectorConfig config,
                                                          ConnectorOptions options,
                                                          ConnectorContext context) {
  auto kind =
      driver_kind<P2pDriver>("p2p:" + std::string(p2p_mode_name(options.mode)),
                             /*consumer_cache_remote_write=*/options.mode == P2pMode::kPush);
  return make_connector(std::move(kind), std::move(config), std::move(options), std::move(context));
}

}  // namespace ecx::connector
