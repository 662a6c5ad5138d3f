#include "ecx/common/recycled_buffers.h"

#include <algorithm>
#include <bit>
#include <new>

namespace ecx {
namespace {

constexpr std::align_val_t kAlign{64};
constexpr uint64_t kMinGranule = 4096;

void free_buffer(std::byte* data) { ::operator delete[](data, kAlign); }

}  // namespace

std::shared_ptr<RecycledBuffers> RecycledBuffers::create(uint64_t idle_cap) {
  return std::shared_ptr<RecycledBuffers>(new RecycledBuffers(idle_cap));
}

RecycledBuffers::~RecycledBuffers() {
  MutexLock lock(&mu_);
  for (auto& [size, buffers] : idle_) {
    for (auto* data : buffers) free_buffer(data);
  }
}

uint64_t RecycledBuffers::size_class(uint64_t length) {
  const uint64_t granule = std::max(kMinGranule, std::bit_floor(std::max<uint64_t>(length, 1)) / 8);
  return (length + granule - 1) / granule * granule;
}

std::shared_ptr<std::byte> RecycledBuffers::take(uint64_t length) {
  if (length == 0) return nullptr;
  const uint64_t size = size_class(length);
  std::byte* data = nullptr;
  {
    MutexLock lock(&mu_);
    auto found = idle_.find(size);
    if (found != idle_.end() && !found->second.empty()) {
      data = found->second.back();
      found->second.pop_back();
      stats_.idle_bytes -= size;
      ++stats_.reused;
    } else {
      ++stats_.allocated;
    }
  }
  if (data == nullptr) data = static_cast<std::byte*>(::operator new[](size, kAlign));
  std::weak_ptr<RecycledBuffers> pool = weak_from_this();
  return std::shared_ptr<std::byte>(data, [pool, size](std::byte* p) {
    if (auto alive = pool.lock()) {
      alive->give_back(p, size);
    } else {
      free_buffer(p);
    }
  });
}

void RecycledBuffers::give_back(std::byte* data, uint64_t size) {
  {
    MutexLock lock(&mu_);
    if (stats_.idle_bytes + size <= idle_cap_) {
      idle_[size].push_back(data);
      stats_.idle_bytes += size;
      return;
    }
    ++stats_.released;
  }
  free_buffer(data);
}

RecycledBuffers::Stats RecycledBuffers::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace ecx
