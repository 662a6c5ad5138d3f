#include "ecx/common/recycled_buffers.h"

#include <algorithm>
#include <bit>
#include <new>
#include <vector>

namespace ecx {
namespace {

constexpr std::align_val_t kAlign{64};
constexpr uint64_t kMinGranule = 4096;
constexpr uint64_t kMaxLength = uint64_t{1} << 62;  // size_class cannot wrap below it

void free_buffer(std::byte* data) { ::operator delete[](data, kAlign); }

}  // namespace

std::shared_ptr<RecycledBuffers> RecycledBuffers::create(uint64_t idle_cap) {
  return std::shared_ptr<RecycledBuffers>(new RecycledBuffers(idle_cap));
}

RecycledBuffers::~RecycledBuffers() {
  MutexLock lock(&mu_);
  for (const Idle& idle : idle_) free_buffer(idle.data);
}

uint64_t RecycledBuffers::size_class(uint64_t length) {
  const uint64_t granule = std::max(kMinGranule, std::bit_floor(std::max<uint64_t>(length, 1)) / 8);
  return (length + granule - 1) / granule * granule;
}

std::shared_ptr<std::byte> RecycledBuffers::take(uint64_t length) {
  if (length == 0) return nullptr;
  if (length > kMaxLength) throw std::bad_alloc();
  const uint64_t size = size_class(length);
  std::byte* data = nullptr;
  {
    MutexLock lock(&mu_);
    auto found = by_size_.find(size);
    if (found != by_size_.end()) {
      data = found->second->data;
      idle_.erase(found->second);
      by_size_.erase(found);
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
  std::vector<std::byte*> freed;
  {
    MutexLock lock(&mu_);
    if (size > idle_cap_) {
      freed.push_back(data);
    } else {
      while (stats_.idle_bytes + size > idle_cap_) {  // the longest idle make room
        const Idle oldest = idle_.front();
        auto [first, last] = by_size_.equal_range(oldest.size);
        for (auto it = first; it != last; ++it) {
          if (it->second == idle_.begin()) {
            by_size_.erase(it);
            break;
          }
        }
        idle_.pop_front();
        stats_.idle_bytes -= oldest.size;
        freed.push_back(oldest.data);
      }
      by_size_.emplace(size, idle_.insert(idle_.end(), Idle{size, data}));
      stats_.idle_bytes += size;
    }
    stats_.released += freed.size();
  }
  for (auto* p : freed) free_buffer(p);
}

RecycledBuffers::Stats RecycledBuffers::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

}  // namespace ecx
