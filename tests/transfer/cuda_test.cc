// GPU memory regions (MemoryKind::kCuda). The refusals run on every machine; the tests
// that move VRAM skip, saying why, where this process has no usable GPU (or the build no
// CUDA). Where a GPU exists they READ VRAM -> VRAM through the ucx backend with the
// libucx wheel's UCX (CUDA IPC between processes) and check every byte on a host copy.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "ecx/common/checksum.h"
#include "ecx/transfer/agent.h"
#include "ecx/transfer/cuda_memory.h"
#include "support/peer_process.h"

namespace ecx::transfer {
namespace {

using ecx::testing::local_config;
using ecx::testing::PeerProcess;

// What VRAM moves over between two agents on one host: CUDA IPC (another process),
// cuda_copy (device memory detection, and copies within one process), shared memory and
// tcp for UCX's own messages.
constexpr const char* kCudaTls = "cuda_copy,cuda_ipc,posix,cma,tcp";
constexpr uint64_t kSizes[] = {1600ull << 10, 8ull << 20};

#define SKIP_WITHOUT_GPU()                              \
  do {                                                  \
    if (Status gpu = cuda::available(); !gpu.ok()) {    \
      GTEST_SKIP() << "needs a GPU: " << gpu.message(); \
    }                                                   \
  } while (0)

AgentConfig cuda_config(const std::string& name, const std::string& library = "wheel") {
  AgentConfig config = local_config(name);
  config.ucx = {.enable = true, .library = library, .tls = kCudaTls};
  return config;
}

// Device memory, freed at scope exit (after the agents that registered it: declare it
// before them).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(uint64_t length) {
    auto p = cuda::device_alloc(length);
    if (p.ok()) data_ = static_cast<std::byte*>(*p);
    status_ = p.ok() ? cuda::fill(data_, 0, length) : p.status();
  }
  ~DeviceBuffer() { cuda::device_free(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::byte* data() const { return data_; }
  const Status& status() const { return status_; }
  std::vector<std::byte> to_host(uint64_t offset, uint64_t length) const {
    std::vector<std::byte> host(length);
    EXPECT_TRUE(cuda::copy(host.data(), data_ + offset, length).ok());
    return host;
  }

 private:
  std::byte* data_ = nullptr;
  Status status_;
};

// --- Refusals: every machine ---------------------------------------------------------

TEST(CudaMemoryTest, AvailabilitySaysWhyNotInWords) {
  Status gpu = cuda::available();
  if (gpu.ok()) {
    EXPECT_TRUE(cuda::built_with_cuda());
    auto device = cuda::describe_device();
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    std::printf("GPU: %s\n", device->c_str());
    return;
  }
  EXPECT_TRUE(gpu.code() == StatusCode::kUnavailable ||
              gpu.code() == StatusCode::kFailedPrecondition)
      << gpu.to_string();
  EXPECT_NE(gpu.message().find(cuda::built_with_cuda() ? "GPU" : "CUDA"), std::string::npos)
      << gpu.message();
  EXPECT_FALSE(cuda::device_alloc(4096).ok());
}

TEST(CudaMemoryTest, CudaRegionOnAnAgentWithoutUcxIsRefusedNamingUcx) {
  auto agent = Agent::create(local_config("no-ucx")).value();
  std::vector<std::byte> host(4096);
  auto r = agent->register_memory(host.data(), host.size(), MemoryKind::kCuda);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().to_string();
  EXPECT_NE(r.status().message().find("ucx"), std::string::npos) << r.status().message();
  EXPECT_TRUE(agent->metadata().regions.empty());
}

TEST(CudaMemoryTest, HostMemoryPassedAsCudaIsRefused) {
  // With ucx (Debian's UCX, on every machine here) the refusal comes from the memory
  // check: no GPU (saying why), or, with one, that the buffer is not device memory.
  // Any UCX will do: Debian's here, the wheel's where a GPU is (and Debian's may be absent).
  AgentConfig config = local_config("ucx-host-as-cuda");
  config.ucx = {
      .enable = true, .library = cuda::available().ok() ? "wheel" : "system", .tls = "tcp"};
  auto created = Agent::create(config);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  auto agent = std::move(*created);
  std::vector<std::byte> host(1 << 20);
  auto r = agent->register_memory(host.data(), host.size(), MemoryKind::kCuda);
  ASSERT_FALSE(r.ok());
  if (Status gpu = cuda::available(); !gpu.ok()) {
    EXPECT_EQ(r.status().code(), gpu.code()) << r.status().to_string();
    EXPECT_NE(r.status().message().find(gpu.message()), std::string::npos) << r.status().message();
  } else {
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find("not CUDA device memory"), std::string::npos)
        << r.status().message();
  }
  EXPECT_TRUE(agent->metadata().regions.empty());
}

// --- With a GPU ------------------------------------------------------------------------

TEST(CudaMemoryTest, DeviceRangeMustLieInOneAllocation) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer vram(1 << 20);
  ASSERT_TRUE(vram.status().ok()) << vram.status().to_string();
  EXPECT_TRUE(cuda::is_device_pointer(vram.data()));
  EXPECT_TRUE(cuda::check_device_range(vram.data(), 1 << 20).ok());
  EXPECT_FALSE(cuda::check_device_range(vram.data(), (1 << 20) + (64 << 20)).ok());
}

