#include "ecx/common/status.h"

#include <array>
#include <cstring>

namespace ecx {
namespace {

constexpr std::array<std::pair<StatusCode, std::string_view>, 18> kNames = {{
    {StatusCode::kOk, "ok"},
    {StatusCode::kInvalidArgument, "invalid_argument"},
    {StatusCode::kNotFound, "missing"},
    {StatusCode::kNotReady, "not_ready"},
    {StatusCode::kOutOfRange, "out_of_range"},
    {StatusCode::kAlreadyExists, "already_exists"},
    {StatusCode::kDeadlineExceeded, "deadline_exceeded"},
    {StatusCode::kUnavailable, "unavailable"},
    {StatusCode::kIncompatible, "incompatible"},
    {StatusCode::kVersionMismatch, "version"},
    {StatusCode::kEvicted, "evicted"},
    {StatusCode::kResourceExhausted, "resource_exhausted"},
    {StatusCode::kFailedPrecondition, "failed_precondition"},
    {StatusCode::kCancelled, "cancelled"},
    {StatusCode::kIoError, "io_error"},
    {StatusCode::kDataLoss, "data_loss"},
    {StatusCode::kInternal, "internal"},
    {StatusCode::kPermissionDenied, "permission_denied"},
}};

}  // namespace

std::string_view status_code_name(StatusCode code) {
  for (const auto& [c, name] : kNames) {
    if (c == code) return name;
  }
  return "unknown";
}

std::optional<StatusCode> status_code_from_name(std::string_view name) {
  for (const auto& [c, n] : kNames) {
    if (n == name) return c;
  }
  return std::nullopt;
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string out(status_code_name(code_));
  out += ": ";
  out += message_;
  return out;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

Status ErrnoError(std::string_view what, int err) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  return Status(StatusCode::kIoError, std::move(m));
}

}  // namespace ecx
