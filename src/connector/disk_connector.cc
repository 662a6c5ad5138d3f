// disk connector: one safetensors file per mm_hash under a shared root, laid out as
// vLLM's example connector does: <root>/<mm_hash>/encoder_cache.safetensors. Files are
// written under a temporary name and renamed; a consumer that finds only the temporary
// file waits for the rename with inotify (bounded by its deadline). Files are deleted
// on release (configurable) or after a TTL, and the root is capped in size (oldest
// files go first).
#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>

#include "connector/connector_driver.h"
#include "ecx/common/checksum.h"
#include "ecx/common/log.h"
#include "ecx/common/mutex.h"
#include "ecx/common/safetensors.h"

namespace ecx::connector {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFileName = "encoder_cache.safetensors";
constexpr const char* kTensorName = "ec_cache";

class DiskDriver final : public ConnectorDriver {
 public:
  explicit DiskDriver(ConnectorCore& core) : core_(core), root_(core.options().root) {}

  Status start() {
    std::error_code ec;
    fs::create_directories(root_, ec);
    if (ec)
      return IoError("disk connector: cannot create root " + root_.string() + ": " + ec.message());
    return Status::Ok();
  }

  // ---------------- producer ----------------

  Result<SaveSlot> begin_save(const MmHash& mm_hash, const TensorMeta& meta) override {
    ECX_RETURN_IF_ERROR(meta.validate());
    fs::path dir = root_ / mm_hash.str();
    std::error_code ec;
    if (fs::exists(dir / kFileName, ec)) {
      return Status(StatusCode::kAlreadyExists, "disk cache already has " + mm_hash.str());
    }
    fs::create_directories(dir, ec);
    if (ec) return IoError("create " + dir.string() + ": " + ec.message());
    uint64_t token = next_token_++;
    fs::path tmp = dir / (".tmp." + std::to_string(::getpid()) + "." + std::to_string(token));
    // The temporary file marks the entry as being written (consumers wait for it).
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoError("create " + tmp.string(), errno);
    ::close(fd);
    MutexLock lock(&mu_);
    auto& staging = staging_[token];
    staging.tmp = tmp;
    staging.bytes.resize(meta.byte_size());
    return SaveSlot{mm_hash, meta, {staging.bytes.data(), staging.bytes.size()}, token};
  }

  Result<EcTransferParams> commit_save(const SaveSlot& slot) override {
    Staging staging;
    {
      MutexLock lock(&mu_);
      auto it = staging_.find(slot.token);
      if (it == staging_.end())
        return NotFound("disk connector: no save in progress for " + slot.mm_hash.str());
      staging = std::move(it->second);
      staging_.erase(it);
    }
    std::map<std::string, std::string> metadata = {
        {"mm_hash", slot.mm_hash.str()},
        {"compat_hash", core_.options().compat_hash},
        {"checksum", std::to_string(checksum64(staging.bytes.data(), staging.bytes.size()))}};
    Status s = write_safetensors(staging.tmp.string(), {{kTensorName, slot.meta, staging.bytes}},
                                 metadata);
    fs::path final_path = staging.tmp.parent_path() / kFileName;
    if (s.ok() && ::rename(staging.tmp.c_str(), final_path.c_str()) != 0) {
      s = ErrnoError("rename to " + final_path.string(), errno);
    }
    if (!s.ok()) {
      ::unlink(staging.tmp.c_str());
      return s;
    }
    enforce_limits();
    return core_.keyed_params(slot.mm_hash, slot.meta);
  }

  Result<EcTransferParams> saved_params(const MmHash& mm_hash) override {
    std::error_code ec;
    fs::path path = root_ / mm_hash.str() / kFileName;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NotFound("disk cache has no " + mm_hash.str());
    struct stat st {};
    ::fstat(fd, &st);
    auto header = read_safetensors_header(fd, static_cast<uint64_t>(st.st_size));
    ::close(fd);
    if (!header.ok()) return header.status();
    const SafetensorsEntry* e = header->find(kTensorName);
    if (e == nullptr)
      return Status(StatusCode::kDataLoss, path.string() + " has no ec_cache tensor");
    return core_.keyed_params(mm_hash, e->meta);
  }

  void abort_save(const SaveSlot& slot) override {
    MutexLock lock(&mu_);
    auto it = staging_.find(slot.token);
    if (it == staging_.end()) return;
    ::unlink(it->second.tmp.c_str());
    staging_.erase(it);
  }

  // TTL and size cap, oldest files first. A reader that has a file open keeps its bytes.
  void enforce_limits() {
    std::error_code ec;
    struct File {
      fs::path dir;
      uint64_t size;
      fs::file_time_type mtime;
    };
    std::vector<File> files;
    uint64_t total = 0;
    auto now = fs::file_time_type::clock::now();
    for (const auto& dir : fs::directory_iterator(root_, ec)) {
      fs::path f = dir.path() / kFileName;
      std::error_code e2;
      auto size = fs::file_size(f, e2);
      if (e2) continue;
      auto mtime = fs::last_write_time(f, e2);
      if (e2) continue;
      if (now - mtime > std::chrono::seconds(core_.options().ttl_s)) {
        remove_entry(dir.path());
        expired_++;
        continue;
      }
      files.push_back({dir.path(), size, mtime});
      total += size;
    }
    std::sort(files.begin(), files.end(),
              [](const File& a, const File& b) { return a.mtime < b.mtime; });
    for (const auto& f : files) {
      if (total <= core_.options().max_bytes) break;
      remove_entry(f.dir);
      total -= f.size;
      evicted_++;
    }
    bytes_on_disk_ = total;
  }

