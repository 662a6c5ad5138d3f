// Status and Result<T>: the one error convention of ecx. No exceptions cross the API.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ecx {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // the caller passed something malformed
  kNotFound,         // NACK "missing": no such entry / region / peer
  kNotReady,         // NACK "not_ready": exists but still being written (retryable)
  kOutOfRange,       // offset/length outside a region or buffer
  kAlreadyExists,
  kDeadlineExceeded,   // a wait ran past its deadline
  kUnavailable,        // peer unreachable or died
  kIncompatible,       // NACK "incompatible": compatibility hashes differ
  kVersionMismatch,    // NACK "version": protocol versions differ
  kEvicted,            // NACK "evicted": generation mismatch, block reused
  kResourceExhausted,  // pool full, too many items, ...
  kFailedPrecondition,
  kCancelled,
  kIoError,
  kDataLoss,          // checksum mismatch
  kInternal,          // NACK "internal"
  kPermissionDenied,  // the peer is not authenticated or not allowed to do this
};

// Stable lower-case name of a code ("not_found", "deadline_exceeded", ...).
std::string_view status_code_name(StatusCode code);
// Inverse of status_code_name; nullopt for an unknown name.
std::optional<StatusCode> status_code_from_name(std::string_view name);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "deadline_exceeded: read of 3 items from agent e-0 ..." or "ok".
  std::string to_string() const;
  // Returns a copy whose message is prefixed with `context: `.
  Status with_context(std::string_view context) const;

  void ignore_error() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status PermissionDenied(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
// An IoError naming `what` and the current errno.
Status ErrnoError(std::string_view what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : value_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(value_).ok() && "Result needs a value or an error");
    if (std::get<Status>(value_).ok()) {  // never a silent "error" that says ok
      value_ = Status(StatusCode::kInternal, "Result constructed from an ok Status");
    }
  }

  bool ok() const { return std::holds_alternative<T>(value_); }
  Status status() const { return ok() ? Status() : std::get<Status>(value_); }

  // REQUIRES: ok()
  T& value() & { return std::get<T>(value_); }
  const T& value() const& { return std::get<T>(value_); }
  T&& value() && { return std::get<T>(std::move(value_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> value_;
};

}  // namespace ecx

#define ECX_CONCAT_INNER(a, b) a##b
#define ECX_CONCAT(a, b) ECX_CONCAT_INNER(a, b)

#define ECX_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::ecx::Status ecx_status_ = (expr);        \
    if (!ecx_status_.ok()) return ecx_status_; \
  } while (0)

#define ECX_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

#define ECX_ASSIGN_OR_RETURN(lhs, expr) \
  ECX_ASSIGN_OR_RETURN_IMPL(ECX_CONCAT(ecx_result_, __LINE__), lhs, expr)
