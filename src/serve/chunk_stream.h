// A streamed answer's body on its way from whoever produces it (a worker thread, or an
// async route's callbacks) to the connection's strand, which writes it to the socket.
// Inside serve/http_server, like serve/http_connection.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>

#include "serve/http_types.h"

namespace ecx::serve {

// A streamed answer's body between its producer and the connection's strand (pump). A
// worker thread writes (blocking while `stream_buffer_bytes` are waiting); an async
// route pushes (never blocking) and is told when there is room again.
class ChunkStream final : public StreamWriter, public AsyncStreamWriter {
 public:
  ChunkStream(size_t limit, std::chrono::seconds write_timeout)
      : limit_(limit), write_timeout_(write_timeout) {}

  bool write(std::string_view chunk) override;
  bool push(std::string_view chunk) override;
  bool has_room() const override {
    std::lock_guard lock(mu_);
    return gone_ || pending_.size() < limit_;
  }
  void when_room(std::function<void()> ready) override;
  bool client_gone() const override {
    std::lock_guard lock(mu_);
    return gone_;
  }
  // The connection's strand, to send next: the chunks waiting (moved out). `ended` is
  // true when nothing more will come: the worker finished, or the client is gone.
  // Returns false (and clears `sending_`) when there is nothing to do yet.
  bool take(std::string* chunks, bool* ended, bool* gone);
  void mark_gone();
  size_t bytes_written() const {
    std::lock_guard lock(mu_);
    return total_;
  }

  // Set by the connection: schedules a pump on its strand.
  std::function<void()> wake;
  // The producer: the answer is complete.
  void finish();

 private:
  // Appends `chunk` (mu_ held via `lock`); wakes the strand unless a pump is scheduled.
  void append(std::unique_lock<std::mutex>& lock, std::string_view chunk);

  const size_t limit_;
  const std::chrono::seconds write_timeout_;
  mutable std::mutex mu_;
  std::condition_variable space_cv_;
  std::string pending_;    // guarded by mu_
  size_t total_ = 0;       // guarded by mu_
  bool sending_ = true;    // guarded by mu_; a pump is scheduled or running (headers first)
  bool finished_ = false;  // guarded by mu_
  bool gone_ = false;      // guarded by mu_
  std::function<void()> room_waiter_;  // guarded by mu_; when_room's, not yet called
};

}  // namespace ecx::serve
