// A streamed answer's body on its way from whoever produces it (a worker thread, or an
// async route's callbacks) to the connection's strand, which writes it to the socket.
// Inside the HTTP server (http_server/http_server.h), like http_server/http_connection.h.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

#include "ecx/common/mutex.h"
#include "http_server/http_types.h"

namespace ecx::serve {

// A streamed answer's body between its producer and the connection's strand (pump). A
// worker thread writes (blocking while `stream_buffer_bytes` are waiting); an async
// route pushes (never blocking) and is told when there is room again.
class ChunkStream final : public StreamWriter, public AsyncStreamWriter {
 public:
  ChunkStream(size_t limit, std::chrono::seconds write_timeout)
      : limit_(limit), write_timeout_(write_timeout) {}

  bool write(std::string_view chunk) ECX_EXCLUDES(mu_) override;
  bool push(std::string_view chunk) ECX_EXCLUDES(mu_) override;
  bool has_room() const ECX_EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    return gone_ || pending_.size() < limit_;
  }
  void when_room(std::function<void()> ready) ECX_EXCLUDES(mu_) override;
  bool client_gone() const ECX_EXCLUDES(mu_) override {
    MutexLock lock(&mu_);
    return gone_;
  }
  // The connection's strand, to send next: the chunks waiting (moved out). `ended` is
  // true when nothing more will come: the worker finished, or the client is gone.
  // Returns false (and clears `sending_`) when there is nothing to do yet.
  bool take(std::string* chunks, bool* ended, bool* gone) ECX_EXCLUDES(mu_);
  void mark_gone() ECX_EXCLUDES(mu_);
  size_t bytes_written() const ECX_EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return total_;
  }

  // Set by the connection: schedules a pump on its strand.
  std::function<void()> wake;
  // The producer: the answer is complete.
  void finish() ECX_EXCLUDES(mu_);

 private:
  // Appends `chunk`. True when no pump was scheduled: one is now, and the caller wakes
  // the strand once it has let go of mu_.
  bool append_locked(std::string_view chunk) ECX_REQUIRES(mu_);

  const size_t limit_;
  const std::chrono::seconds write_timeout_;
  mutable Mutex mu_;
  CondVar space_cv_;
  std::string pending_ ECX_GUARDED_BY(mu_);
  size_t total_ ECX_GUARDED_BY(mu_) = 0;
  bool sending_ ECX_GUARDED_BY(mu_) = true;  // a pump is scheduled or running (headers first)
  bool finished_ ECX_GUARDED_BY(mu_) = false;
  bool gone_ ECX_GUARDED_BY(mu_) = false;
  std::function<void()> room_waiter_ ECX_GUARDED_BY(mu_);  // when_room's, not yet called
};

}  // namespace ecx::serve
