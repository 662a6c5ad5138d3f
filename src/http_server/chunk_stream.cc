#include "http_server/chunk_stream.h"

namespace ecx::serve {

bool ChunkStream::write(std::string_view chunk) {
  {
    MutexLock lock(&mu_);
    bool room = space_cv_.wait_for(&mu_, write_timeout_, [this]() ECX_REQUIRES(mu_) {
      return gone_ || pending_.size() < limit_;
    });
    if (!room) gone_ = true;  // the client stopped reading
    if (gone_) return false;
    if (!append_locked(chunk)) return true;
  }
  wake();
  return true;
}

bool ChunkStream::push(std::string_view chunk) {
  {
    MutexLock lock(&mu_);
    if (gone_) return false;
    if (!append_locked(chunk)) return true;
  }
  wake();
  return true;
}

bool ChunkStream::append_locked(std::string_view chunk) {
  pending_.append(chunk);
  total_ += chunk.size();
  if (sending_) return false;
  sending_ = true;
  return true;
}

void ChunkStream::when_room(std::function<void()> ready) {
  {
    MutexLock lock(&mu_);
    if (!gone_ && pending_.size() >= limit_) {
      room_waiter_ = std::move(ready);
      return;
    }
  }
  ready();
}

void ChunkStream::mark_gone() {
  std::function<void()> ready;
  {
    MutexLock lock(&mu_);
    gone_ = true;
    ready = std::move(room_waiter_);
    room_waiter_ = nullptr;
    space_cv_.notify_all();
  }
  if (ready) ready();
}

void ChunkStream::finish() {
  {
    MutexLock lock(&mu_);
    finished_ = true;
    if (sending_) return;
    sending_ = true;
  }
  wake();
}

bool ChunkStream::take(std::string* chunks, bool* ended, bool* gone) {
  std::function<void()> ready;
  {
    MutexLock lock(&mu_);
    *gone = gone_;
    *ended = finished_;
    if (gone_ && !finished_) {  // nothing more to send; finish() wakes us for the end
      sending_ = false;
      return false;
    }
    if (pending_.empty() && !finished_) {
      sending_ = false;
      return false;
    }
    chunks->swap(pending_);
    pending_.clear();
    space_cv_.notify_all();
    ready = std::move(room_waiter_);
    room_waiter_ = nullptr;
  }
  if (ready) ready();
  return true;
}

}  // namespace ecx::serve