TEST(CudaMemoryTest, UcxWithoutCudaSupportTellsToUseTheWheel) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer vram(1 << 20);
  ASSERT_TRUE(vram.status().ok()) << vram.status().to_string();
  AgentConfig config = local_config("system-ucx");
  config.ucx = {.enable = true, .library = "system", .tls = "tcp"};
  auto agent = Agent::create(config);
  if (!agent.ok()) GTEST_SKIP() << "no system UCX to compare with: " << agent.status().message();
  auto r = (*agent)->register_memory(vram.data(), 1 << 20, MemoryKind::kCuda);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().to_string();
  EXPECT_NE(r.status().message().find("wheel"), std::string::npos) << r.status().message();
}

// Two agents of this process: UCX cannot use CUDA IPC within one process, so this
// covers the in-process path UCX picks (cuda_copy / its emulation protocols).
TEST(CudaMemoryTest, ReadsVramIntoVramBetweenTwoAgentsOfOneProcess) {
  SKIP_WITHOUT_GPU();
  const uint64_t total = 16ull << 20;
  DeviceBuffer source(total), dest(total);
  ASSERT_TRUE(source.status().ok() && dest.status().ok()) << source.status().to_string();
  std::vector<std::byte> pattern(total);
  fill_pattern(pattern.data(), total, 7);
  ASSERT_TRUE(cuda::copy(source.data(), pattern.data(), total).ok());

  auto producer = Agent::create(cuda_config("vram-producer"));
  ASSERT_TRUE(producer.ok()) << producer.status().to_string();
  auto consumer = Agent::create(cuda_config("vram-consumer")).value();
  auto region = (*producer)->register_memory(source.data(), total, MemoryKind::kCuda);
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  ASSERT_TRUE(consumer->register_memory(dest.data(), total, MemoryKind::kCuda).ok());
  auto c = consumer->connect((*producer)->metadata(), {.backend = Backend::kUcx});
  ASSERT_TRUE(c.ok()) << c.status().to_string();

  for (uint64_t size : kSizes) {
    ASSERT_TRUE(cuda::fill(dest.data(), 0, total).ok());
    const uint64_t offset = 4096;
    TransferDescriptor d{dest.data(), region->id, offset, size};
    auto h = consumer->read("vram-producer", {&d, 1});
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    Status s = h->wait(Deadline::after_ms(30000));
    ASSERT_TRUE(s.ok()) << size << ": " << s.to_string();
    auto got = dest.to_host(0, size);
    EXPECT_EQ(std::memcmp(got.data(), pattern.data() + offset, size), 0) << size;
  }
  consumer.reset();
  producer->reset();
}

class CudaPeerTest : public ::testing::Test {
 protected:
  // A producer process whose source region (64 MiB) is VRAM, reached over ucx.
  void start_peer() {
    auto options = ecx::testing::peer_options();
    options.ucx = kCudaTls;
    options.ucx_library = "wheel";
    options.memory = "cuda";
    auto peer = PeerProcess::start(options);
    ASSERT_TRUE(peer.ok()) << peer.status().to_string();
    peer_.emplace(std::move(*peer));
  }
  std::optional<PeerProcess> peer_;
};

