// An encoder cache pool in CUDA device memory (PoolConfig::memory = kCuda). The refusals
// run on every machine; the rest skip, saying why, without a usable GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "ecx/cache/encoder_cache_pool.h"
#include "ecx/common/checksum.h"
#include "ecx/transfer/cuda_memory.h"
#include "support/peer_process.h"

namespace ecx::cache {
namespace {

namespace cuda = transfer::cuda;

const TensorMeta kSeedItem{DType::kBF16, {400, 2048}};  // 1,638,400 bytes

MmHash hash_of(int i) { return MmHash::sha256_of({"vram-image", std::to_string(i)}); }

std::vector<std::byte> payload(const TensorMeta& meta, uint64_t seed) {
  std::vector<std::byte> p(meta.byte_size());
  fill_pattern(p.data(), p.size(), seed);
  return p;
}

PoolConfig vram_pool(uint64_t capacity) {
  return {.name = "vram", .capacity_bytes = capacity, .memory = transfer::MemoryKind::kCuda};
}

transfer::AgentConfig ucx_config(const std::string& name, const std::string& library,
                                 const std::string& tls = "cuda_copy,cuda_ipc,posix,cma,tcp") {
  auto config = ecx::testing::local_config(name);
  config.ucx = {.enable = true, .library = library, .tls = tls};
  return config;
}

// The block's bytes (header + payload), copied to the host.
std::vector<std::byte> block_on_host(const BlockRef& ref) {
  std::vector<std::byte> host(ref.block_length);
  EXPECT_TRUE(cuda::copy(host.data(), ref.block, ref.block_length).ok());
  return host;
}

TEST(CudaPoolTest, PoolInCudaMemoryNeedsTheUcxBackend) {
  auto agent = transfer::Agent::create(ecx::testing::local_config("no-ucx")).value();
  auto pool = EncoderCachePool::create(agent.get(), vram_pool(16 << 20));
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kFailedPrecondition) << pool.status().to_string();
  EXPECT_NE(pool.status().message().find("ucx"), std::string::npos) << pool.status().message();
  EXPECT_TRUE(agent->metadata().regions.empty());
}

TEST(CudaPoolTest, PoolInCudaMemoryWithoutAGpuSaysWhy) {
  Status gpu = cuda::available();
  if (gpu.ok()) GTEST_SKIP() << "this machine has a GPU";
  auto agent = transfer::Agent::create(ucx_config("ucx-no-gpu", "system", "tcp"));
  ASSERT_TRUE(agent.ok()) << agent.status().to_string();
  auto pool = EncoderCachePool::create(agent->get(), vram_pool(16 << 20));
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), gpu.code()) << pool.status().to_string();
  EXPECT_NE(pool.status().message().find(gpu.message()), std::string::npos)
      << pool.status().message();
  EXPECT_NE(pool.status().message().find("pool vram in CUDA memory"), std::string::npos);
}

class CudaPoolGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status gpu = cuda::available(); !gpu.ok()) GTEST_SKIP() << "needs a GPU: " << gpu.message();
    auto agent = transfer::Agent::create(ucx_config("vram-pool", "wheel"));
    ASSERT_TRUE(agent.ok()) << agent.status().to_string();
    agent_ = std::move(*agent);
    auto pool = EncoderCachePool::create(agent_.get(), vram_pool(8ull << 20));
    ASSERT_TRUE(pool.ok()) << pool.status().to_string();
    pool_ = std::move(*pool);
  }
  void TearDown() override {
    pool_.reset();
    agent_.reset();
  }
  std::unique_ptr<transfer::Agent> agent_;
  std::unique_ptr<EncoderCachePool> pool_;
};

TEST_F(CudaPoolGpuTest, PutWritesHeaderAndChecksummedPayloadIntoVram) {
  auto data = payload(kSeedItem, 1);
  auto ref = pool_->put(hash_of(1), kSeedItem, data);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  EXPECT_TRUE(cuda::is_device_pointer(ref->block));
  auto host = block_on_host(*ref);
  Status verdict =
      verify_block(host.data(), host.size(), {hash_of(1), kSeedItem, ref->generation, "vram pool"});
  EXPECT_TRUE(verdict.ok()) << verdict.to_string();
  EXPECT_EQ(std::memcmp(host.data() + kBlockHeaderBytes, data.data(), data.size()), 0);
  auto region = agent_->metadata().regions;
  ASSERT_EQ(region.size(), 1u);
  EXPECT_EQ(region[0].kind, transfer::MemoryKind::kCuda);
}

TEST_F(CudaPoolGpuTest, CommitReceivedVerifiesABlockWrittenIntoVram) {
  // A block as a peer would land it (header from the producer, generation 41).
  auto data = payload(kSeedItem, 2);
  std::vector<std::byte> block(kBlockHeaderBytes + data.size());
  write_block_header(block.data(), hash_of(2), kSeedItem, 41, checksum64(data.data(), data.size()));
  std::memcpy(block.data() + kBlockHeaderBytes, data.data(), data.size());

  auto ref = pool_->reserve(hash_of(2), kSeedItem);
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  ASSERT_TRUE(cuda::copy(ref->block, block.data(), block.size()).ok());
  Status s = pool_->commit_received(hash_of(2), ref->generation,
                                    {hash_of(2), kSeedItem, 41, "peer block"});
  ASSERT_TRUE(s.ok()) << s.to_string();
  // Re-stamped with this pool's generation, payload untouched.
  auto host = block_on_host(*ref);
  EXPECT_EQ(read_block_header(host.data()).generation, ref->generation);
  EXPECT_TRUE(
      verify_block(host.data(), host.size(), {hash_of(2), kSeedItem, ref->generation, "x"}).ok());

  // A corrupted payload is caught (the checksum is computed on a host copy) and dropped.
  auto bad = pool_->reserve(hash_of(3), kSeedItem);
  ASSERT_TRUE(bad.ok());
  write_block_header(block.data(), hash_of(3), kSeedItem, 7, checksum64(data.data(), data.size()));
  block[kBlockHeaderBytes + 100] ^= std::byte{1};
  ASSERT_TRUE(cuda::copy(bad->block, block.data(), block.size()).ok());
  s = pool_->commit_received(hash_of(3), bad->generation, {hash_of(3), kSeedItem, 7, "peer"});
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.to_string();
  EXPECT_EQ(pool_->find(hash_of(3)).status().code(), StatusCode::kNotFound);
}

TEST_F(CudaPoolGpuTest, EvictionClearsTheHeaderInVram) {
  // 8 MiB holds five seed items; the sixth evicts the least recently used.
  std::vector<BlockRef> refs;
  for (int i = 0; i < 6; ++i) {
    auto ref = pool_->put(hash_of(10 + i), kSeedItem, payload(kSeedItem, 10 + i));
    ASSERT_TRUE(ref.ok()) << i << ": " << ref.status().to_string();
    refs.push_back(*ref);
  }
  EXPECT_EQ(pool_->stats().evictions, 1u);
  EXPECT_EQ(pool_->find(hash_of(10)).status().code(), StatusCode::kNotFound);
  // The evicted block's header is gone or belongs to its new owner: never entry 10's.
  auto host = block_on_host(refs[0]);
  Status stale = verify_block(host.data(), host.size(),
                              {hash_of(10), kSeedItem, refs[0].generation, "evicted"});
  EXPECT_EQ(stale.code(), StatusCode::kEvicted) << stale.to_string();
}

}  // namespace
}  // namespace ecx::cache
