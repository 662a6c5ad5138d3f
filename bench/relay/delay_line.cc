#include "delay_line.h"

#include <algorithm>

namespace ecx::relay {

void DelayLine::push(std::span<const std::byte> bytes, Clock::time_point arrived) {
  if (bytes.empty() || eof_pushed_) return;
  auto copy = std::make_unique_for_overwrite<std::byte[]>(bytes.size());
  std::copy(bytes.begin(), bytes.end(), copy.get());
  push(std::move(copy), bytes.size(), arrived);
}

void DelayLine::push(std::unique_ptr<std::byte[]> buffer, size_t size, Clock::time_point arrived) {
  if (size == 0 || eof_pushed_) return;
  chunks_.push_back({arrived + delay_, std::move(buffer), size, 0});
  queued_ += size;
}

void DelayLine::push_eof(Clock::time_point arrived) {
  if (eof_pushed_) return;
  eof_pushed_ = true;
  chunks_.push_back({arrived + delay_, nullptr, 0, 0});
}

std::optional<Clock::time_point> DelayLine::next_due() const {
  if (chunks_.empty()) return std::nullopt;
  return chunks_.front().due;
}

std::span<const std::byte> DelayLine::due_bytes(Clock::time_point now) const {
  if (chunks_.empty() || chunks_.front().due > now) return {};
  const Chunk& head = chunks_.front();
  return {head.bytes.get() + head.written, head.size - head.written};
}

void DelayLine::consume(size_t n) {
  while (n > 0 && !chunks_.empty() && chunks_.front().size > 0) {
    Chunk& head = chunks_.front();
    size_t take = std::min(n, head.size - head.written);
    head.written += take;
    queued_ -= take;
    n -= take;
    if (head.written == head.size) chunks_.pop_front();
  }
}

bool DelayLine::eof_due(Clock::time_point now) const {
  return !chunks_.empty() && chunks_.front().size == 0 && chunks_.front().due <= now;
}

}  // namespace ecx::relay