TEST_F(CudaPeerTest, ReadsVramIntoVramBetweenProcesses) {
  SKIP_WITHOUT_GPU();
  start_peer();
  DeviceBuffer dest(8ull << 20);
  ASSERT_TRUE(dest.status().ok()) << dest.status().to_string();
  auto agent = Agent::create(cuda_config("consumer")).value();
  ASSERT_TRUE(agent->register_memory(dest.data(), 8ull << 20, MemoryKind::kCuda).ok());
  auto c = agent->connect(peer_->metadata(), {.backend = Backend::kUcx});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const auto& expected = peer_->expected();
  for (uint64_t size : kSizes) {
    for (uint64_t offset : {0ull, 13ull, 40ull << 20}) {
      ASSERT_TRUE(cuda::fill(dest.data(), 0, size).ok());
      TransferDescriptor d{dest.data(), peer_->source_region(), offset, size};
      auto h = agent->read("peer", {&d, 1});
      ASSERT_TRUE(h.ok()) << h.status().to_string();
      Status s = h->wait(Deadline::after_ms(30000));
      ASSERT_TRUE(s.ok()) << size << " at " << offset << ": " << s.to_string();
      auto got = dest.to_host(0, size);
      EXPECT_EQ(checksum64(got.data(), size), checksum64(expected.data() + offset, size))
          << size << " at " << offset;
    }
  }
  agent.reset();
}

TEST_F(CudaPeerTest, ReadsABatchOfVramItemsIntoHostMemory) {
  SKIP_WITHOUT_GPU();
  start_peer();
  auto agent = Agent::create(cuda_config("consumer")).value();
  auto c = agent->connect(peer_->metadata(), {.backend = Backend::kUcx});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const uint64_t size = 1600ull << 10;
  auto host = agent->allocate(3 * size).value();
  std::vector<TransferDescriptor> batch;
  for (uint64_t i = 0; i < 3; ++i) {
    batch.push_back({host.data + i * size, peer_->source_region(), (2 - i) * size, size});
  }
  auto h = agent->read("peer", batch);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE(h->wait(Deadline::after_ms(30000)).ok());
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(host.data + i * size, peer_->expected().data() + (2 - i) * size, size), 0)
        << "item " << i;
  }
}

TEST_F(CudaPeerTest, VramRegionOverTcpIsRefusedBeforeAnyByteMoves) {
  SKIP_WITHOUT_GPU();
  start_peer();
  auto agent = Agent::create(local_config("tcp-consumer")).value();
  auto c = agent->connect(peer_->metadata(), {.backend = Backend::kTcp});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  std::vector<std::byte> buf(1 << 20);
  TransferDescriptor d{buf.data(), peer_->source_region(), 0, buf.size()};
  auto h = agent->read("peer", {&d, 1});
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition) << h.status().to_string();
  EXPECT_NE(h.status().message().find("CUDA memory, reached only over ucx"), std::string::npos)
      << h.status().message();
}

TEST(CudaMemoryTest, LocalVramBufferIsNotCopiedByTheCpuOverTcp) {
  SKIP_WITHOUT_GPU();
  auto peer = PeerProcess::start();
  ASSERT_TRUE(peer.ok()) << peer.status().to_string();
  DeviceBuffer dest(1 << 20);
  ASSERT_TRUE(dest.status().ok());
  auto agent = Agent::create(cuda_config("mixed-consumer")).value();
  ASSERT_TRUE(agent->register_memory(dest.data(), 1 << 20, MemoryKind::kCuda).ok());
  ASSERT_TRUE(agent->connect(peer->metadata(), {.backend = Backend::kTcp}).ok());
  TransferDescriptor d{dest.data(), peer->source_region(), 0, 1 << 20};
  auto h = agent->read("peer", {&d, 1});
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition) << h.status().to_string();
  EXPECT_NE(h.status().message().find("CUDA region"), std::string::npos) << h.status().message();
  agent.reset();
}

}  // namespace
}  // namespace ecx::transfer
