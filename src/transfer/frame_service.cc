// The backends' serving side (frame_service.h): READ and WRITE on a stream, REGION_QUERY.
#include "transfer/frame_service.h"

#include <algorithm>
#include <vector>

#include "wire/socket.h"

namespace ecx::transfer {
namespace {

// A WRITE that fails validation is drained (to keep the stream in sync) up to this
// size; a larger one closes the connection instead.
constexpr uint64_t kMaxDrainBytes = 64ull << 20;

FrameHeader reply_header(FrameType type, uint64_t id) {
  FrameHeader h;
  h.type = static_cast<uint16_t>(type);
  h.id = id;
  return h;
}

// Reads and drops `length` bytes (a refused WRITE's data); false if the stream broke.
bool drain(int fd, uint64_t length) {
  std::vector<char> sink(std::min<uint64_t>(length, 1 << 20));
  for (uint64_t left = length; left > 0;) {
    uint64_t n = std::min<uint64_t>(left, sink.size());
    if (!recv_all(fd, sink.data(), n, Deadline::after_ms(kServeReplyTimeoutMs), "drain WRITE")
             .ok()) {
      return false;
    }
    left -= n;
  }
  return true;
}

bool serve_read(const ServeContext& context, const ServedFrame& frame) {
  const FrameHeader& h = *frame.header;
  auto region = context.regions->check_access(h.region, h.offset, h.length, /*write=*/false,
                                              frame.caller->holder, *frame.capability);
  if (!region.ok()) {
    context.stats->rejected_requests++;
    return send_error(frame.fd, h.id, region.status()).ok();
  }
  // A peer that stops reading loses the connection, not a server thread.
  Deadline reply_deadline = Deadline::after_ms(context.config->data_timeout_ms);
  FrameHeader reply = reply_header(FrameType::kReadData, h.id);
  reply.length = h.length;
  if (!send_frame(frame.fd, reply, std::string(), reply_deadline).ok()) return false;
  const std::byte* src = (*region)->data + h.offset;
  return context.io->load(std::memory_order_acquire)
      ->send_read_data(frame.fd, src, h.length, reply_deadline)
      .ok();
}

bool serve_write(const ServeContext& context, const ServedFrame& frame) {
  const FrameHeader& h = *frame.header;
  const int fd = frame.fd;
  auto region = context.regions->begin_write(h.region, h.offset, h.length, frame.caller->holder,
                                             *frame.capability, fd);
  if (!region.ok()) {
    context.stats->rejected_requests++;
    // The refused data is drained to keep the stream in sync, up to kMaxDrainBytes.
    if (h.length > kMaxDrainBytes) {
      send_error(fd, h.id, region.status()).ignore_error();
      return false;
    }
    if (!drain(fd, h.length)) return false;
    return send_error(fd, h.id, region.status()).ok();
  }
  Status got = recv_all(fd, (*region)->data + h.offset, h.length,
                        Deadline::after_ms(context.config->data_timeout_ms), "receive WRITE data");
  context.regions->end_write(*frame.capability, fd);
  if (!got.ok()) return false;  // stalled, hung up, or cut by a revoke: the stream is lost
  return send_frame(fd, reply_header(FrameType::kWriteAck, h.id), std::string(),
                    Deadline::after_ms(kServeReplyTimeoutMs))
      .ok();
}

bool serve_region_query(const ServeContext& context, const ServedFrame& frame) {
  const FrameHeader& h = *frame.header;
  const int fd = frame.fd;
  if (Status allowed =
          context.regions->check_region_grant(h.region, frame.caller->holder, *frame.capability);
      !allowed.ok()) {
    context.stats->rejected_requests++;
    return send_error(fd, h.id, allowed).ok();
  }
  auto region = context.regions->find(h.region);
  if (!region) {
    context.stats->rejected_requests++;
    return send_error(fd, h.id,
                      NotFound("region " + std::to_string(h.region) + " on agent " +
                               context.config->name + ": no such region"))
        .ok();
  }
  FrameHeader reply = reply_header(FrameType::kRegionInfo, h.id);
  reply.region = h.region;
  reply.length = region->length;
  if (region->access.remote_write) reply.flags |= kRegionRemoteWrite;
  if (region->access.remote_read) reply.flags |= kRegionRemoteRead;
  const bool wants_data = (h.flags & kRegionQueryBackendData) != 0;
  if (frame.unix_socket && region->memfd.valid() && !wants_data) {
    reply.flags |= kRegionHasFd;
    reply.magic = kFrameMagic;
    return send_with_fd(fd, &reply, sizeof(reply), region->memfd.get()).ok();
  }
  // The backend's data of the region (empty when that backend did not register it).
  std::string data;
  if (wants_data) {
    auto it = region->backends.find(static_cast<Backend>(h.flags >> 8));
    if (it != region->backends.end()) data = it->second.data;
  }
  return send_frame(fd, reply, data, Deadline::after_ms(kServeReplyTimeoutMs)).ok();
}

}  // namespace

void add_stream_service(FrameServices& services, const ServeContext& context) {
  services.try_emplace(FrameType::kRead,
                       [context](const ServedFrame& f) { return serve_read(context, f); });
  services.try_emplace(FrameType::kWrite,
                       [context](const ServedFrame& f) { return serve_write(context, f); });
}

void add_region_query_service(FrameServices& services, const ServeContext& context) {
  services.try_emplace(FrameType::kRegionQuery,
                       [context](const ServedFrame& f) { return serve_region_query(context, f); });
}

}  // namespace ecx::transfer
