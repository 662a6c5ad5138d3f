#include "delay_line.h"

#include <algorithm>

namespace ecx::relay {

void DelayLine::push(std::span<const std::byte> bytes, Clock::time_point arrived) {
  if (bytes.empty() || eof_pushed_) return;
  chunks_.push_back({arrived + delay_, std::vector<std::byte>(bytes.begin(), bytes.end()), 0});
  queued_ += bytes.size();
}

void DelayLine::push_eof(Clock::time_point arrived) {
  if (eof_pushed_) return;
  eof_pushed_ = true;
  chunks_.push_back({arrived + delay_, {}, 0});
}

std::optional<Clock::time_point> DelayLine::next_due() const {
  if (chunks_.empty()) return std::nullopt;
  return chunks_.front().due;
}

std::span<const std::byte> DelayLine::due_bytes(Clock::time_point now) const {
  if (chunks_.empty() || chunks_.front().due > now) return {};
  const Chunk& head = chunks_.front();
  return std::span<const std::byte>(head.bytes).subspan(head.written);
}

void DelayLine::consume(size_t n) {
  while (n > 0 && !chunks_.empty() && !chunks_.front().bytes.empty()) {
    Chunk& head = chunks_.front();
    size_t take = std::min(n, head.bytes.size() - head.written);
    head.written += take;
    queued_ -= take;
    n -= take;
    if (head.written == head.bytes.size()) chunks_.pop_front();
  }
}

bool DelayLine::eof_due(Clock::time_point now) const {
  return !chunks_.empty() && chunks_.front().bytes.empty() && chunks_.front().due <= now;
}

}  // namespace ecx::relay
