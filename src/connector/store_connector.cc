// store connector: encoder outputs in Redis. Value = compat-hash length (2 bytes LE),
// compat hash, then the block (header + payload), so GET gets everything the consumer
// needs to verify in one round trip. Keys expire after ttl_s.
#include <atomic>
#include <cstring>
#include <map>

#include "connector/connector_driver.h"
#include "connector/redis_client.h"
#include "ecx/common/checksum.h"
#include "ecx/common/mutex.h"

namespace ecx::connector {
namespace {

std::string key_for(const MmHash& mm_hash) { return "ecx:ec:" + mm_hash.str(); }

class StoreDriver final : public ConnectorDriver {
 public:
  explicit StoreDriver(ConnectorCore& core) : core_(core) {}

  Status start() {
    ECX_ASSIGN_OR_RETURN(redis_,
                         RedisClient::connect(core_.options().redis,
                                              Deadline::after_ms(core_.options().load_timeout_ms)));
    return Status::Ok();
  }

  size_t prefix_size() const { return 2 + core_.options().compat_hash.size(); }

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override {
    ECX_RETURN_IF_ERROR(meta.validate());
    uint64_t token = next_token_++;
    MutexLock lock(&mu_);
    std::string& value = staging_[token];
    // Laid out as the final value, so SET sends it without another copy.
    value.resize(prefix_size() + cache::kBlockHeaderBytes + meta.byte_size());
    auto* payload =
        reinterpret_cast<std::byte*>(value.data() + prefix_size() + cache::kBlockHeaderBytes);
    return SaveSlot{mm_hash, meta, {payload, meta.byte_size()}, token};
  }

  Result<EcTransferParams> commit_save(const SaveSlot& slot) override {
    std::string value;
    {
      MutexLock lock(&mu_);
      auto it = staging_.find(slot.token);
      if (it == staging_.end())
        return NotFound("store connector: no save in progress for " + slot.mm_hash.str());
      value = std::move(it->second);
      staging_.erase(it);
    }
    const std::string& compat = core_.options().compat_hash;
    value[0] = static_cast<char>(compat.size() & 0xff);
    value[1] = static_cast<char>((compat.size() >> 8) & 0xff);
    std::memcpy(value.data() + 2, compat.data(), compat.size());
    auto* block = reinterpret_cast<std::byte*>(value.data() + prefix_size());
    cache::write_block_header(block, slot.mm_hash, slot.meta, 1,
                              checksum64(block + cache::kBlockHeaderBytes, slot.meta.byte_size()));
    ECX_RETURN_IF_ERROR(redis_->set(key_for(slot.mm_hash), value, core_.options().ttl_s,
                                    Deadline::after_ms(core_.options().load_timeout_ms)));
    return core_.keyed_params(slot.mm_hash, slot.meta);
  }

  Result<EcTransferParams> saved_params(const MmHash&) override {
    // Redis keys expire on their own; re-saving is the safe answer.
    return NotFound("store connector re-saves items");
  }

  void abort_save(const SaveSlot& slot) override {
    MutexLock lock(&mu_);
    staging_.erase(slot.token);
  }

  bool can_load(const LoadItem& item) override {
    if (item.params) return item.params->connector == "store";
    auto e =
        redis_->exists(key_for(item.mm_hash), Deadline::after_ms(core_.options().load_timeout_ms));
    return e.ok() && *e;
  }

  void fetch(std::vector<FetchSlot*>& slots, Deadline deadline) override {
    for (FetchSlot* slot : slots) slot->status = fetch_one(*slot, deadline);
  }

  Status fetch_one(FetchSlot& slot, Deadline deadline) {
    const MmHash& mm_hash = slot.item->mm_hash;
    ECX_ASSIGN_OR_RETURN(std::string value, redis_->get(key_for(mm_hash), deadline));
    if (value.size() < 2)
      return Status(StatusCode::kDataLoss, "redis value for " + mm_hash.str() + " is truncated");
    size_t n =
        static_cast<uint8_t>(value[0]) | (static_cast<size_t>(static_cast<uint8_t>(value[1])) << 8);
    if (value.size() < 2u + n)
      return Status(StatusCode::kDataLoss, "redis value for " + mm_hash.str() + " is truncated");
    ECX_RETURN_IF_ERROR(core_.check_compat("redis " + core_.options().redis, value.substr(2, n)));
    size_t block_bytes = value.size() - 2 - n;
    if (block_bytes != slot.block.block_length) {
      return InvalidArgument("redis value for " + mm_hash.str() + " holds " +
                             std::to_string(block_bytes) + " block bytes, expected " +
                             std::to_string(slot.block.block_length) + " for " +
                             slot.item->meta.to_string());
    }
    std::memcpy(slot.block.block, value.data() + 2 + n, block_bytes);
    return core_.consumer_cache()->commit_received(
        mm_hash, slot.block.generation,
        {mm_hash, slot.item->meta, 0, "redis key " + key_for(mm_hash),
         core_.options().verify_checksum(/*crossed=*/true)});
  }

 private:
  ConnectorCore& core_;
  std::unique_ptr<RedisClient> redis_;
  std::atomic<uint64_t> next_token_{1};
  Mutex mu_;
  std::map<uint64_t, std::string> staging_ ECX_GUARDED_BY(mu_);
};

// local: nothing moves; PD encodes every item itself (the baseline).
class LocalDriver final : public ConnectorDriver {
 public:
  explicit LocalDriver(ConnectorCore&) {}
  Status start() { return Status::Ok(); }

  Result<SaveSlot> begin_save(const MmHash&, const TensorMeta&) override {
    return Status(StatusCode::kFailedPrecondition,
                  "the local connector stores nothing: PD encodes itself");
  }
  Result<EcTransferParams> commit_save(const SaveSlot&) override {
    return begin_save({}, {}).status();
  }
  Result<EcTransferParams> saved_params(const MmHash&) override {
    return begin_save({}, {}).status();
  }
  void abort_save(const SaveSlot&) override {}
  bool can_load(const LoadItem&) override { return false; }
  void fetch(std::vector<FetchSlot*>&, Deadline) override {}
};

}  // namespace

Result<std::unique_ptr<EcConnector>> create_store_connector(ConnectorConfig config,
                                                            ConnectorOptions options,
                                                            ConnectorContext context) {
  return make_connector(driver_kind<StoreDriver>("store"), std::move(config), std::move(options),
                        std::move(context));
}

Result<std::unique_ptr<EcConnector>> create_local_connector(ConnectorConfig config,
                                                            ConnectorOptions options,
                                                            ConnectorContext context) {
  return make_connector(driver_kind<LocalDriver>("local"), std::move(config), std::move(options),
                        std::move(context));
}

}  // namespace ecx::connector
