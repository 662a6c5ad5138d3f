#include "ecx/common/safetensors.h"

#include "ecx/common/json_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <nlohmann/json.hpp>

namespace ecx {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // as the reference implementation

Status pread_all(int fd, void* out, uint64_t length, uint64_t offset, const char* what) {
  auto* p = static_cast<char*>(out);
  while (length > 0) {
    ssize_t n = ::pread(fd, p, length, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(what, errno);
    }
    if (n == 0) return Status(StatusCode::kDataLoss, std::string(what) + ": file ends early");
    p += n;
    length -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status write_all(int fd, const void* data, uint64_t length, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (length > 0) {
    ssize_t n = ::write(fd, p, length);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write " + path, errno);
    }
    p += n;
    length -= static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    ECX_RETURN_IF_ERROR(t.meta.validate());
    if (t.data.size() != t.meta.byte_size()) {
      return InvalidArgument("tensor " + t.name + ": " + std::to_string(t.data.size()) +
                             " bytes for " + t.meta.to_string());
    }
    header[t.name] = {{"dtype", std::string(dtype_name(t.meta.dtype))},
                      {"shape", t.meta.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data section 8-byte aligned
  uint64_t n = text.size();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("create " + path, errno);
  Status s = write_all(fd, &n, sizeof(n), path);
  if (s.ok()) s = write_all(fd, text.data(), text.size(), path);
  for (const auto& t : tensors) {
    if (s.ok()) s = write_all(fd, t.data.data(), t.data.size(), path);
  }
  if (::close(fd) != 0 && s.ok()) s = ErrnoError("close " + path, errno);
  return s;
}

Result<SafetensorsHeader> read_safetensors_header(int fd, uint64_t file_size) {
  uint64_t n = 0;
  if (file_size < sizeof(n))
    return Status(StatusCode::kDataLoss, "safetensors file shorter than 8 bytes");
  ECX_RETURN_IF_ERROR(pread_all(fd, &n, sizeof(n), 0, "read safetensors header length"));
  if (n > kMaxHeaderBytes || n > file_size - sizeof(n)) {
    return Status(StatusCode::kDataLoss, "safetensors header length " + std::to_string(n) +
                                             " exceeds the file or the 100 MiB limit");
  }
  std::string text(n, '\0');
  ECX_RETURN_IF_ERROR(pread_all(fd, text.data(), n, sizeof(n), "read safetensors header"));
  auto j = parse_json_object(text, "safetensors header", {kMaxHeaderBytes, 8});
  if (!j.ok()) return Status(StatusCode::kDataLoss, j.status().message());
  SafetensorsHeader h;
  h.data_offset = sizeof(n) + n;
  uint64_t data_bytes = file_size - h.data_offset;
  for (const auto& [name, value] : j->items()) {
    if (name == "__metadata__") {
      if (!value.is_object())
        return Status(StatusCode::kDataLoss, "safetensors __metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string())
          return Status(StatusCode::kDataLoss, "safetensors metadata values must be strings");
        h.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    if (!value.is_object())
      return Status(StatusCode::kDataLoss, "safetensors entry " + name + " is not an object");
    SafetensorsEntry e;
    e.name = name;
    auto meta = TensorMeta::from_json(value);
    if (!meta.ok()) return meta.status().with_context("safetensors entry " + name);
    e.meta = *meta;
    auto offsets = value.find("data_offsets");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
        !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
      return Status(StatusCode::kDataLoss, "safetensors entry " + name + " has bad data_offsets");
    }
    e.begin = (*offsets)[0].get<uint64_t>();
    e.end = (*offsets)[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_bytes || e.end - e.begin != e.meta.byte_size()) {
      return Status(StatusCode::kDataLoss, "safetensors entry " + name + ": byte range [" +
                                               std::to_string(e.begin) + ", " +
                                               std::to_string(e.end) + ") does not fit " +
                                               e.meta.to_string() + " in the file");
    }
    h.tensors.push_back(std::move(e));
  }
  return h;
}

Status read_safetensors_tensor(int fd, const SafetensorsHeader& header,
                               const SafetensorsEntry& entry, std::span<std::byte> out) {
  if (out.size() != entry.end - entry.begin) {
    return InvalidArgument("buffer of " + std::to_string(out.size()) + " bytes for tensor " +
                           entry.name + " of " + std::to_string(entry.end - entry.begin));
  }
  return pread_all(fd, out.data(), out.size(), header.data_offset + entry.begin,
                   "read safetensors data");
}

}  // namespace ecx
