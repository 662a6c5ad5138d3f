// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with clang's
// thread-safety attributes, so that a member declared ECX_GUARDED_BY(mu_) is only touched
// with mu_ held, and a function declared ECX_REQUIRES(mu_) is only called with it held.
// libstdc++'s std::mutex carries no such attributes; LevelDB's port::Mutex is the model.
// scripts/test builds every library of src/ with clang -Wthread-safety -Werror (its clang
// tree, scripts/build fuzz); CMakeLists.txt turns the warning on wherever clang compiles.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "ecx/common/deadline.h"

#if defined(__clang__)
#define ECX_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define ECX_THREAD_ANNOTATION(x)
#endif

#define ECX_CAPABILITY(x) ECX_THREAD_ANNOTATION(capability(x))
#define ECX_SCOPED_CAPABILITY ECX_THREAD_ANNOTATION(scoped_lockable)
#define ECX_GUARDED_BY(x) ECX_THREAD_ANNOTATION(guarded_by(x))
#define ECX_PT_GUARDED_BY(x) ECX_THREAD_ANNOTATION(pt_guarded_by(x))
#define ECX_REQUIRES(...) ECX_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ECX_EXCLUDES(...) ECX_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ECX_ACQUIRE(...) ECX_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ECX_RELEASE(...) ECX_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define ECX_TRY_ACQUIRE(...) ECX_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define ECX_ASSERT_HELD(x) ECX_THREAD_ANNOTATION(assert_capability(x))
#define ECX_RETURN_CAPABILITY(x) ECX_THREAD_ANNOTATION(lock_returned(x))
#define ECX_NO_THREAD_SAFETY_ANALYSIS ECX_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace ecx {

class ECX_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ECX_ACQUIRE() { mu_.lock(); }
  void unlock() ECX_RELEASE() { mu_.unlock(); }
  bool try_lock() ECX_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds this mutex (where it cannot see that).
  void assert_held() const ECX_ASSERT_HELD(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for a scope; unlock() and lock() let a scope step out of it and back.
class ECX_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ECX_ACQUIRE(mu) : mu_(mu) { mu_->lock(); }
  ~MutexLock() ECX_RELEASE() {
    if (held_) mu_->unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void unlock() ECX_RELEASE() {
    held_ = false;
    mu_->unlock();
  }
  void lock() ECX_ACQUIRE() {
    mu_->lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A condition variable waited on with its Mutex held. Every wait has a deadline or a
// predicate; spurious wake-ups are the caller's to handle where it passes no predicate.
class CondVar {
 public:
  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }

  void wait(Mutex* mu) ECX_REQUIRES(mu) {
    std::unique_lock lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  template <typename Predicate>
  void wait(Mutex* mu, Predicate ready) ECX_REQUIRES(mu) {
    std::unique_lock lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock, ready);
    lock.release();
  }
  // False when `deadline` passed (the caller re-checks its condition either way).
  bool wait_until(Mutex* mu, Clock::time_point deadline) ECX_REQUIRES(mu) {
    std::unique_lock lock(mu->mu_, std::adopt_lock);
    bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  // The predicate's last value: false when `deadline` passed with it still false.
  template <typename Predicate>
  bool wait_until(Mutex* mu, Clock::time_point deadline, Predicate ready) ECX_REQUIRES(mu) {
    std::unique_lock lock(mu->mu_, std::adopt_lock);
    bool met = cv_.wait_until(lock, deadline, ready);
    lock.release();
    return met;
  }
  template <typename Rep, typename Period, typename Predicate>
  bool wait_for(Mutex* mu, std::chrono::duration<Rep, Period> timeout, Predicate ready)
      ECX_REQUIRES(mu) {
    return wait_until(mu, Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout),
                      ready);
  }

 private:
  std::condition_variable cv_;
};

}  // namespace ecx