  void remove_entry(const fs::path& dir) {
    std::error_code ec;
    fs::remove(dir / kFileName, ec);
    fs::remove(dir, ec);  // only if empty (a writer may be mid-save)
  }

  // ---------------- consumer ----------------

  bool can_load(const LoadItem& item) override {
    if (item.params) return item.params->connector == "disk";
    std::error_code ec;
    return fs::exists(root_ / item.mm_hash.str() / kFileName, ec);
  }

  void fetch(std::vector<FetchSlot*>& slots, Deadline deadline) override {
    for (FetchSlot* slot : slots) {
      slot->status = slot->item->params ? core_.check_compat(slot->item->params->engine_id,
                                                             slot->item->params->compat_hash)
                                        : Status::Ok();
      if (slot->status.ok()) slot->status = fetch_one(*slot, deadline);
    }
  }

  Status fetch_one(FetchSlot& slot, Deadline deadline) {
    const MmHash& mm_hash = slot.item->mm_hash;
    fs::path dir = root_ / mm_hash.str();
    fs::path path = dir / kFileName;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && being_written(dir)) {
      core_.note_not_ready(mm_hash);
      ECX_RETURN_IF_ERROR(wait_for_file(dir, deadline));
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (fd < 0) {
      if (errno == ENOENT)
        return NotFound("disk cache has no " + mm_hash.str() + " under " + root_.string());
      return ErrnoError("open " + path.string(), errno);
    }
    struct stat st {};
    ::fstat(fd, &st);
    auto header = read_safetensors_header(fd, static_cast<uint64_t>(st.st_size));
    Status s = header.ok() ? Status::Ok() : header.status().with_context(path.string());
    const SafetensorsEntry* e = header.ok() ? header->find(kTensorName) : nullptr;
    if (s.ok() && e == nullptr)
      s = Status(StatusCode::kDataLoss, path.string() + " has no ec_cache tensor");
    if (s.ok()) {
      auto compat = header->metadata.find("compat_hash");
      s = core_.check_compat(path.string(), compat == header->metadata.end() ? "" : compat->second);
    }
    if (s.ok() && !(e->meta == slot.item->meta)) {
      s = InvalidArgument(path.string() + " holds " + e->meta.to_string() + ", expected " +
                          slot.item->meta.to_string());
    }
    if (s.ok())
      s = read_safetensors_tensor(fd, *header, *e,
                                  {slot.block.payload(), slot.item->meta.byte_size()});
    ::close(fd);
    if (s.ok() && core_.options().verify_checksum(/*crossed=*/true)) {
      auto sum = header->metadata.find("checksum");
      if (sum == header->metadata.end() ||
          sum->second !=
              std::to_string(checksum64(slot.block.payload(), slot.item->meta.byte_size()))) {
        s = Status(StatusCode::kDataLoss, path.string() + ": payload checksum mismatch");
      }
    }
    if (s.ok()) s = core_.consumer_cache()->commit(mm_hash, slot.block.generation);
    return s;
  }

  static bool being_written(const fs::path& dir) {
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(dir, ec)) {
      if (f.path().filename().string().rfind(".tmp.", 0) == 0) return true;
    }
    return false;
  }

  // Waits (inotify, no polling) until the final file appears or the writer gives up.
  Status wait_for_file(const fs::path& dir, Deadline deadline) {
    int fd = ::inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (fd < 0) return ErrnoError("inotify_init1", errno);
    int wd =
        ::inotify_add_watch(fd, dir.c_str(), IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF);
    Status result =
        Status(StatusCode::kNotReady, dir.string() + ": still being written at the deadline");
    std::error_code ec;
    while (wd >= 0) {
      if (fs::exists(dir / kFileName, ec)) {  // checked after the watch exists: no lost wake-up
        result = Status::Ok();
        break;
      }
      if (!being_written(dir)) {
        result = NotFound(dir.string() + ": the writer gave up");
        break;
      }
      pollfd p{fd, POLLIN, 0};
      int rc = ::poll(&p, 1, deadline.poll_timeout_ms());
      if (rc <= 0) break;
      char buf[4096];
      while (::read(fd, buf, sizeof(buf)) > 0) {
      }
    }
    ::close(fd);
    return result;
  }

  void on_request_finished(const LoadRequest& request) override {
    if (!core_.options().delete_on_release) return;
    for (const auto& item : request.items) {
      if (item.params && item.params->connector == "disk") {
        remove_entry(root_ / item.mm_hash.str());
        released_++;
      }
    }
  }

  void add_stats(ConnectorStats& s) const override {
    s.disk = ConnectorStats::Disk{.root = root_.string(),
                                  .bytes_on_disk = bytes_on_disk_.load(),
                                  .files_evicted = evicted_.load(),
                                  .files_expired = expired_.load(),
                                  .files_released = released_.load()};
  }

 private:
  struct Staging {
    fs::path tmp;
    std::vector<std::byte> bytes;
  };
  ConnectorCore& core_;
  const fs::path root_;
  std::atomic<uint64_t> next_token_{1};
  Mutex mu_;
  std::map<uint64_t, Staging> staging_ ECX_GUARDED_BY(mu_);
  std::atomic<uint64_t> bytes_on_disk_{0}, evicted_{0}, expired_{0}, released_{0};
};

}  // namespace

Result<std::unique_ptr<EcConnector>> create_disk_connector(ConnectorConfig config,
                                                           ConnectorOptions options,
                                                           ConnectorContext context) {
  return make_connector(driver_kind<DiskDriver>("disk"), std::move(config), std::move(options),
                        std::move(context));
}

}  // namespace ecx::connector
