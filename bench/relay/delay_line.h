// DelayLine: one direction of a relayed TCP connection. Bytes read from one side wait
// here until `delay` after they arrived, then go to the other side in order; an EOF
// (the sender's FIN) waits behind them the same way. The line holds at most `capacity`
// bytes before the relay stops reading (so the sender feels TCP backpressure).
//
// Pure logic, no I/O: the relay pushes what it reads and writes what is due.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <span>

#include "ecx/common/deadline.h"

namespace ecx::relay {

class DelayLine {
 public:
  DelayLine(std::chrono::nanoseconds delay, size_t capacity) : delay_(delay), capacity_(capacity) {}

  // Whether the relay may read more into the line (it holds less than its capacity; one
  // read may overshoot it by that read's size).
  bool has_room() const { return queued_ < capacity_; }
  // Bytes that arrived at `arrived`, due at `arrived + delay`.
  // REQUIRES: no EOF pushed yet; `arrived` not earlier than the previous push.
  void push(std::span<const std::byte> bytes, Clock::time_point arrived);
  // The same, taking the first `size` bytes of `buffer` without copying them.
  void push(std::unique_ptr<std::byte[]> buffer, size_t size, Clock::time_point arrived);
  // The sender closed its side at `arrived`; due after every byte pushed before it.
  void push_eof(Clock::time_point arrived);

  // When the head of the line (bytes or EOF) is due; nullopt when the line is empty.
  std::optional<Clock::time_point> next_due() const;
  // The head chunk's unwritten bytes when they are due at `now`; empty otherwise.
  std::span<const std::byte> due_bytes(Clock::time_point now) const;
  // Drops the first `n` bytes of due_bytes() once they were written.
  void consume(size_t n);
  // Whether the EOF is at the head of the line and due at `now` (every byte before it
  // written).
  bool eof_due(Clock::time_point now) const;
  // Drops the EOF once it was passed on. REQUIRES: eof_due().
  void pop_eof() { chunks_.pop_front(); }
  // Whether an EOF was pushed (the sender closed its side).
  bool eof_pushed() const { return eof_pushed_; }
  // Bytes pushed and not yet consumed.
  size_t queued_bytes() const { return queued_; }
  bool empty() const { return chunks_.empty(); }

 private:
  struct Chunk {
    Clock::time_point due;
    std::unique_ptr<std::byte[]> bytes;
    size_t size = 0;  // 0: the EOF marker
    size_t written = 0;
  };
  std::chrono::nanoseconds delay_;
  size_t capacity_;
  std::deque<Chunk> chunks_;
  size_t queued_ = 0;
  bool eof_pushed_ = false;
};

}  // namespace ecx::relay
